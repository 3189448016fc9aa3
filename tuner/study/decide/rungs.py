"""The structural levers' rungs, launched early on the best flags: what fp8 KV, DCP or DP attention buys.

When the space searches a structural lever (``kv_cache_dtype``, ``dcp_size``, ``dp_size``; issue
23), the rungs (combinations of their values) are priced with SGLang's rules on the baseline's
start (:class:`RungPrices`, the ladder of :mod:`tuner.sglang.ladder`), placed at each rung's own
predicted optimum (fraction and request slots), and the one predicted to hold the most contexts
is launched first, as soon as the baseline is measured and before the memory frontier moves the
fraction: a rung can change capacity by more than the fraction can. That first launch of a rung
is its boot probe: the memory model is then calibrated on the rung's own KV cell, weights and
graphs (:func:`rung_points`), and the frontier takes it to its measured optimum. A rung the
version cannot take is skipped by the screens with the fact
(:class:`tuner.study.decide.screens.Unavailable`), never launched.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import tuner.knobs
from tuner.config import ObjectiveSection
from tuner.records import Prediction, TrialRecord
from tuner.sglang.flags import flag_int, flag_value
from tuner.sglang.ladder import LadderBase, Rung, evaluate
from tuner.sglang.modelconfig import ModelArch
from tuner.study.best import best_by
from tuner.study.calibration import Family, Point, deployment_capacity
from tuner.study.decide import Proposal
from tuner.study.slo_bound import family_of
from tuner.study.space import config_key
from tuner.study.view import StudyView

__all__ = ["RungCandidate", "RungPrices", "lever_gain", "lever_neutral", "rung_flags", "same_rung", "rung_points"]



def lever_gain(name: str, value: Any) -> float:
    """The most knob ``name``'s ``value`` can multiply the logical pool at an unchanged budget
    (:meth:`tuner.knobs.Lever.gain`: plain MLA for DCP; ``tuner.sglang.levers.dcp_gain`` is smaller
    with a DSA indexer), for the order of the rungs."""
    return next(lever.gain(value) for lever in tuner.knobs.LEVERS if lever.knob.name == name)


def lever_neutral() -> dict[str, Any]:
    """Each lever's value that sets nothing in SGLang by knob name (:attr:`tuner.knobs.Lever.neutral`:
    the KV cache at the model's dtype, no DCP, no DP attention): a config without the knob runs it."""
    return {lever.knob.name: lever.neutral for lever in tuner.knobs.LEVERS}


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
        self._bases: dict[int, LadderBase] = {}  # by the baseline's trial number: its record never changes

    def base(self, view: StudyView) -> tuple[int, TrialRecord, LadderBase] | None:
        """The baseline's trial number, record and ladder base, or ``None`` before a baseline with a memory model."""
        found = next(((n, r) for n, r in view.finished if r.kind == "baseline" and r.memory.capacity_model), None)
        if found is None:
            return None
        number, record = found
        if number not in self._bases:  # priced per fraction of every rung on each decision: built once
            self._bases[number] = self._base(record)
        return number, record, self._bases[number]

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
                                     ("enable_dp_attention", True if dp > 1 else None)) if v is not None},
            levers=tuner.knobs.LEVERS)

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
    """The ladder's flags of a candidate's levers (:meth:`tuner.knobs.Lever.rung`: ``dp_size`` > 1 is DP attention on)."""
    flags: dict[str, Any] = {}
    for lever in tuner.knobs.LEVERS:
        flags.update(lever.rung(params.get(lever.knob.name)))
    return flags


class RungCandidate:
    """The structural rung with the highest priced capacity, at its own predicted optimum (a
    :class:`~tuner.study.decide.Proposer`).

    Every combination of the searched levers' values (fp8 KV × DCP × DP attention) that no trial
    ran or skipped is priced with the ladder on the baseline's start (:class:`RungPrices`) on the
    best flags so far, at each fraction of the space's grid; a fraction counts where the rung
    starts, one request of the study's context fits the one request's ceiling, and the ladder leaves
    the headroom the stress load needs after the baseline's graphs
    (:meth:`~tuner.study.calibration.Calibration.need_gib`). Each rung is placed at the smallest
    such fraction that reaches its highest capacity across the deployment
    (:func:`~tuner.study.calibration.deployment_capacity`: DP ranks, DCP's interleave), with the
    request slots that capacity needs (up to the space's top). The rung predicted to hold the most
    contexts is launched first (ties: fewer levers moved from the best, then more memory free).
    A rung is worth a launch when its predicted capacity is above the best trial's OOM-safe one, or
    when it lies in the best feasible trial's capacity band
    (:attr:`~tuner.study.view.StudyView.band_floor`) one lever from the best's rung, at a lever value
    no launch ran (it may win on throughput there); a rung below the band cannot win on the
    policy, and the band's other combinations are left to the sampler. That launch is the rung's boot probe: it calibrates the memory model on the rung's own cell
    and weights, and the memory frontier takes the rung from there (issue 23).

    Where a fresh rung has no price (no baseline memory model yet, or no model ``config.json``:
    the ladder cannot size the KV cell or DP attention's weights), each lever value is launched once on the best flags, largest
    :func:`lever_gain` first. A rung the version cannot take is skipped by the screens with the
    fact (:class:`tuner.study.decide.screens.Unavailable`), never launched.

    Args:
        objective: ``[objective]`` (what "best" means).
        prices: The rung pricer (``None``: unpriced rungs at the best flags' fraction).
    """

    def __init__(self, objective: ObjectiveSection, prices: RungPrices | None = None) -> None:
        self.objective = objective
        self.prices = prices

    def propose(self, view: StudyView) -> Proposal | None:
        """``None`` when the space names no lever, nothing is measured yet, or every rung that can
        win was tried."""
        space = view.space
        levers = {name: space.grid(name) for lever in tuner.knobs.LEVERS if space.searches(name := lever.knob.name)}
        if not levers:
            return None
        choice = best_by([(n, r) for n, r in view.finished if r.params], self.objective)
        if choice is None:
            return None
        best: dict[str, Any] = dict(choice.record.params)
        ran = [rung_flags(r.params) for _, r in view.finished if r.params]
        combos = [space.snap({**best, **dict(zip(levers, values, strict=True))}) for values in itertools.product(*levers.values())]
        fresh = [params for params in combos if rung_flags(params) not in ran]
        if not fresh:
            return None  # every rung was launched (or skipped) once: the frontier takes them from there
        if view.calibration.model_points and all(self._priceable(params, view) for params in fresh):
            return self._priced(fresh, best, (choice.number, choice.record.context_capacity or 0), view)
        return self._unpriced(levers, best, choice.number, view)

    def _priced(self, fresh: Sequence[dict[str, Any]], best: Mapping[str, Any], incumbent: tuple[int, int],
                view: StudyView) -> Proposal | None:
        """The fresh rung with the highest priced capacity at its predicted optimum, or ``None``
        when no fresh rung is worth a launch (or none could be priced and placed).

        ``incumbent`` is the best trial's number and OOM-safe context capacity (what the ladder
        prices: a rung's SLO-safe capacity is only measured)."""
        best_number, mine = incumbent
        placed = [found for params in fresh if (found := self._place(params, view)) is not None]
        floor = view.band_floor
        run_values = {(k, v) for _, r in view.finished if r.params for k, v in rung_flags(r.params).items()}

        def worth(item: tuple[dict[str, Any], int, Rung]) -> bool:
            # Above the best's measured capacity; or in its band, one lever from the best's rung
            # to a value no launch ran (the band's throughput): never every combination in the band.
            if item[1] > mine:
                return True
            moved = _moved(rung_flags(item[0]), rung_flags(best))
            return item[1] >= floor and len(moved) == 1 and not set(moved.items()) <= run_values
        ranked = sorted(filter(worth, placed), key=lambda p: (-p[1], len(_moved(rung_flags(p[0]), rung_flags(best))),
                                                              -(p[2].free_after_graphs_gib or 0.0)))
        for params, capacity, rung in ranked:
            if config_key(params) in view.tried:
                continue
            levers = ", ".join(f"{k}={v}" for k, v in _moved(rung_flags(params), rung_flags(best)).items())
            return Proposal(params=params, prediction=Prediction(
                token_capacity=rung.tokens_per_rank, context_capacity=capacity,
                free_gib_after_graphs=rung.free_after_graphs_gib,
                why=f"rung {levers} on the best flags so far (trial {best_number}), the highest context capacity "
                       f"the ladder prices on the baseline's start: {capacity} at {params['mem_fraction_static']:g} "
                       f"with {params['max_running_requests']} request slots ({rung.tokens_per_rank:,} tokens per rank, "
                       f"{rung.free_after_graphs_gib} GiB free after the baseline's graphs; issue 23); its boot "
                       "probe calibrates the memory model for this rung",
                compare_with_trial=best_number))
        return None

    def _priceable(self, params: Mapping[str, Any], view: StudyView) -> bool:
        """Whether the ladder prices ``params``' rung (a baseline memory model, and the model's
        ``config.json`` where the rung needs it: the KV cell, DP attention's weights)."""
        priced = None if self.prices is None else self.prices.price(params, view)
        return priced is not None and priced[1].tokens_per_rank is not None

    def _place(self, params: dict[str, Any], view: StudyView) -> tuple[dict[str, Any], int, Rung] | None:
        """``(params, predicted context capacity, rung)`` of ``params``' rung at the smallest grid
        fraction reaching its highest capacity where it starts with the headroom and one context
        fits, with the slots that capacity needs; ``None`` where no fraction does."""
        assert self.prices is not None
        space, context = view.space, view.settings.context_tokens
        low, high = space.max_running_requests
        slots = int(params.get("max_running_requests") or high)
        cal = view.calibration
        options: list[tuple[int, float, dict[str, Any], Rung]] = []
        for mfs in space.fractions():
            at = space.snap({**params, "mem_fraction_static": mfs})
            priced = self.prices.price(at, view)
            if priced is None:
                return None
            rung = priced[1]
            tokens = rung.tokens_per_rank or 0
            if not rung.starts or tokens <= 0 or (rung.per_request_max_tokens or 0) < context:
                continue
            family = family_of(at)
            if (rung.free_after_graphs_gib or 0.0) < cal.need_gib(family):
                continue
            # The slots the rung's pool can fill (never fewer than the best's own count).
            mrr = max(slots, min(high, deployment_capacity(family, high, tokens, context)))
            at = space.snap({**at, "max_running_requests": max(low, mrr)})
            capacity = deployment_capacity(family, int(at["max_running_requests"]), tokens, context)
            options.append((capacity, mfs, at, rung))
        if not options:
            return None
        top = max(o[0] for o in options)
        capacity, _mfs, at, rung = min((o for o in options if o[0] == top), key=lambda o: o[1])
        return at, capacity, rung

    def _unpriced(self, levers: Mapping[str, Sequence[Any]], best: Mapping[str, Any], best_number: int,
                  view: StudyView) -> Proposal | None:
        """Each lever value once on the best flags, largest :func:`lever_gain` first."""
        space = view.space
        for name, value in sorted(((n, v) for n, grid in levers.items() for v in grid[1:]),
                                  key=lambda lv: -lever_gain(*lv)):
            if any(r.params.get(name) == value for _, r in view.finished if r.params):
                continue  # this rung was launched (or skipped) once: the frontier takes it from there
            params = space.snap({**best, name: value})
            if config_key(params) in view.tried:
                continue
            return Proposal(params=params, prediction=Prediction(
                why=f"rung {name}={value} on the best flags so far (trial {best_number}): up to "
                    f"{lever_gain(name, value):g}× the logical KV pool at the same budget (issue 23)",
                compare_with_trial=best_number))
        return None


def rung_points(points: Sequence[Point], family: Mapping[str, Any] | Family) -> list[Point]:
    """The calibration points that ran ``family``'s structural rung (:func:`same_rung`): the only
    ones whose KV cell, weights and graphs predict it (another rung's would mispredict its pool)."""
    knobs = dict(family)
    return [p for p in points if same_rung(p.params, knobs)]


def _moved(flags: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """The rung flags ``flags`` sets differently from ``base`` (:func:`rung_flags` of both), less the
    levers' switches (:attr:`tuner.knobs.Lever.switch`: ``enable_dp_attention`` is said by ``dp_size``)."""
    switches = {lever.switch for lever in tuner.knobs.LEVERS}
    return {k: v for k, v in flags.items() if k not in switches and base.get(k) != v}
