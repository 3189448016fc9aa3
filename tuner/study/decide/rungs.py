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

from collections.abc import Mapping, Sequence
from typing import Any

from tuner.config import ObjectiveSection
from tuner.records import TrialRecord
from tuner.sglang.flags import flag_int, flag_value
from tuner.sglang.ladder import LadderBase, Rung, evaluate
from tuner.sglang.modelconfig import ModelArch
from tuner.study.best import best_by
from tuner.study.decide import Proposal
from tuner.study.slo_bound import family_of
from tuner.study.space import config_key
from tuner.study.view import StudyView

__all__ = ["RungCandidate", "RungPrices", "LEVER_GAIN", "LEVER_KNOBS", "LEVER_NEUTRAL", "same_rung"]

LEVER_GAIN = {
    "dcp_size": lambda value: float(value),
    "dp_size": lambda value: float(value),
    "kv_cache_dtype": lambda value: 2.0 if str(value).startswith("fp8") else 1.0,
}
"""The most a lever's value can multiply the logical pool at an unchanged budget (plain MLA for
DCP; ``tuner.sglang.levers.dcp_gain`` is smaller with a DSA indexer), for the order of the rungs."""
LEVER_KNOBS = tuple(LEVER_GAIN)
"""The structural levers' knobs (SGLang field names; ``dp_size`` is DP attention's size)."""
LEVER_NEUTRAL: dict[str, Any] = {"kv_cache_dtype": "auto", "dcp_size": 1, "dp_size": 1}
"""Each lever's value that sets nothing in SGLang (the KV cache at the model's dtype, no DCP, no
DP attention): a config without the knob runs it."""


class RungPrices:
    """A config's structural rung priced with SGLang's rules from the baseline's start (the ladder's
    :func:`tuner.sglang.ladder.evaluate` on a :class:`~tuner.sglang.ladder.LadderBase` made of the
    baseline's calibrated memory model, the model's ``config.json``, the service's command, the
    SGLang version and the GPU): KV tokens per rank, logical tokens, the longest request, free
    memory after graphs and whether it starts.

    The baseline's memory model holds 0.5.5's speculative headroom rows in its budget (not taken
    out here as ``tuner explain`` does): the price is then a little optimistic, so a rung is never
    screened for that.

    Args:
        version: The SGLang version.
        argv: The service's command (``--tp-size``, ``--attention-backend``, ``--speculative-algorithm``).
        model: The model's architecture (``None``: DP attention cannot be priced: ``None``).
        gpu: The GPU's name (the feasibility table's cells).
    """

    def __init__(self, version: str, argv: Sequence[str], model: ModelArch | None, gpu: str | None) -> None:
        self.version = version
        self.model = model
        self.gpu = gpu
        self.tp = flag_int(argv, "--tp-size", "--tp", "--tensor-parallel-size") or 1
        self.backend = flag_value(argv, "--attention-backend")
        self.spec = flag_value(argv, "--speculative-algorithm")

    def base(self, view: StudyView) -> tuple[int, TrialRecord, LadderBase] | None:
        """The baseline's trial number, record and ladder base, or ``None`` before a baseline with a memory model."""
        found = next(((n, r) for n, r in view.finished if r.kind == "baseline" and r.memory.capacity_model), None)
        if found is None:
            return None
        number, record = found
        return number, record, self._base(record)

    def _base(self, record: TrialRecord) -> LadderBase:
        memory, params = record.memory, record.params
        assert memory.capacity_model is not None
        fact = memory.draft

        def draft(name: str) -> float | None:
            value = getattr(fact, name, None)
            return None if value is None else float(value)
        dp = int(params.get("dp_size") or 1)
        spec = self.spec if params.get("speculative_algorithm") is not False else None
        return LadderBase(
            memory=memory.capacity_model, model=self.model, version=self.version, tp=self.tp, dp=dp,
            mem_fraction_static=float(params.get("mem_fraction_static") or memory.capacity_model.observed_mem_fraction_static or 0.88),
            kv_cache_dtype=str(params.get("kv_cache_dtype") or "auto"), speculative_algorithm=spec,
            attention_backend=self.backend, context_len=memory.context_len, page_size=memory.page_size, gpu=self.gpu,
            draft_weight_gib=draft("weight_gib"), draft_kv_gib=draft("kv_gib"), draft_graph_gib=draft("graph_gib"),
            graphs_captured=memory.graph_gib is not None,
            flags={k: v for k, v in (("kv_cache_dtype", params.get("kv_cache_dtype")),
                                     ("enable_dp_attention", True if dp > 1 else None)) if v is not None})

    def price(self, params: Mapping[str, Any], view: StudyView) -> tuple[int, Rung] | None:
        """``(baseline trial, rung)`` of ``params``' levers at its fraction, or ``None`` when the
        config moves no lever from the baseline's or no baseline memory model exists yet."""
        found = self.base(view)
        if found is None:
            return None
        number, record, base = found
        flags = rung_flags(params)
        if flags == rung_flags(record.params):
            return None
        flags["mem_fraction_static"] = float(params.get("mem_fraction_static") or base.mem_fraction_static)
        return number, evaluate(base, flags)


def same_rung(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two configs run the same structural rung (their levers' values, SGLang's no-op
    value for a lever left out: ``auto``, dcp 1, dp 1)."""
    return rung_flags(a) == rung_flags(b)


def rung_flags(params: Mapping[str, Any]) -> dict[str, Any]:
    """The ladder's flags of a candidate's levers (``dp_size`` > 1 is DP attention on)."""
    flags: dict[str, Any] = {"kv_cache_dtype": params.get("kv_cache_dtype") or LEVER_NEUTRAL["kv_cache_dtype"]}
    if int(params.get("dcp_size") or 1) > 1:
        flags["dcp_size"] = int(params["dcp_size"])
    dp = int(params.get("dp_size") or 1)
    flags["enable_dp_attention"] = dp > 1
    if dp > 1:
        flags["dp_size"] = dp
    return flags


class RungCandidate:
    """Each structural lever value once, on the best flags so far (a :class:`~tuner.study.decide.Proposer`).

    A rung the ladder predicts does not start at the best flags' fraction (DP attention's
    replicated weights) is proposed at the largest fraction of the space's grid where the ladder
    leaves the headroom the stress load needs after the baseline's graphs
    (:meth:`~tuner.study.calibration.Calibration.need_gib`) and one request of the study's context
    fits; where none does, it is proposed as is, and the screens skip it with the arithmetic.

    Args:
        objective: ``[objective]`` (what "best" means).
        prices: The rung pricer (``None``: rungs at the best flags' fraction, unpriced).
    """

    def __init__(self, objective: ObjectiveSection, prices: RungPrices | None = None) -> None:
        self.objective = objective
        self.prices = prices

    def _lift(self, params: dict[str, Any], view: StudyView) -> tuple[dict[str, Any], str]:
        """``params`` at the largest grid fraction where the rung starts with the headroom and one context fits."""
        if self.prices is None:
            return params, ""
        priced = self.prices.price(params, view)
        if priced is None or priced[1].starts is not False:
            return params, ""
        need = view.settings.context_tokens
        fits = []
        for mfs in view.space.fractions():
            if mfs <= float(params["mem_fraction_static"]):
                continue
            lifted = view.space.snap({**params, "mem_fraction_static": mfs})
            rung = self.prices.price(lifted, view)
            if rung is None or not rung[1].starts or (rung[1].per_request_max_tokens or 0) < need:
                continue
            headroom = view.calibration.need_gib(family_of(lifted)) if view.calibration.model_points else 0.0
            if (rung[1].free_after_graphs_gib or 0.0) >= headroom:
                fits.append((lifted, mfs, rung[1]))
        if not fits:
            return params, ""
        lifted, mfs, top = fits[-1]
        return lifted, (f"; at {mfs:g}, the largest fraction where the ladder leaves the headroom the stress load "
                        f"needs after the baseline's graphs ({top.free_after_graphs_gib} GiB free) and one "
                        f"{need:,}-token context fits ({top.tokens_per_rank:,} tokens per rank)")

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
            params, lifted = self._lift(space.snap({**best, name: value}), view)
            if config_key(params) in view.tried:
                continue
            return Proposal(params=params, prediction={
                "why": f"rung {name}={value} on the best flags so far (trial {choice.number}): up to "
                       f"{LEVER_GAIN[name](value):g}× the logical KV pool at the same budget (issue 23){lifted}",
                "compare_with_trial": choice.number})
        return None
