"""The memory and SLO models calibrated on a study's finished trials: one value per decision.

The planner learns from memory facts rather than by trial and error
(``shared/sglang-reference.md`` §1.2, §1.6, §8): the memory model
(:class:`tuner.sglang.memory.KVCapacityModel`) of each measured start predicts, for a knob set,
the token capacity of every ``mem_fraction_static`` and the GPU memory left free after CUDA graphs;
the activation peak measured under the stress load says how much of that headroom serving needs,
with a margin that is the largest over-prediction of free memory the study has measured (a prior
before any prediction was checked); a memory failure bounds the fraction from above for that knob
set (monotone, :func:`tuner.sglang.memory.must_fail`); and the measured windows say where the
latency SLO breaks (:mod:`tuner.study.slo_bound`).

:class:`Calibration` is all of that, computed once from a view's finished trials
(:attr:`tuner.study.view.StudyView.calibration`): frozen, so every proposer and screen of one
decision sees the same model, and nothing of it outlives the trials it came from. The proposers
(:mod:`tuner.study.decide`) and the predicted screen ask it questions: predict a config, the
headroom a knob set needs, the memory frontier at a request count, the slots that can matter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from tuner.config import BudgetSection, ObjectiveSection, TunerConfig
from tuner.load.workloads import build_workload
from tuner.records import TrialRecord
from tuner.sglang.failures import RESERVE_FAILURES, FailureClass
from tuner.sglang.graphs import GraphCoverage, GraphFacts
from tuner.sglang.memory import KVCapacityModel
from tuner.study.budget import load_concurrency, reachable_slots
from tuner.study.slo_bound import SLOBound, SLOPoint, family_of, slo_bounds, slo_points
from tuner.study.space import Space

__all__ = ["Family", "ModelSettings", "Point", "Calibration", "margin_for", "changed_knobs", "neighbours",
           "deployment_capacity"]

Family = tuple[tuple[str, Any], ...]
"""A knob set without ``mem_fraction_static`` and ``max_running_requests`` (:func:`family_of`)."""

_LOG_RESOLUTION_GIB = 0.01
"""What two free-memory figures read from SGLang's log can differ by from rounding alone (each is
printed as ``{X:.2f}`` GB, ``shared/sglang-reference.md`` §4)."""


@dataclass(frozen=True)
class ModelSettings:
    """What the memory and SLO models need beside the trials (fixed for a study).

    Attributes:
        context_tokens: The context length of context capacity (tokens).
        objective: ``[objective]`` (the policy, its capacity band and throughput noise).
        budget: ``[budget]`` (``max_concurrency``: the measured window's streams), or ``None``
            (then the slots a config can use are the space's top).
        mean_request_tokens: The workload's mean ``input + output`` (tokens); ``None``: the context.
        longest_input_tokens: The workload's longest prompt (tokens; the activation peak with
            chunking off); ``None``: the context.
        peak_safety: Factor on the measured activation peak.
        margin_gib: Extra GiB kept free above the scaled peak while no prediction of the memory
            model has been checked against a start (the first extrapolation from the baseline).
        min_margin_gib: The least extra GiB once predictions have been checked.
        sglang_version: The SGLang version (its CUDA-graph capture rules), or ``None`` (0.5.5's).
        prior_checks_gib: Checks of the memory model made by an earlier study of the same
            deployment (predicted − measured free memory after graphs, GiB; the warm start,
            :mod:`tuner.study.warm`): they count as this study's own in :func:`margin_for`.
        prior_points: Starts of an earlier study of the same deployment as reference points of the
            memory model only (their pool, graphs and reserve at their knobs hold here; their
            capacity, peak and feasibility are another workload's, so they are no incumbent and
            size no headroom need); numbered ``-1 - n`` for the earlier study's trial ``n``.
    """

    context_tokens: int
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    budget: BudgetSection | None = None
    mean_request_tokens: int | None = None
    longest_input_tokens: int | None = None
    peak_safety: float = 1.15
    margin_gib: float = 0.25
    min_margin_gib: float = 0.05
    sglang_version: str | None = None
    prior_checks_gib: tuple[float, ...] = ()
    prior_points: tuple[Point, ...] = ()

    @classmethod
    def for_config(cls, config: TunerConfig, context_tokens: int, sglang_version: str | None = None) -> ModelSettings:
        """The settings of ``config``'s study (its ``[objective]``, ``[budget]`` and workload; the
        SGLang version: its CUDA-graph capture rules, :mod:`tuner.sglang.graphs`)."""
        workload = build_workload(config.workload, seed=config.study.seed)
        spec = config.workload
        return cls(context_tokens=context_tokens, objective=config.objective, budget=config.budget,
                   mean_request_tokens=workload.mean_request_tokens,
                   longest_input_tokens=int(spec.input_len) if hasattr(spec, "input_len") else None,
                   sglang_version=sglang_version or config.service.sglang_version)

    @property
    def capacity_tolerance(self) -> float:
        """The policy's capacity band (configs within it may win on throughput)."""
        return self.objective.capacity_tolerance


class Point(BaseModel):
    """One measured trial as the models see it: its knobs, its calibrated memory model, its peak.

    Attributes:
        number: The trial (``10**9 + i`` for a running trial believed at its prediction).
        params: Its knobs on the space's grid.
        slots: The ``max_running_requests`` the server ran with.
        model: Its calibrated memory model.
        context_len: SGLang's ``context_len`` (tokens).
        page_size: SGLang's page size (tokens).
        peak_gib: The activation peak measured under load (GiB), or ``None``.
        feasible: Whether the trial is feasible.
        capacity: Its context capacity (requests).
    """

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


@dataclass(frozen=True)
class Calibration:
    """The memory and SLO models calibrated on a study's finished trials (build with :meth:`of`).

    Attributes:
        space: The resolved space.
        settings: The models' settings.
        points: The survivors that calibrate the memory model (measured ``ok``, feasible memory:
            no OOM and no failed stress), oldest first.
        model_points: :attr:`points`, or with none the starts that died of a runtime OOM under
            load (their startup facts still hold; their OOM bounds the need from below only).
        slot_cost_gib: GiB per request slot beyond the memory model's view, learned from pairs.
        margin_gib: GiB kept free above the scaled activation peak (:meth:`margin_for`).
        oom_frees: ``(params, free GiB after graphs)`` of the runtime OOMs under load.
        ceilings: Per family, ``(mem_fraction_static, max_running_requests)`` of the reserve
            failures (each proves every larger fraction with at least as many slots fails).
        bounds: Per family, where the latency SLO breaks.
        graphs: The unit's CUDA-graph facts (:class:`tuner.sglang.graphs.GraphFacts`), or ``None``.
        coverages: Per launched trial, the decode batches that replayed a CUDA graph: the log's
            captured list where it printed one, else predicted.
    """

    space: Space
    settings: ModelSettings
    points: tuple[Point, ...]
    model_points: tuple[Point, ...]
    slot_cost_gib: float
    margin_gib: float
    oom_frees: tuple[tuple[dict[str, Any], float], ...]
    ceilings: Mapping[Family, tuple[tuple[float, int], ...]]
    bounds: Mapping[Family, SLOBound]
    graphs: GraphFacts | None = None
    coverages: Mapping[int, GraphCoverage] = field(default_factory=dict)

    @classmethod
    def of(cls, history: Sequence[tuple[int, TrialRecord]], space: Space, settings: ModelSettings) -> Calibration:
        """Calibrate on ``history`` (``(trial number, record)`` of the finished trials, baseline
        included, oldest first)."""
        points = tuple(_survivors(history, space))
        oom_frees: list[tuple[dict[str, Any], float]] = []
        ceilings: dict[Family, list[tuple[float, int]]] = {}
        for _number, record in history:
            if record.failure_class in RESERVE_FAILURES and record.params:
                params = space.snap(record.params)
                if record.failure_class is FailureClass.RUNTIME_OOM and record.free_gib_after_graphs is not None:
                    oom_frees.append((params, record.free_gib_after_graphs))
                ceilings.setdefault(family_of(params), []).append(
                    (params["mem_fraction_static"], params["max_running_requests"]))
        low_mfs, low_mrr = space.mem_fraction_static[0], space.max_running_requests[0]

        def normalise(family: Family) -> Family:
            return family_of(space.snap({**dict(family), "mem_fraction_static": low_mfs,
                                         "max_running_requests": low_mrr}))

        graphs, coverages = _graph_facts(history, space, settings)
        return cls(
            space=space, settings=settings, points=points, graphs=graphs, coverages=coverages,
            model_points=(points or tuple(_oom_starts(history, space))) + settings.prior_points,
            slot_cost_gib=_slot_cost(points, settings),
            margin_gib=margin_for(history, settings),
            oom_frees=tuple(oom_frees),
            ceilings={f: tuple(v) for f, v in ceilings.items()},
            bounds=slo_bounds(slo_points(history), normalise=normalise),
        )

    def with_margin(self, margin_gib: float) -> Calibration:
        """This calibration with another margin (the believer's, :mod:`tuner.study.decide.memory`)."""
        return dataclasses.replace(self, margin_gib=margin_gib)

    # -- the memory model ------------------------------------------------------------------------

    def reference(self, family: Family, mrr: int, points: Sequence[Point] | None = None) -> Point:
        """The calibration point for ``family`` at ``mrr`` among ``points`` (default
        :attr:`model_points`): same knobs, the nearest ``max_running_requests`` (graphs and the
        req_to_token table depend on it, §1.6, §2.1), then the highest fraction; another
        family's when the family has none.

        Raises:
            ValueError: ``points`` is empty.
        """
        pool = self.model_points if points is None else points
        same = [p for p in pool if family_of(p.params) == family] or list(pool)
        return min(same, key=lambda p: (abs(math.log(max(1, mrr) / max(1, p.slots))), -p.params["mem_fraction_static"]))

    def predict(self, ref: Point, mfs: float, mrr: int, family: Family) -> tuple[int, float]:
        """Predicted ``(max_total_num_tokens, free GiB after graphs)`` (§1.2, §1.6, §8).

        More request slots than the calibration point also cost what the memory model cannot
        see (CUDA graphs are captured up to the request count, §2.1): the per-slot cost learned
        from measured pairs (:attr:`slot_cost_gib`) is charged for them.
        """
        return _predict(ref, mfs, mrr, family, self.slot_cost_gib)

    def effective_prefill(self, cps: Any) -> float:
        """Tokens of one prefill chunk for ``chunked_prefill_size`` ``cps`` (-1: the longest
        prompt, at most 16k)."""
        return _effective_prefill(cps, self.settings)

    def need_gib(self, family: Family) -> float:
        """GiB that must stay free after graphs for configs of ``family`` to survive the stress load.

        Activations grow with the prefill chunk (§1.6), so every observation is scaled by the
        ratio of chunk sizes. With a measured activation peak (GPU monitor), the need is the
        largest scaled peak times ``peak_safety`` plus :attr:`margin_gib`. Without one, the need is
        bracketed: a config that survived the stress load with ``f`` GiB free bounds it from above,
        a runtime OOM with ``f`` GiB free bounds it from below; the planner aims halfway (half the
        smallest surviving headroom before any OOM), so it approaches the boundary geometrically
        and crosses it at most about once.
        """
        prefill = self.effective_prefill(dict(family).get("chunked_prefill_size", 1))

        def scale(params: Mapping[str, Any]) -> float:
            return prefill / self.effective_prefill(params.get("chunked_prefill_size", 1))

        # A survivor with an equal or larger chunk bounds the need from above (halving it is the
        # geometric step); one with a smaller chunk only estimates it (no halving).
        estimates = []
        for p in self.points:
            free = p.model.observed_free_after_graphs_gib
            if free is None:
                continue
            ratio = scale(p.params)
            estimates.append(free * ratio * (0.5 if ratio <= 1.0 else 1.0))
        halved_upper = min(estimates, default=None)
        upper = min((p.model.observed_free_after_graphs_gib * scale(p.params) for p in self.points
                     if p.model.observed_free_after_graphs_gib is not None), default=None)
        lower = max((free * scale(params) for params, free in self.oom_frees), default=None)
        peaks = [p.peak_gib * scale(p.params) for p in self.points if p.peak_gib]
        if peaks:
            need = max(peaks) * self.settings.peak_safety + self.margin_gib
        elif lower is None:
            need = halved_upper if halved_upper is not None else 2.0
        elif upper is not None and upper > lower:
            need = (lower + upper) / 2
        else:
            need = lower + self.settings.margin_gib
        if lower is not None:
            need = max(need, lower + 0.05)
        return max(need, 0.05)

    def ceiling(self, family: Family, mrr: int) -> float:
        """The lowest fraction a memory failure proves too high for ``family`` at ``mrr`` slots
        (monotone: a failure at ``(mfs, mrr)`` proves every ``mfs' ≥ mfs`` with ``mrr' ≥ mrr``
        fails); 2.0 when none does."""
        return min((m for m, r in self.ceilings.get(family, ()) if mrr >= r), default=2.0)

    def frontier(self, family: Family, ref: Point, mrr: int | None, need: float) -> tuple[float, int, int, float, int] | None:
        """The best predicted context capacity below the family's :meth:`ceiling` whose headroom
        covers ``need`` GiB.

        ``mrr=None`` sizes ``max_running_requests`` to each fraction's own capacity (just enough
        request slots: the req_to_token table and graphs shrink with it, §1.6, §2.1). Returns the
        *smallest* grid fraction that reaches the top capacity (capacity is an integer; more KV
        buys nothing for it and costs headroom), as ``(mfs, tokens, capacity, free GiB, mrr)``.
        """
        low, high = self.space.max_running_requests
        context = self.settings.context_tokens
        feasible = []
        for mfs in self.space.fractions():
            tokens, _ = self.predict(ref, mfs, high, family)
            slots = mrr if mrr is not None else min(high, max(low, deployment_capacity(family, high, tokens, context)))
            if mfs >= self.ceiling(family, slots) - 1e-9:
                continue
            tokens, free = self.predict(ref, mfs, slots, family)
            if tokens <= 0 or free < need:
                continue
            feasible.append((mfs, tokens, deployment_capacity(family, slots, tokens, context), free, slots))
        if not feasible:
            return None
        top = max(item[2] for item in feasible)
        return next(item for item in feasible if item[2] == top)

    # -- the reachable load and the latency SLO ---------------------------------------------------

    def slots_cap(self, tokens: int) -> int:
        """The most request slots that can change a result for a pool of ``tokens``
        (:func:`tuner.study.budget.reachable_slots`; the space's top without a ``[budget]``)."""
        budget = self.settings.budget
        if budget is None:
            return self.space.max_running_requests[1]
        return reachable_slots(budget, max_total_num_tokens=tokens, context_tokens=self.settings.context_tokens,
                               mean_request_tokens=self._mean_request_tokens)

    def running_requests(self, mrr: int, tokens: int) -> int:
        """Requests a config runs at once in the measured window: its slots, as far as the closed
        loop's streams (:func:`tuner.study.budget.load_concurrency`) fill them."""
        budget = self.settings.budget
        if budget is None:
            return mrr
        capacity = min(mrr, tokens // max(1, self.settings.context_tokens))
        streams = load_concurrency(budget, capacity=capacity, max_running_requests=mrr,
                                   max_total_num_tokens=tokens, mean_request_tokens=self._mean_request_tokens)
        return min(mrr, streams)

    def binding_family(self) -> Family:
        """The family whose windows say most about where the SLO breaks (``()`` when none broke it)."""
        binding = [f for f, b in self.bounds.items() if b.binds]
        return max(binding, key=lambda f: (len(self.bounds[f].points), -(self.bounds[f].broken or 0)), default=())

    def bound_for(self, family: Family) -> SLOBound | None:
        """The family's own SLO bound when a window of it broke the SLO; else the
        :meth:`binding_family`'s (an estimate for choosing a proposal, never a proof); else the
        family's own (not binding) or ``None``."""
        own = self.bounds.get(family)
        if own is not None and own.binds:
            return own
        other = self.bounds.get(self.binding_family())
        if other is not None and other.binds:
            return other
        return own

    # -- CUDA-graph coverage (tuner.sglang.graphs, §2.1) ------------------------------------------

    def coverage(self, family: Family, mrr: int) -> GraphCoverage | None:
        """The predicted decode-graph coverage of ``family`` with ``mrr`` request slots (``None``:
        the unit's graphs are not known)."""
        if self.graphs is None:
            return None
        graph_bs = dict(family).get("cuda_graph_max_bs")
        return self.graphs.coverage(mrr, int(graph_bs) if graph_bs else None)

    def slo_proof(self, family: Family, mrr: int, running: float, tokens: int | None = None) -> tuple[int, float] | None:
        """``(trial, running requests)`` of a window that proves ``family`` at ``mrr`` slots
        (running ``running`` requests at once) breaks the SLO, or ``None``.

        With ``tokens`` (the config's predicted KV pool) it is a proof in the strict sense, as the
        screens need it: the config must *surely* run as many requests as the window did, not only
        by the estimate ``running``. A pool smaller than the window's can hold fewer of the
        workload's long requests at once than the slots (retractions, §4.4), so the config runs
        fewer and may hold the SLO; it is sure when its pool holds that many longest contexts, or is
        at least the window's own pool. Without ``tokens`` the estimate is enough (a planner's
        filter, not a skip).

        The monotone rule (:mod:`tuner.study.slo_bound`) holds within equal graph coverage only: a
        window that broke the SLO at ``r`` requests proves a config running at least ``r`` breaks
        it when every batch of ``1..r`` that replays a graph on the config also did on that
        window's server (:meth:`tuner.sglang.graphs.GraphCoverage.covers_as_well`); a config that
        decodes some of those batches with a graph where the window ran them eagerly may be
        faster, so it is launched, not skipped. Windows of the same knobs count, and those of knobs
        that differ in ``cuda_graph_max_bs`` only (coverage decides there).
        """
        mine = self.coverage(family, mrr)
        for fam, bound in self.bounds.items():
            if fam != family and _without_graphs(fam) != _without_graphs(family):
                continue
            for point in sorted(bound.points, key=lambda p: p.running_requests):
                if point.slo <= 0 or running < point.running_requests:
                    continue
                if tokens is not None and not self._surely_runs(tokens, point):
                    continue
                theirs = self.coverages.get(point.number)
                if mine is None or theirs is None:
                    if fam == family:
                        return point.number, point.running_requests
                    continue
                if theirs.covers_as_well(mine, int(point.running_requests)):
                    return point.number, point.running_requests
        return None

    def _surely_runs(self, tokens: int, point: SLOPoint) -> bool:
        """Whether a config with a ``tokens`` pool surely runs ``point``'s running requests at once
        (given the slots and streams): its pool holds that many of the longest contexts, or is at
        least the pool of ``point``'s window (same workload, at least as much room)."""
        by_longest = tokens // max(1, self.settings.context_tokens)
        return by_longest >= point.running_requests or (
            point.token_capacity is not None and tokens >= point.token_capacity)

    def land(self, family: Family, mrr: int) -> tuple[Family, str | None]:
        """Where a request-slot proposal lands on the graphs: ``(family, note)``.

        Every batch up to ``mrr`` replays a graph when ``mrr`` is at most the largest captured
        size (SGLang captures the request table's size itself below ``cuda_graph_max_bs``, §2.1):
        ``(family, None)``. Above it, where the space searches ``cuda_graph_max_bs``, the graphs
        move with the slots (the smallest choice that covers them, else the largest); otherwise the
        note says which batches decode eagerly.
        """
        cov = self.coverage(family, mrr)
        if cov is None or cov.eager_above(mrr) is None:
            return family, None
        choices = [int(c) for c in self.space.grid("cuda_graph_max_bs")]
        if choices:
            current = dict(family).get("cuda_graph_max_bs")
            best = min((c for c in choices if c >= mrr), default=max(choices))
            if best != current:
                moved = tuple(sorted({**dict(family), "cuda_graph_max_bs": best}.items()))
                return moved, (f"cuda_graph_max_bs {best} moves with max_running_requests {mrr} "
                               f"(captured up to {cov.largest} at {current or self._default_graph_bs()})")
        return family, (f"max_running_requests {mrr} is above the largest captured CUDA-graph batch {cov.largest}: "
                        f"batches of {cov.largest + 1}-{mrr} decode eagerly (slower steps)")

    def place(self, ref: Point, family: Family, mfs: float, mrr: int,
              need: float) -> tuple[dict[str, Any], float, str | None]:
        """``(params, predicted free GiB after graphs, note)`` of ``family`` at ``(mfs, mrr)``
        landed on the CUDA graphs (:meth:`land`: ``cuda_graph_max_bs`` moves with the slots where
        the space searches it, unless the moved graphs leave less than ``need`` GiB free)."""
        landed, note = self.land(family, mrr)
        _, free = self.predict(ref, mfs, mrr, landed)
        if landed != family and free < need:
            landed, note = family, None
            _, free = self.predict(ref, mfs, mrr, family)
        params = self.space.snap({**dict(landed), "mem_fraction_static": mfs, "max_running_requests": mrr})
        return params, free, note

    def land_count(self, family: Family, count: int, floor: float = 0.0) -> int:
        """``count`` request slots, or the largest captured size below it when ``count`` lies above
        the family's captured sizes and that size is above ``floor`` (an SLO bracket's safe count):
        a count past the largest graph pays eager decode steps for its extra batches."""
        cov = self.coverage(family, count)
        if cov is None or cov.eager_above(count) is None or self.space.grid("cuda_graph_max_bs"):
            return count
        landed = cov.snap_down(count)
        return landed if landed > floor else count

    def _default_graph_bs(self) -> int | None:
        return self.graphs.default_max_bs if self.graphs else None

    @property
    def _mean_request_tokens(self) -> int:
        return self.settings.mean_request_tokens or self.settings.context_tokens


def deployment_capacity(family: Mapping[str, Any] | Family, mrr: int, tokens: int, context_tokens: int) -> int:
    """Context capacity across the deployment for a per-rank pool of ``tokens`` (issue 23): DCP
    interleaves one request over ``dcp_size`` ranks (the logical pool is ``dcp ×`` one rank's),
    DP attention runs ``dp_size`` pools of their own with ``max_running_requests // dp`` slots each
    (§1.5b): ``dp × min(mrr // dp, tokens × dcp // context)``; without either, :func:`tuner.records.context_capacity`.

    Args:
        family: The config's knobs (``dcp_size``, ``dp_size``; a :data:`Family` or a mapping).
        mrr: ``max_running_requests`` as the command sets it (across the DP ranks).
        tokens: One rank's ``max_total_num_tokens``.
        context_tokens: The context length (tokens).
    """
    knobs = dict(family)
    dp, dcp = int(knobs.get("dp_size") or 1), int(knobs.get("dcp_size") or 1)
    return dp * min(max(0, mrr) // dp, max(0, tokens) * dcp // max(1, context_tokens))


def margin_for(history: Sequence[tuple[int, TrialRecord]], settings: ModelSettings, *,
               believed_check: bool = False) -> float:
    """GiB kept free above the scaled activation peak, from how well the memory model predicted.

    Every launched trial with a prediction (``prediction.free_gib_after_graphs``) and a start that
    reported its free memory after graphs (§1.6, ``available_gpu_mem``) checks the model: the
    margin is the largest over-prediction seen (predicted free − measured free, GiB), at least
    ``min_margin_gib``. Before any such check it is ``margin_gib`` (the model's first
    extrapolation from the baseline is unverified). An under-prediction (more free than
    predicted) is safe and does not widen the margin. A start that failed before reporting its
    free memory checks nothing here: its failure bounds the fraction from above instead.

    Args:
        history: ``(trial number, record)`` of the finished trials.
        settings: The models' settings (the two margins).
        believed_check: A running trial's prediction is believed (the believer of
            :mod:`tuner.study.decide.memory`): its start counts as one more check, with no error.

    Returns:
        GiB, at least ``min_margin_gib`` (``margin_gib`` when nothing was checked).
    """
    over = [predicted - measured for _, record in history
            if (predicted := record.prediction.free_gib_after_graphs) is not None
            and (measured := record.free_gib_after_graphs) is not None]
    over += settings.prior_checks_gib
    if believed_check:
        over.append(0.0)
    if not over:
        return settings.margin_gib
    return max(settings.min_margin_gib, *over)


def changed_knobs(base: Family, other: Family) -> str:
    """The knobs two families differ in, comma-separated (``max_running_requests`` when none)."""
    a, b = dict(base), dict(other)
    names = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(names) or "max_running_requests"


def neighbours(space: Space, params: Mapping[str, Any]) -> list[Family]:
    """The families one non-memory step from ``params`` (:meth:`tuner.study.space.Space.neighbours`)."""
    return [family_of(config) for config in space.neighbours(params)]


def _survivors(history: Sequence[tuple[int, TrialRecord]], space: Space) -> list[Point]:
    """The measured survivors that calibrate the memory model."""
    return [_point(number, record, space, measured=True) for number, record in history
            if record.outcome == "ok" and not record.memory.probe_only and record.memory.calibrates
            and record.constraints.get("oom_or_crash", 1.0) <= 0 and record.constraints.get("stress", -1.0) <= 0]


def _oom_starts(history: Sequence[tuple[int, TrialRecord]], space: Space) -> list[Point]:
    """Trials that started and then died of a runtime OOM under load: their startup log still
    calibrates the memory model (the pool and the free memory after graphs were reported), but
    they achieved no capacity and their free memory bounds the activation need from below only.
    Used when no trial survived its load (e.g. the baseline's own flags OOM under the stress load)."""
    return [_point(number, record, space, measured=False) for number, record in history
            if record.failure_class is FailureClass.RUNTIME_OOM and record.params and record.memory.calibrates]


def _point(number: int, record: TrialRecord, space: Space, *, measured: bool) -> Point:
    """``record`` as a calibration point: a survivor's peak, feasibility and capacity
    (``measured``), or a start that died under load (none of them)."""
    params = space.snap(record.params)
    memory = record.memory
    assert memory.capacity_model is not None and memory.context_len  # MemoryFacts.calibrates
    return Point(
        number=number, params=params,
        # The count the server ran with (the baseline's may lie above the space: its
        # req_to_token table and graphs are that count's, not the snapped one's).
        slots=int(record.params.get("max_running_requests") or params["max_running_requests"]),
        model=memory.capacity_model, context_len=memory.context_len, page_size=memory.page_size,
        peak_gib=memory.peak_activation_gib if measured else None, feasible=measured and record.feasible,
        capacity=(record.context_capacity or 0) if measured else 0,
    )


def _predict(ref: Point, mfs: float, mrr: int, family: Family, slot_cost_gib: float) -> tuple[int, float]:
    graph_bs = dict(family).get("cuda_graph_max_bs")
    tokens = ref.model.tokens(mfs, page_size=ref.page_size)
    free = ref.model.headroom_gib(mfs, max_running_requests=mrr, context_len=ref.context_len,
                                  cuda_graph_max_bs=int(graph_bs) if graph_bs else None)
    extra = mrr - ref.slots
    if extra > 0:
        free -= extra * slot_cost_gib
    return tokens, free


def _effective_prefill(cps: Any, settings: ModelSettings) -> float:
    cps = int(cps)
    longest = settings.longest_input_tokens or settings.context_tokens
    return float(cps) if cps > 0 else float(min(16384, max(longest, 1)))


def _slot_cost(points: Sequence[Point], settings: ModelSettings) -> float:
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
            if family_of(a.params) != family_of(b.params) or mb <= ma:
                continue
            fa = a.model.observed_free_after_graphs_gib
            fb = b.model.observed_free_after_graphs_gib
            if fa is None or fb is None:
                continue
            _, predicted = _predict(a, b.params["mem_fraction_static"], mb, family_of(b.params), 0.0)
            cost = max(cost, (predicted - fb - _LOG_RESOLUTION_GIB) / (mb - ma))
    return cost



def _without_graphs(family: Family) -> Family:
    """``family`` without ``cuda_graph_max_bs``."""
    return tuple((k, v) for k, v in family if k != "cuda_graph_max_bs")


def _graph_facts(history: Sequence[tuple[int, TrialRecord]], space: Space,
                 settings: ModelSettings) -> tuple[GraphFacts | None, dict[int, GraphCoverage]]:
    """The unit's CUDA-graph facts (from the first launch that reported ``cuda_graph_max_bs``) and
    each launch's coverage: its logged captured list, else predicted from the facts."""
    facts = None
    for _number, record in history:
        if record.outcome not in ("ok", "failed"):
            continue
        logged = (record.resolved.get("cuda_graph_bs") or {}).get("value")
        max_bs = (record.resolved.get("cuda_graph_max_bs") or {}).get("value")
        slots = int(record.params.get("max_running_requests") or 0)
        max_bs = max_bs or record.params.get("cuda_graph_max_bs")
        if not max_bs and logged and slots > max(logged):
            max_bs = max(logged)  # cut by cuda_graph_max_bs, not by the request table (§2.1)
        if max_bs:
            facts = GraphFacts.read(logged, int(max_bs), settings.sglang_version)
            break
    coverages: dict[int, GraphCoverage] = {}
    for number, record in history:
        if record.outcome != "ok" or not record.params:
            continue
        logged = (record.resolved.get("cuda_graph_bs") or {}).get("value")
        if logged:
            coverages[number] = GraphCoverage(tuple(sorted(int(b) for b in logged)),
                                              padding=facts.padding if facts else True)
        elif facts is not None:
            params = space.snap(record.params)
            graph_bs = params.get("cuda_graph_max_bs")
            cov = facts.coverage(int(record.params.get("max_running_requests") or params["max_running_requests"]),
                                 int(graph_bs) if graph_bs else None)
            if cov is not None:
                coverages[number] = cov
    return facts, coverages
