"""The hierarchical cache, measured on the best flags: what the host tier buys, on equal terms.

The space searches the cache only where the workload's reuse says it pays
(:func:`tuner.study.space.decide_hicache`), so as soon as a planned config is the best, it is
launched once more with the hierarchical cache on (not after every cache-off setting), at the
largest host pool of the space's grid that fits this host (``shared/sglang-reference.md`` §7), so
what the cache buys is measured on the same flags; and once the planner has nothing left, on the
final best flags.
"""

from __future__ import annotations

from typing import Any

from tuner.config import ObjectiveSection
from tuner.records import Prediction
from tuner.study.best import best_by
from tuner.study.decide import Proposal, Screen
from tuner.study.space import HICACHE_KNOBS, config_key
from tuner.study.view import StudyView

__all__ = ["CacheCandidate"]


class CacheCandidate:
    """The best flags with the hierarchical cache on (a :class:`~tuner.study.decide.Proposer`).

    Args:
        objective: ``[objective]`` (what "best" means).
        host: The host-memory screen (:class:`tuner.study.decide.screens.HostMemory`): the
            largest pool of the grid that passes it is proposed.
        early: Propose it as soon as a planned config is the best (the space searches the cache
            only where the workload's reuse says it pays, :func:`tuner.study.space.decide_hicache`),
            once, before the memory frontier's other steps; the late one (after the planner has
            nothing else) measures it on the final best flags.
    """

    def __init__(self, objective: ObjectiveSection, host: Screen, *, early: bool = False) -> None:
        self.objective = objective
        self.host = host
        self.early = early

    def propose(self, view: StudyView) -> Proposal | None:
        """``None`` when the space does not search the cache, nothing is feasible yet, the best
        already uses it, that config was tried, or no pool of the grid fits this host."""
        space = view.space
        on = space.hicache_on()
        if not on:
            return None
        objective = self.objective
        choice = best_by([(n, r) for n, r in view.finished if r.params], objective)
        if choice is None:
            return None
        best = dict(choice.record.params)
        if best.get("enable_hierarchical_cache"):
            return None
        if self.early and (choice.record.kind == "baseline"
                           or any(r.params.get("enable_hierarchical_cache") for _, r in view.finished)):
            return None  # early: once, on the first planned config that is best
        base = {k: v for k, v in best.items() if k not in HICACHE_KNOBS}
        # The host pool's knob (hicache_size replaces hicache_ratio), largest pool first.
        knob = next((k for k in ("hicache_size", "hicache_ratio") if k in on), "")
        grid: list[Any] = space.grid(knob)[::-1] if knob else [None]
        for value in grid:
            params = space.snap({**base, **on, **({knob: value} if knob else {})})
            if config_key(params) in view.tried:
                return None
            if self.host.why_not(params, view) is None:
                return Proposal(params=params, prediction=Prediction(
                    why=f"the hierarchical cache on the best flags so far (trial {choice.number}), "
                        f"at the largest host pool that fits this host ({knob or 'default'} {value})",
                    compare_with_trial=choice.number))
        return None
