"""The candidate strategy: which config to launch next (the space is :mod:`tuner.study.space`).

The strategy is capacity-first and learns from memory facts rather than by trial and error:

1. The baseline (the unit's current flags) is measured first.
2. The memory model, calibrated on measured trials, predicts for a knob set the token capacity of
   every ``mem_fraction_static`` and the GPU memory left free after CUDA graphs; the activation peak
   measured under the stress load says how much of that headroom serving needs. The planner aims
   at the largest fraction whose predicted headroom still covers that peak with a margin (a prior
   until a prediction has been checked against a start, then the largest over-prediction
   measured, :meth:`Planner.margin_now_gib`) (``shared/sglang-reference.md`` §1.2, §1.6, §1.8, §8), and proposes the smallest fraction that
   reaches the predicted best context capacity (capacity is an integer: more KV than that buys
   nothing for the objective and costs headroom).
3. Each result recalibrates the model: a success moves the calibration point to the new config, a
   memory failure raises the measured need above what that fraction left (and every larger fraction
   with equal or larger other knobs is skipped without a restart, :func:`tuner.sglang.memory.must_fail`).
4. When the capacity frontier stops moving, the planner tries one neighbour per other knob
   (chunked prefill size, max running requests, hierarchical cache, ...) at its own predicted
   frontier; then the Optuna sampler explores the rest.

The latency SLO is a constraint of its own (:mod:`tuner.study.slo_bound`): once a measured window
broke it, the planner first gets feasible (bisects ``max_running_requests`` of that family between
the largest SLO-safe and the smallest SLO-breaking running-request count, from the measured
latencies), then pushes capacity inside the bracket and tries the other chunk sizes at the safe
load; the memory steps above never propose a load a window of the same knobs already broke. No
proposal has more request slots than can change its result
(:func:`tuner.study.budget.reachable_slots`), and :meth:`Planner.screen` skips a sampled config
that is below the best capacity band, beyond those slots, or proved to break the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from tuner.config import BudgetSection
from tuner.records import TrialRecord
from tuner.sglang.failures import RESERVE_FAILURES, FailureClass
from tuner.sglang.memory import KVCapacityModel
from tuner.study.budget import load_concurrency, reachable_slots
from tuner.study.slo_bound import SLOBound, slo_bounds, slo_points
from tuner.study.space import Space, config_key

__all__ = ["Candidate", "Planner"]

_CEILING_FAILURES = RESERVE_FAILURES
"""Failures that bound ``mem_fraction_static`` from above (the reserve was too small, §1.6); a KV
page shortfall or a retraction storm never does (:data:`tuner.sglang.failures.KV_SHORT_FAILURES`)."""


_LOG_RESOLUTION_GIB = 0.01
"""What two free-memory figures read from SGLang's log can differ by from rounding alone (each is
printed as ``{X:.2f}`` GB, ``shared/sglang-reference.md`` §4)."""


class Candidate(BaseModel):
    """A config the planner wants launched next.

    Attributes:
        params: Searched knobs, on the space's grid.
        kind: ``predicted`` (from the memory model).
        prediction: What the model expects (``token_capacity``, ``context_capacity``,
            ``free_gib_after_graphs``, ``need_gib``, ``why``).
    """

    model_config = ConfigDict(frozen=True)

    params: dict[str, Any]
    kind: str = "predicted"
    prediction: dict[str, Any] = Field(default_factory=dict)


class _Point(BaseModel):
    """One measured trial as the planner sees it: its knobs, its calibrated memory model, its peak."""

    model_config = ConfigDict(frozen=True)

    number: int
    params: dict[str, Any]
    slots: int
    model: KVCapacityModel
    context_len: int
    page_size: int
    peak_gib: float | None
    feasible: bool
    capacity: int


class _Calibration(NamedTuple):
    """What :meth:`Planner._points` made of one history (held, so the same object is recognised)."""

    history: Sequence[tuple[int, TrialRecord]]
    size: int
    points: list[_Point]
    slot_cost_gib: float
    margin_gib: float


def _family(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(
        sorted((k, v) for k, v in params.items() if k not in ("mem_fraction_static", "max_running_requests"))
    )


class Planner:
    """Proposes the next config from the memory model and the trials measured so far.

    Args:
        space: The resolved space.
        context_tokens: The context length of context capacity (tokens).
        capacity_tolerance: The policy's capacity band (configs within it may win on throughput).
        peak_safety: Factor on the measured activation peak.
        margin_gib: Extra GiB kept free above the scaled peak while no prediction of the memory
            model has been checked against a start (the first extrapolation from the baseline).
        min_margin_gib: The least extra GiB once predictions have been checked: the margin is
            then the largest over-prediction of free memory measured so far, at least this
            (:meth:`margin_now_gib`).
        longest_input_tokens: The workload's longest prompt (activation peak with chunking off).
        budget: ``[budget]`` (``max_concurrency``: the measured window's streams), or ``None``.
        mean_request_tokens: The workload's mean ``input + output`` (tokens): with ``budget``,
            how many requests a pool can run at once (:func:`tuner.study.budget.reachable_slots`).
    """

    def __init__(
        self,
        space: Space,
        context_tokens: int,
        *,
        capacity_tolerance: float = 0.05,
        peak_safety: float = 1.15,
        margin_gib: float = 0.25,
        min_margin_gib: float = 0.05,
        longest_input_tokens: int | None = None,
        budget: BudgetSection | None = None,
        mean_request_tokens: int | None = None,
    ) -> None:
        self.space = space
        self.budget = budget
        self.mean_request_tokens = mean_request_tokens or context_tokens
        self.context_tokens = context_tokens
        self.capacity_tolerance = capacity_tolerance
        self.peak_safety = peak_safety
        self.margin_gib = margin_gib
        self.min_margin_gib = min_margin_gib
        self._margin_gib = margin_gib
        self.longest_input_tokens = longest_input_tokens or context_tokens
        self._slot_cost_gib = 0.0
        # The last history calibrated on and what it gave. The loop hands one history per decision
        # to :meth:`next` and to every :meth:`screen` of the sampler's draws, so the calibration
        # is made once per decision.
        self._calibrated: _Calibration | None = None

    # -- calibration ---------------------------------------------------------------------------

    def _points(self, history: Sequence[tuple[int, TrialRecord]]) -> list[_Point]:
        """The measured survivors that calibrate the memory model, with the per-slot cost
        (:meth:`_learn_slot_cost`) and the margin (:meth:`margin_now_gib`) set from them; computed
        once per history (the same sequence, unchanged in length, gives the cached result)."""
        cached = self._calibrated
        if cached is not None and cached.history is history and cached.size == len(history):
            self._slot_cost_gib, self._margin_gib = cached.slot_cost_gib, cached.margin_gib
            return cached.points
        points = []
        for number, record in history:
            memory = record.memory
            if (
                record.outcome != "ok"
                or memory.get("probe_only")
                or not memory.get("capacity_model")
                or not memory.get("context_len")
                or record.constraints.get("oom_or_crash", 1.0) > 0
                or record.constraints.get("stress", -1.0) > 0
            ):
                continue
            params = self.space.snap(record.params)
            points.append(
                _Point(
                    number=number,
                    params=params,
                    # The count the server ran with (the baseline's may lie above the space: its
                    # req_to_token table and graphs are that count's, not the snapped one's).
                    slots=int(record.params.get("max_running_requests") or params["max_running_requests"]),
                    model=KVCapacityModel.model_validate(memory["capacity_model"]),
                    context_len=int(memory["context_len"]),
                    page_size=int(memory.get("page_size") or 1),
                    peak_gib=memory.get("peak_activation_gib"),
                    feasible=record.feasible,
                    capacity=record.context_capacity or 0,
                )
            )
        self._learn_slot_cost(points)
        self._margin_gib = self.margin_now_gib(history)
        self._calibrated = _Calibration(history, len(history), points, self._slot_cost_gib, self._margin_gib)
        return points

    def _oom_points(self, history: Sequence[tuple[int, TrialRecord]]) -> list[_Point]:
        """Trials that started and then died of a runtime OOM under load: their startup log still
        calibrates the memory model (the pool and the free memory after graphs were reported), but
        they achieved no capacity and their free memory bounds the activation need from below
        only (never from above). Used when no trial survived its load (e.g. the baseline's own
        flags OOM under the stress load)."""
        out = []
        for number, record in history:
            memory = record.memory
            if (record.failure_class is not FailureClass.RUNTIME_OOM or not record.params
                    or not memory.get("capacity_model") or not memory.get("context_len")):
                continue
            params = self.space.snap(record.params)
            out.append(_Point(
                number=number, params=params,
                slots=int(record.params.get("max_running_requests") or params["max_running_requests"]),
                model=KVCapacityModel.model_validate(memory["capacity_model"]),
                context_len=int(memory["context_len"]), page_size=int(memory.get("page_size") or 1),
                peak_gib=None, feasible=False, capacity=0,
            ))
        return out

    def margin_now_gib(self, history: Sequence[tuple[int, TrialRecord]], *, believed_check: bool = False) -> float:
        """GiB kept free above the scaled activation peak, from how well the memory model predicted.

        Every launched trial with a prediction (``prediction.free_gib_after_graphs``) and a start
        that reported its free memory after graphs (§1.6, ``available_gpu_mem``) checks the
        model: the margin is the largest over-prediction seen (predicted free − measured free,
        GiB), at least :attr:`min_margin_gib`. Before any such check it is :attr:`margin_gib`
        (the model's first extrapolation from the baseline is unverified). An under-prediction
        (more free than predicted) is safe and does not widen the margin. A start that failed
        before reporting its free memory checks nothing here: its failure bounds the fraction
        from above instead (:func:`tuner.sglang.memory.must_fail`).

        Args:
            history: ``(trial number, record)`` of the finished trials.
            believed_check: A running trial's prediction is believed (the believer of
                :meth:`next`): its start counts as one more check, with no error.

        Returns:
            GiB, at least :attr:`min_margin_gib` (:attr:`margin_gib` when nothing was checked).
        """
        over = [
            float(record.prediction["free_gib_after_graphs"]) - record.free_gib_after_graphs
            for _, record in history
            if record.prediction.get("free_gib_after_graphs") is not None and record.free_gib_after_graphs is not None
        ]
        if believed_check:
            over.append(0.0)
        if not over:
            return self.margin_gib
        return max(self.min_margin_gib, *over)

    @staticmethod
    def _reference(family: tuple[tuple[str, Any], ...], mrr: int, points: Sequence[_Point]) -> _Point:
        """The calibration point for ``family`` at ``mrr``: same knobs, the nearest
        ``max_running_requests`` (graphs and the req_to_token table depend on it, §1.6, §2.1),
        then the highest fraction; another family's when the family has none."""
        same = [p for p in points if _family(p.params) == family] or list(points)
        return min(
            same,
            key=lambda p: (abs(math.log(max(1, mrr) / max(1, p.slots))),
                           -p.params["mem_fraction_static"]),
        )

    def _effective_prefill(self, cps: Any) -> float:
        cps = int(cps)
        return float(cps) if cps > 0 else float(min(16384, max(self.longest_input_tokens, 1)))

    def _need_gib(
        self,
        family: tuple[tuple[str, Any], ...],
        points: Sequence[_Point],
        oom_frees: Sequence[tuple[dict[str, Any], float]],
    ) -> float:
        """GiB that must stay free after graphs for configs of ``family`` to survive the stress load.

        Activations grow with the prefill chunk (§1.6), so every observation is scaled by the
        ratio of chunk sizes. With a measured activation peak (GPU monitor), the need is the largest
        scaled peak times :attr:`peak_safety` plus the margin the model's checked predictions allow
        (:meth:`margin_now_gib`; :attr:`margin_gib` before any check). Without one, the need is bracketed: a
        config that survived the stress load with ``f`` GiB free bounds it from above, a runtime
        OOM with ``f`` GiB free bounds it from below; the planner aims halfway (half the smallest
        surviving headroom before any OOM), so it approaches the boundary geometrically and
        crosses it at most about once.
        """
        prefill = self._effective_prefill(dict(family).get("chunked_prefill_size", 1))

        def scale(params: Mapping[str, Any]) -> float:
            return prefill / self._effective_prefill(params.get("chunked_prefill_size", 1))

        # A survivor with an equal or larger chunk bounds the need from above (halving it is the
        # geometric step); one with a smaller chunk only estimates it (no halving).
        estimates = []
        for p in points:
            free = p.model.observed_free_after_graphs_gib
            if free is None:
                continue
            ratio = scale(p.params)
            estimates.append(free * ratio * (0.5 if ratio <= 1.0 else 1.0))
        halved_upper = min(estimates, default=None)
        upper = min(
            (p.model.observed_free_after_graphs_gib * scale(p.params) for p in points
             if p.model.observed_free_after_graphs_gib is not None),
            default=None,
        )
        lower = max((free * scale(params) for params, free in oom_frees), default=None)
        peaks = [p.peak_gib * scale(p.params) for p in points if p.peak_gib]
        if peaks:
            need = max(peaks) * self.peak_safety + self._margin_gib
        elif lower is None:
            need = halved_upper if halved_upper is not None else 2.0
        elif upper is not None and upper > lower:
            need = (lower + upper) / 2
        else:
            need = lower + self.margin_gib
        if lower is not None:
            need = max(need, lower + 0.05)
        return max(need, 0.05)

    def _predict(self, ref: _Point, mfs: float, mrr: int, family: tuple[tuple[str, Any], ...]) -> tuple[int, float]:
        """Predicted ``(max_total_num_tokens, free GiB after graphs)`` (§1.2, §1.6, §8).

        More request slots than the calibration point also cost what the memory model cannot
        see (CUDA graphs are captured up to the request count, §2.1): the per-slot cost learned
        from measured pairs (:meth:`_learn_slot_cost`) is charged for them.
        """
        graph_bs = dict(family).get("cuda_graph_max_bs")
        tokens = ref.model.tokens(mfs, page_size=ref.page_size)
        free = ref.model.headroom_gib(
            mfs, max_running_requests=mrr, context_len=ref.context_len,
            cuda_graph_max_bs=int(graph_bs) if graph_bs else None,
        )
        extra = mrr - ref.slots
        if extra > 0:
            free -= extra * self._slot_cost_gib
        return tokens, free

    def _learn_slot_cost(self, points: Sequence[_Point]) -> None:
        """GiB per extra request slot beyond the req_to_token table, from pairs of measured configs
        of one family (the largest seen; 0 without such pairs).

        Each free figure comes from a log line printed with two decimals (``avail mem={X:.2f}
        GB``, ``shared/sglang-reference.md`` §4), so a pair's difference is known to
        :data:`_LOG_RESOLUTION_GIB` only: that much is not charged to the slots (else a pair one
        slot apart would turn rounding into a per-slot cost of 0.01 GiB).
        """
        cost = 0.0
        for a in points:
            for b in points:
                ma, mb = a.slots, b.slots
                if _family(a.params) != _family(b.params) or mb <= ma:
                    continue
                fa = a.model.observed_free_after_graphs_gib
                fb = b.model.observed_free_after_graphs_gib
                if fa is None or fb is None:
                    continue
                self._slot_cost_gib = 0.0
                _, predicted = self._predict(a, b.params["mem_fraction_static"], mb, _family(b.params))
                cost = max(cost, (predicted - fb - _LOG_RESOLUTION_GIB) / (mb - ma))
        self._slot_cost_gib = cost

    # -- proposals -----------------------------------------------------------------------------

    def _frontier(
        self,
        family: tuple[tuple[str, Any], ...],
        ref: _Point,
        mrr: int | None,
        need: float,
        ceiling: Callable[[int], float],
    ) -> tuple[float, int, int, float, int] | None:
        """The best predicted context capacity below ``ceiling`` whose headroom covers ``need``.

        ``ceiling(mrr)`` is the lowest fraction a memory failure proves too high at that request
        count. ``mrr=None`` sizes ``max_running_requests`` to each fraction's own capacity (just enough
        request slots: the req_to_token table and graphs shrink with it, §1.6, §2.1). Returns the
        *smallest* grid fraction that reaches the top capacity (capacity is an integer; more KV buys
        nothing for it and costs headroom), as ``(mfs, tokens, capacity, free GiB, mrr)``.
        """
        low, high = self.space.max_running_requests
        feasible = []
        for mfs in self.space.fractions():
            tokens, _ = self._predict(ref, mfs, high, family)
            slots = mrr if mrr is not None else min(high, max(low, tokens // self.context_tokens))
            if mfs >= ceiling(slots) - 1e-9:
                continue
            tokens, free = self._predict(ref, mfs, slots, family)
            if tokens <= 0 or free < need:
                continue
            feasible.append((mfs, tokens, min(slots, tokens // self.context_tokens), free, slots))
        if not feasible:
            return None
        top = max(item[2] for item in feasible)
        return next(item for item in feasible if item[2] == top)

    def next(
        self,
        history: Sequence[tuple[int, TrialRecord]],
        tried: set[tuple[tuple[str, Any], ...]],
        *,
        pending: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]] = (),
    ) -> Candidate | None:
        """The next config to launch, or ``None`` to hand over to the sampler.

        With trials running on other hosts (``pending``), the planner proposes what is most useful
        *given* them (the "believer" of batch Bayesian optimization): it believes each reaches
        its predicted context capacity, takes the best of them as the incumbent, and aims past it
        or at its band with knobs none of them has (another chunk size, more request slots on its
        knobs), rather than the sequential plan's next step on the same knobs, whose value
        depends on their outcome. Predictions stay calibrated on measured trials only. When
        nothing passes that, the plan on the measured trials alone.

        Args:
            history: ``(trial number, record)`` of every finished trial, baseline included.
            tried: Keys (``sorted(params.items())``) of configs already run or queued.
            pending: ``(params, prediction)`` of the planner's trials running on other hosts.

        Returns:
            A candidate on the space's grid, with its prediction.
        """
        points = self._points(history)
        # Calibration: the survivors; with none, the starts that died under load (their startup
        # facts still hold; the need then comes from their OOMs, a lower bound).
        model_points = points or self._oom_points(history)
        if not model_points:
            return None
        bounds = self.slo_bounds(history)
        measured_feasible = [p for p in points if p.feasible]
        feasible = measured_feasible or model_points
        incumbent = max(feasible, key=lambda p: (p.capacity, -p.number))
        best_capacity = incumbent.capacity
        oom_frees: list[tuple[dict[str, Any], float]] = []
        ceilings: dict[tuple[tuple[str, Any], ...], list[tuple[float, int]]] = {}
        for _number, record in history:
            if record.failure_class in _CEILING_FAILURES and record.params:
                params = self.space.snap(record.params)
                if record.failure_class is FailureClass.RUNTIME_OOM and record.free_gib_after_graphs is not None:
                    oom_frees.append((params, record.free_gib_after_graphs))
                ceilings.setdefault(_family(params), []).append(
                    (params["mem_fraction_static"], params["max_running_requests"])
                )

        def ceiling_of(family: tuple[tuple[str, Any], ...], mrr: int) -> float:
            # Monotone: a memory failure at (mfs, mrr) proves every mfs' >= mfs with mrr' >= mrr fails.
            return min((m for m, r in ceilings.get(family, []) if mrr >= r), default=2.0)

        slo_step = self._slo_step(points, measured_feasible, bounds, tried, oom_frees, ceiling_of)
        if slo_step is not None:
            return slo_step

        believers = sorted(self._believed(pending, model_points), key=lambda p: (-p.capacity, p.number))
        believed = max((p.capacity for p in believers), default=0)
        if any(prediction.get("free_gib_after_graphs") is not None for _, prediction in pending):
            # Believed, a running trial's prediction is checked by its start with no error: the
            # margin is the one the model would have once it reports (not the unchecked prior).
            self._margin_gib = self.margin_now_gib(history, believed_check=True)
        if believed > best_capacity:
            found = self._proposals(points, model_points, believers[0], believed, bounds, tried, oom_frees, ceiling_of)
            if found is not None:
                return self._given(found, believed)
        found = self._proposals(points, model_points, incumbent, best_capacity, bounds, tried, oom_frees, ceiling_of)
        if found is not None or not believers:
            return found
        # The plan on the measured trials is spent (every step of it is measured or running): the
        # step it takes next when a running trial comes back as predicted and becomes the
        # incumbent (its knobs with more request slots, its neighbours in the band), each running
        # trial in the band in turn, best first, before the sampler.
        top = max(best_capacity, believed)
        for ahead in believers:
            if ahead.capacity < top * (1.0 - self.capacity_tolerance):
                break
            found = self._proposals(points, model_points, ahead, top, bounds, tried, oom_frees, ceiling_of)
            if found is not None:
                return self._given(found, believed)
        return None

    @staticmethod
    def _given(found: Candidate, believed: int) -> Candidate:
        """``found`` with the pending trials it was proposed against in its prediction."""
        return found.model_copy(update={"prediction": {
            **found.prediction, "believed_pending_capacity": believed,
            "why": f"{found.prediction['why']}, given trials running on other hosts predicted to reach "
                   f"{believed} contexts"}})

    def _believed(self, pending: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
                  points: Sequence[_Point]) -> list[_Point]:
        """Running planner trials as if measured at their prediction (the model they were
        predicted with, their predicted context capacity, feasible); numbered after every trial."""
        out = []
        for i, (params, prediction) in enumerate(pending):
            capacity = int(prediction.get("context_capacity") or 0)
            if capacity <= 0 or "mem_fraction_static" not in params:
                continue
            snapped = self.space.snap(dict(params))
            ref = next((p for p in points if p.number == prediction.get("calibrated_on_trial")), None)
            ref = ref or self._reference(_family(snapped), int(snapped["max_running_requests"]), points)
            out.append(ref.model_copy(update={"number": 10**9 + i, "params": snapped, "capacity": capacity,
                                              "feasible": True}))
        return out

    def _proposals(
        self,
        points: Sequence[_Point],
        model_points: Sequence[_Point],
        incumbent: _Point,
        best_capacity: int,
        bounds: Mapping[tuple[tuple[str, Any], ...], SLOBound],
        tried: set[tuple[tuple[str, Any], ...]],
        oom_frees: Sequence[tuple[dict[str, Any], float]],
        ceiling_of: Callable[[tuple[tuple[str, Any], ...], int], float],
    ) -> Candidate | None:
        """The memory plan's best proposal against ``best_capacity`` (measured, or believed):
        ``points`` are the survivors (the activation need), ``model_points`` what calibrates the
        memory model (the survivors, or with none the starts that died under load)."""
        proposals: list[tuple[tuple[int, int, int, int], Candidate]] = []
        base_family = _family(incumbent.params)
        families = [base_family, *self._neighbours(incumbent.params)]
        for rank, family in enumerate(families):
            ref = self._reference(family, int(incumbent.params["max_running_requests"]), model_points)
            need = self._need_gib(family, points, oom_frees)
            base_mrr = int(incumbent.params["max_running_requests"])
            found_options = []
            # Tight: just enough request slots for the capacity; or the incumbent's own count; or
            # more slots than the capacity (shorter requests run alongside: throughput), same band.
            # "More" is bounded by what the measured window can run at once (the pool over the mean
            # request, [budget] max_concurrency): the reachable count, and halfway to it (log scale).
            more: list[int] = []
            if rank == 0:
                top = incumbent.model.tokens(incumbent.params["mem_fraction_static"], page_size=incumbent.page_size)
                reach = min(self.slots_cap(top), self.space.max_running_requests[1])
                if self.budget is not None and reach > base_mrr:
                    # The reachable count first: throughput grows with the requests run at once
                    # until memory or the SLO binds, which the checks below and the SLO rule see.
                    more = sorted({reach, int(round(math.sqrt(reach * base_mrr)))} - {base_mrr}, reverse=True)
                elif self.budget is None:
                    more = [m for m in (2 * base_mrr, 4 * base_mrr) if m <= self.space.max_running_requests[1]]
            for mrr in (None, base_mrr, *more):
                found = self._frontier(family, ref, mrr, need, partial(ceiling_of, family))
                if found is not None:
                    found_options.append(found)
            bound = self._bound_for(family, bounds, self._binding_family(bounds))
            for mfs, tokens, capacity, free, mrr in found_options:
                params = self.space.snap({**dict(family), "mem_fraction_static": mfs, "max_running_requests": mrr})
                if config_key(params) in tried:
                    continue
                if mrr > self.slots_cap(tokens):
                    continue  # more slots than the measured window can ever run at once
                if bound is not None and bound.violates(self.running_requests(mrr, tokens)):
                    continue  # at least the load of a window that broke the SLO
                if rank == 0 and capacity <= best_capacity and mrr not in more:
                    continue
                if rank > 0 and capacity < best_capacity * (1.0 - self.capacity_tolerance):
                    continue
                if capacity > best_capacity:
                    why = "raise capacity at the predicted memory frontier"
                elif rank == 0:
                    if capacity < best_capacity * (1.0 - self.capacity_tolerance):
                        continue
                    why = "same capacity band with more request slots (shorter requests alongside)"
                else:
                    why = "same capacity band with another " + self._changed(base_family, family)
                proposals.append(
                    (
                        # A higher predicted capacity first (the highest, whichever knobs reach
                        # it), then the incumbent's own knobs before a neighbour's.
                        (0 if capacity > best_capacity else 1, -capacity if capacity > best_capacity else 0,
                         rank, -capacity),
                        Candidate(
                            params=params,
                            prediction={
                                "token_capacity": tokens,
                                "context_capacity": capacity,
                                "free_gib_after_graphs": round(free, 3),
                                "need_gib": round(need, 3),
                                "calibrated_on_trial": ref.number,
                                "why": why,
                            },
                        ),
                    )
                )
        if not proposals:
            return None
        proposals.sort(key=lambda item: item[0])
        return proposals[0][1]

    # -- the latency SLO and the reachable load ---------------------------------------------------

    def slo_bounds(self, history: Sequence[tuple[int, TrialRecord]]) -> dict[tuple[tuple[str, Any], ...], SLOBound]:
        """Per family (on the space's grid), where the SLO breaks (:mod:`tuner.study.slo_bound`)."""
        low_mfs, low_mrr = self.space.mem_fraction_static[0], self.space.max_running_requests[0]

        def normalise(family: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
            return _family(self.space.snap({**dict(family), "mem_fraction_static": low_mfs,
                                            "max_running_requests": low_mrr}))

        return slo_bounds(slo_points(history), normalise=normalise)

    @staticmethod
    def _binding_family(bounds: Mapping[tuple[tuple[str, Any], ...], SLOBound]) -> tuple[tuple[str, Any], ...]:
        """The family whose windows say most about where the SLO breaks (``()`` when none broke it)."""
        binding = [f for f, b in bounds.items() if b.binds]
        return max(binding, key=lambda f: (len(bounds[f].points), -(bounds[f].broken or 0)), default=())

    @staticmethod
    def _bound_for(
        family: tuple[tuple[str, Any], ...], bounds: Mapping[tuple[tuple[str, Any], ...], SLOBound],
        fallback: tuple[tuple[str, Any], ...],
    ) -> SLOBound | None:
        """The family's own SLO bound when a window of it broke the SLO; else ``fallback``'s when
        one of that broke it (an estimate for choosing a proposal, never a proof); else the
        family's own (not binding) or ``None``."""
        own = bounds.get(family)
        if own is not None and own.binds:
            return own
        other = bounds.get(fallback)
        if other is not None and other.binds:
            return other
        return own

    def slots_cap(self, tokens: int) -> int:
        """The most request slots that can change a result for a pool of ``tokens``
        (:func:`tuner.study.budget.reachable_slots`; the space's top without a ``[budget]``)."""
        if self.budget is None:
            return self.space.max_running_requests[1]
        return reachable_slots(self.budget, max_total_num_tokens=tokens, context_tokens=self.context_tokens,
                               mean_request_tokens=self.mean_request_tokens)

    def running_requests(self, mrr: int, tokens: int) -> int:
        """Requests a config runs at once in the measured window: its slots, as far as the closed
        loop's streams (:func:`tuner.study.budget.load_concurrency`) fill them."""
        if self.budget is None:
            return mrr
        capacity = min(mrr, tokens // max(1, self.context_tokens))
        streams = load_concurrency(self.budget, capacity=capacity, max_running_requests=mrr,
                                   max_total_num_tokens=tokens, mean_request_tokens=self.mean_request_tokens)
        return min(mrr, streams)

    def _slo_step(
        self,
        points: Sequence[_Point],
        feasible: Sequence[_Point],
        bounds: Mapping[tuple[tuple[str, Any], ...], SLOBound],
        tried: set[tuple[tuple[str, Any], ...]],
        oom_frees: Sequence[tuple[dict[str, Any], float]],
        ceiling_of: Callable[[tuple[tuple[str, Any], ...], int], float],
    ) -> Candidate | None:
        """The next launch while the latency SLO binds: get feasible, then push inside it.

        With no feasible trial, the family whose windows say most about the SLO is bisected
        between its largest safe and its smallest broken running-request count (from the measured
        latencies, :meth:`tuner.study.slo_bound.SLOBound.next_count`); with a feasible incumbent,
        its family's bracket is narrowed the same way (capacity = slots inside the SLO), then each
        other family (chunked prefill size, ...) is measured at the incumbent's safe load and, if
        it holds there, at its family's break. ``None``: the SLO does not bind, or every bracket
        is closed (the memory planner goes on, with the SLO rule filtering its proposals).
        """
        binding = {f: b for f, b in bounds.items() if b.binds}
        if not binding:
            return None
        if feasible:
            incumbent = max(feasible, key=lambda p: (p.capacity, -p.number))
            family = _family(incumbent.params)
        else:
            family = max(binding, key=lambda f: (len(binding[f].points), -(binding[f].broken or 0)))
        own_base = bounds.get(family)
        base = own_base if own_base is not None and own_base.binds else binding[self._binding_family(bounds)]
        families = [family, *(f for f in self._neighbours(dict(family)) if f != family)]
        for rank, fam in enumerate(families):
            own = bounds.get(fam)
            count: int | None
            if own is not None and own.points:
                count = own.next_count()
                if count is None and not own.binds and base.broken is not None:
                    # It held so far: try where the base family broke, then step up by a quarter
                    # (never a jump to the memory frontier: the SLO binds on these loads).
                    count = int(base.broken) if base.broken > own.safe else max(int(own.safe) + 1,
                                                                              math.ceil(own.safe * 1.25))
                why = ("bisect running requests between the largest SLO-safe and the smallest SLO-breaking "
                       "window of these knobs" if rank == 0 else
                       f"another {self._changed(family, fam)} within the SLO bracket")
            else:
                count = int(base.safe) if base.safe else base.next_count()
                why = f"another {self._changed(family, fam)} at the SLO-safe load of trial {base.safe_trial}"
            if count is None or count < 1:
                continue
            candidate = self._at_count(fam, count, points, tried, oom_frees, ceiling_of, why, own or base)
            if candidate is not None:
                return candidate
        return None

    def _at_count(
        self,
        family: tuple[tuple[str, Any], ...],
        count: int,
        points: Sequence[_Point],
        tried: set[tuple[tuple[str, Any], ...]],
        oom_frees: Sequence[tuple[dict[str, Any], float]],
        ceiling_of: Callable[[tuple[tuple[str, Any], ...], int], float],
        why: str,
        bound: SLOBound,
    ) -> Candidate | None:
        """``family`` with ``count`` request slots at the smallest fraction whose pool holds them
        (the memory frontier at that count), or ``None`` (already tried, or memory forbids it)."""
        ref = self._reference(family, count, points)
        need = self._need_gib(family, points, oom_frees)
        found = self._frontier(family, ref, count, need, lambda slots: ceiling_of(family, slots))
        if found is None:
            return None
        mfs, tokens, capacity, free, mrr = found
        params = self.space.snap({**dict(family), "mem_fraction_static": mfs, "max_running_requests": mrr})
        if config_key(params) in tried:
            return None
        return Candidate(params=params, prediction={
            "token_capacity": tokens, "context_capacity": capacity, "free_gib_after_graphs": round(free, 3),
            "need_gib": round(need, 3), "calibrated_on_trial": ref.number,
            "running_requests": self.running_requests(mrr, tokens),
            "slo_safe_running_requests": bound.safe, "slo_safe_trial": bound.safe_trial,
            "slo_broken_running_requests": bound.broken, "slo_broken_trial": bound.broken_trial,
            "why": why,
        })

    def screen(
        self, params: Mapping[str, Any], history: Sequence[tuple[int, TrialRecord]], *, capacity_floor: int = 0
    ) -> tuple[str, int] | None:
        """Why a sampled config is not worth a restart, by the calibrated models.

        Predictions (not proofs, and the reasons say "predicted"): its context capacity is below
        ``capacity_floor`` (the best feasible trial's capacity band: it cannot win on the policy);
        it has more request slots than can change its result (:meth:`slots_cap`); its headroom
        after graphs is below the measured activation peak scaled to its prefill chunk, times
        :attr:`peak_safety`, plus the margin (the planner's own need, :meth:`_need_gib`), or below
        what a runtime OOM under the stress load already showed too small, scaled by the ratio of
        prefill chunks (activations grow with the chunk, §1.6). One proof
        (the SLO's monotone rule, :mod:`tuner.study.slo_bound`): it runs at least as many requests
        at once as a window of the same other knobs that broke the SLO.

        Returns:
            ``(reason, proving or calibration trial)``, or ``None`` to launch it.
        """
        points = self._points(history)
        model_points = points or self._oom_points(history)
        if not model_points:
            return None
        snapped = self.space.snap(params)
        family = _family(snapped)
        mfs, mrr = snapped["mem_fraction_static"], snapped["max_running_requests"]
        ref = self._reference(family, mrr, model_points)
        tokens, free = self._predict(ref, mfs, mrr, family)
        capacity = min(mrr, tokens // self.context_tokens) if tokens > 0 else 0
        if capacity_floor and capacity < capacity_floor:
            return (
                f"predicted context capacity {capacity} (model calibrated on trial {ref.number}) is below "
                f"{capacity_floor}, the capacity band of the best feasible trial, so it cannot win on the "
                "policy; not launched",
                ref.number,
            )
        if tokens > 0 and mrr > self.slots_cap(tokens):
            return (
                f"max_running_requests={mrr} is more than the {self.slots_cap(tokens)} requests this config can "
                f"change the result with (predicted pool {tokens} tokens, model calibrated on trial {ref.number}: "
                "its context capacity, or what the measured window can run at once by [budget] max_concurrency "
                "and the pool over the mean request length); predicted, not launched",
                ref.number,
            )
        slo = self.slo_bounds(history).get(family)
        running = self.running_requests(mrr, tokens) if tokens > 0 else mrr
        if slo is not None and slo.violates(running):
            return (
                f"must break the SLO: trial {slo.broken_trial} broke it running {slo.broken:g} requests at once "
                f"with the same other knobs, and this config runs {running} (closed-loop latency grows with the "
                "requests in flight at equal knobs); not launched",
                int(slo.broken_trial if slo.broken_trial is not None else ref.number),
            )
        measured = [int(p.params["max_running_requests"]) for p in points if _family(p.params) == family]
        if measured and mrr > 2 * max(measured):
            return (
                f"max_running_requests={mrr} is more than twice any measured config of these knobs "
                f"({max(measured)}); its CUDA graphs and request table are not calibrated; not launched",
                ref.number,
            )
        prefill = self._effective_prefill(dict(family).get("chunked_prefill_size", 1))
        peaks = [(p.peak_gib * prefill / self._effective_prefill(p.params.get("chunked_prefill_size", 1)), p.number)
                 for p in points if p.peak_gib]
        if peaks:
            oom_frees = [(self.space.snap(r.params), r.free_gib_after_graphs) for _, r in history
                         if r.failure_class is FailureClass.RUNTIME_OOM and r.params and r.free_gib_after_graphs is not None]
            need = self._need_gib(family, points, oom_frees)
            if free < need:
                peak, number = max(peaks)
                return (
                    f"predicted {free:.2f} GiB free after graphs (model calibrated on trial {ref.number}), below the "
                    f"{need:.2f} GiB the stress load needs: trial {number}'s measured activation peak scaled to this "
                    f"prefill chunk ({peak:.2f} GiB; activations scale with it) × {self.peak_safety:g} + the "
                    f"{self._margin_gib:.2f} GiB the model's checked predictions leave as margin; predicted, not launched",
                    number,
                )
        survivors = [
            (p.model.observed_free_after_graphs_gib * prefill / self._effective_prefill(p.params.get("chunked_prefill_size", 1)), p.number)
            for p in points if p.model.observed_free_after_graphs_gib is not None
        ]
        if survivors and not any(p.peak_gib for p in points):
            least, number = min(survivors)
            if free < least:
                return (
                    f"predicted {free:.2f} GiB free after graphs, less than any config has survived the stress "
                    f"load with ({least:.2f} GiB, trial {number}, scaled to this prefill chunk); the planner "
                    "explores that frontier; not launched",
                    number,
                )
        for number, record in history:
            if record.failure_class is FailureClass.RUNTIME_OOM and record.free_gib_after_graphs is not None:
                ratio = prefill / self._effective_prefill(record.params.get("chunked_prefill_size", 1))
                bound = record.free_gib_after_graphs * ratio
                if free <= bound:
                    return (
                        f"predicted {free:.2f} GiB free after graphs, below the {bound:.2f} GiB that trial {number}'s "
                        "runtime OOM under load implies for this prefill chunk (activations scale with it); "
                        "not launched",
                        number,
                    )
        return None

    @staticmethod
    def _changed(base: tuple[tuple[str, Any], ...], other: tuple[tuple[str, Any], ...]) -> str:
        a, b = dict(base), dict(other)
        names = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        return ", ".join(names) or "max_running_requests"

    def _neighbours(self, params: Mapping[str, Any]) -> list[tuple[tuple[str, Any], ...]]:
        """Knob sets one step from ``params`` (memory knobs excluded), in a stable order."""
        base = {k: v for k, v in params.items() if k not in ("mem_fraction_static", "max_running_requests")}
        out: list[dict[str, Any]] = []
        for cps in self.space.chunked_prefill_size:
            if cps != base.get("chunked_prefill_size"):
                out.append({**base, "chunked_prefill_size": cps})
        if self.space.hierarchical_cache:
            if base.get("enable_hierarchical_cache"):
                out.append({k: v for k, v in base.items() if not k.startswith("hicache_")} | {"enable_hierarchical_cache": False})
            else:
                out.append({**base, **self.space.hicache_on()})
        for name in ("page_size", "cuda_graph_max_bs"):
            for value in getattr(self.space, name) or ():
                if value != base.get(name):
                    out.append({**base, name: value})
        if self.space.schedule_conservativeness:
            lo, hi = self.space.schedule_conservativeness
            current = float(base.get("schedule_conservativeness", 1.0))
            for value in (current - 0.3, current + 0.3):
                if lo <= value <= hi:
                    out.append({**base, "schedule_conservativeness": round(value, 6)})
        families = []
        for item in out:
            snapped = self.space.snap({**item, "mem_fraction_static": self.space.mem_fraction_static[0],
                                       "max_running_requests": self.space.max_running_requests[0]})
            families.append(_family(snapped))
        return list(dict.fromkeys(families))
