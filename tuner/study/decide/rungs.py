"""The structural levers' rungs, launched early on the best flags: what fp8 KV or DCP buys, on equal terms.

When ``[space]`` names a structural lever (``kv_cache_dtype``, ``dcp_size``; issue 23), each of its
values the baseline does not use is launched once, as soon as a config is measured, on the best
flags so far, largest expected gain first (DCP ``dcp×`` the logical pool, fp8 KV ``2×`` the tokens
per rank: ``tuner/sglang/levers.py``), before the memory frontier moves the fraction: a rung can
change capacity by more than the fraction can, so it is measured first, and the frontier then
works on the best rung's flags. A rung the version cannot take is skipped by the screens with the
fact (:class:`tuner.study.decide.screens.Unavailable`), never launched.
"""

from __future__ import annotations

from typing import Any

from tuner.config import ObjectiveSection
from tuner.study.best import best_by
from tuner.study.decide import Proposal
from tuner.study.space import config_key
from tuner.study.view import StudyView

__all__ = ["RungCandidate", "LEVER_GAIN"]

LEVER_GAIN = {
    "dcp_size": lambda value: float(value),
    "kv_cache_dtype": lambda value: 2.0 if str(value).startswith("fp8") else 1.0,
}
"""The most a lever's value can multiply the logical pool at an unchanged budget (plain MLA for
DCP; ``tuner.sglang.levers.dcp_gain`` is smaller with a DSA indexer), for the order of the rungs."""


class RungCandidate:
    """Each structural lever value once, on the best flags so far (a :class:`~tuner.study.decide.Proposer`).

    Args:
        objective: ``[objective]`` (what "best" means).
    """

    def __init__(self, objective: ObjectiveSection) -> None:
        self.objective = objective

    def propose(self, view: StudyView) -> Proposal | None:
        """``None`` when the space names no lever, nothing is measured yet, or every rung was tried."""
        space = view.space
        levers = [(name, value) for name in LEVER_GAIN if space.searches(name) for value in space.grid(name)[1:]]
        if not levers:
            return None
        objective = self.objective
        choice = best_by([(n, r) for n, r in view.finished if r.params], objective)
        if choice is None:
            return None
        best: dict[str, Any] = dict(choice.record.params)
        for name, value in sorted(levers, key=lambda lv: -LEVER_GAIN[lv[0]](lv[1])):
            if any(r.params.get(name) == value for _, r in view.finished if r.params):
                continue  # this rung was launched (or skipped) once: the frontier takes it from there
            params = space.snap({**best, name: value})
            if config_key(params) in view.tried:
                continue
            return Proposal(params=params, prediction={
                "why": f"rung {name}={value} on the best flags so far (trial {choice.number}): up to "
                       f"{LEVER_GAIN[name](value):g}× the logical KV pool at the same budget (issue 23)",
                "compare_with_trial": choice.number})
        return None
