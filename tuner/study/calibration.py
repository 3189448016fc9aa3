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

import tuner.knobs
from tuner.config import BudgetSection, ObjectiveSection, TunerConfig
from tuner.load.workloads import build_workload
from tuner.records import TrialRecord
from tuner.sglang.failures import RESERVE_FAILURES, FailureClass
from tuner.sglang.graphs import GraphCoverage, GraphFacts
from tuner.sglang.memory import KVCapacityModel
from tuner.sglang.speculative import DraftMemory, SpecShape, resolve_shape
from tuner.study.budget import load_concurrency, reachable_slots
from tuner.study.slo_bound import SLOBound, SLOPoint, family_of, slo_bounds, slo_points
from tuner.study.space import SPEC_SHAPE_KNOBS, Space

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
        draft: Its draft model's memory (weights, KV, graphs, the target's verify graphs), or
            ``None`` without a draft.
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
    draft: DraftMemory | None = None


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
        draft: The study's latest start's draft memory (:class:`DraftMemory`): what a draft
            costs a candidate whose reference point ran without one; ``None`` when no start
            ran a draft.
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
    draft: DraftMemory | None = None

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

        def normalise(family: Family) -> Family:
            return bracket_key(space, family)

        graphs, coverages = _graph_facts(history, space, settings)
        windows = [p.model_copy(update={"graphed": _graphed(coverages.get(p.number), p.running_requests)})
                   for p in slo_points(history)]
        draft = next((r.memory.draft for _, r in reversed(history) if r.memory.draft is not None), None)
        drafts = _Drafts(graphs, draft, settings.sglang_version)
        return cls(
            space=space, settings=settings, points=points, graphs=graphs, coverages=coverages, draft=draft,
            model_points=(points or tuple(_oom_starts(history, space))) + settings.prior_points,
            slot_cost_gib=_slot_cost(points, settings, drafts),
            margin_gib=margin_for(history, settings),
            oom_frees=tuple(oom_frees),
            ceilings={f: tuple(v) for f, v in ceilings.items()},
            bounds=slo_bounds(windows, normalise=normalise),
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
        from measured pairs (:attr:`slot_cost_gib`) is charged for them. A draft model's graphs
        and the target's verify graphs are predicted from the reference start's draft memory
        (:class:`tuner.sglang.speculative.DraftMemory`, else the study's latest) at the
        candidate's draft shape and captured sizes, and charged beyond the reference's (§1.5, §2.1).
        """
        return _predict(ref, mfs, mrr, family, self.slot_cost_gib, self._drafts)

    def draft_gib(self, ref: Point, mrr: int, family: Family, tokens: int) -> float | None:
        """GiB of the reserve the candidate's draft takes (its graphs and the target's verify
        graphs; its KV pool too before 0.5.16), predicted from ``ref``'s start (else the study's
        latest draft) at the candidate's shape, ``tokens`` pool and captured sizes; None without
        a draft (§1.5, §2.1)."""
        predicted = self.draft_memory(ref, mrr, family, tokens)
        return None if predicted is None else _draft_gib(predicted)

    def draft_memory(self, ref: Point, mrr: int, family: Family, tokens: int) -> DraftMemory | None:
        """The candidate's draft memory (its pool at its dtype, its graphs, the target's verify
        graphs), predicted from ``ref``'s start (else the study's latest draft); None without a draft."""
        return self._drafts.predicted(ref, mrr, family, tokens)

    @property
    def _drafts(self) -> _Drafts:
        return _Drafts(self.graphs, self.draft, self.settings.sglang_version)

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
        """The bracket key (:func:`bracket_key`) whose windows say most about where the SLO breaks
        (``()`` when none broke it)."""
        binding = [f for f, b in self.bounds.items() if b.binds]
        return max(binding, key=lambda f: (len(self.bounds[f].points), -(self.bounds[f].broken or 0)), default=())

    def bracket_key(self, family: Family) -> Family:
        """The key of ``family``'s SLO bracket in :attr:`bounds` (:func:`bracket_key`)."""
        return bracket_key(self.space, family)

    def bound_of(self, family: Family) -> SLOBound | None:
        """``family``'s own SLO bracket (its windows and those of knobs that differ from it in
        ``cuda_graph_max_bs`` only), or ``None`` when none of them measured a verdict."""
        return self.bounds.get(self.bracket_key(family))

    def bound_for(self, family: Family) -> SLOBound | None:
        """The family's own SLO bound when a window of it broke the SLO; else the
        :meth:`binding_family`'s (an estimate for choosing a proposal, never a proof); else the
        family's own (not binding) or ``None``."""
        own = self.bound_of(family)
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
        bound = self.bound_of(family)
        if bound is not None:
            for point in sorted(bound.points, key=lambda p: p.running_requests):
                if running < point.running_requests or not bound.proves(point, running):
                    continue
                if tokens is not None and not self._surely_runs(tokens, point):
                    continue
                theirs = self.coverages.get(point.number)
                if mine is None or theirs is None:
                    if family_of(self.space.snap(dict(point.family))) == family_of(self.space.snap(dict(family))):
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
        size (SGLang captures the request table's size itself below ``cuda_graph_max_bs``, §2.1).
        Where the space searches ``cuda_graph_max_bs``, the proposal lands on the *smallest* choice
        that captures what the best choice does at ``mrr`` slots: the graphs move with the slots
        when ``mrr`` is above the family's largest captured size (the note says so), and a choice
        above the slots lands on the smallest one with the same captured sizes (the same server:
        every size above the request table is dropped, §2.1), so two launches never differ in an
        unused ``cuda_graph_max_bs`` alone. Without that knob in the space, the note says which
        batches decode eagerly.
        """
        cov = self.coverage(family, mrr)
        if cov is None:
            return family, None
        eager = cov.eager_above(mrr) is not None
        choices = sorted(int(c) for c in self.space.grid("cuda_graph_max_bs"))
        if choices and self.graphs is not None:
            current = dict(family).get("cuda_graph_max_bs") or self._default_graph_bs()
            want = self.graphs.coverage(mrr, choices[-1]) if eager else cov
            best = next((c for c in choices if want is not None
                         and self.graphs.coverage(mrr, c) == want), None)
            if best is None and eager:
                best = min((c for c in choices if c >= mrr), default=choices[-1])
            if best is not None and best != dict(family).get("cuda_graph_max_bs"):
                moved = tuple(sorted({**dict(family), "cuda_graph_max_bs": best}.items()))
                note = (f"cuda_graph_max_bs {best} moves with max_running_requests {mrr} "
                        f"(captured up to {cov.largest} at {current})") if eager else None
                return moved, note
        if not eager:
            return family, None
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
    Each lever says how capacity counts under it (:meth:`tuner.knobs.Lever.pools`, :meth:`tuner.knobs.Lever.interleave`).

    Args:
        family: The config's knobs (``dcp_size``, ``dp_size``; a :data:`Family` or a mapping).
        mrr: ``max_running_requests`` as the command sets it (across the DP ranks).
        tokens: One rank's ``max_total_num_tokens``.
        context_tokens: The context length (tokens).
    """
    knobs = dict(family)
    dp = math.prod(lever.pools(knobs.get(lever.knob.name)) for lever in tuner.knobs.LEVERS)
    dcp = math.prod(lever.interleave(knobs.get(lever.knob.name)) for lever in tuner.knobs.LEVERS)
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
        draft=memory.draft,
    )


def _predict(ref: Point, mfs: float, mrr: int, family: Family, slot_cost_gib: float,
             drafts: _Drafts | None = None) -> tuple[int, float]:
    graph_bs = dict(family).get("cuda_graph_max_bs")
    tokens = ref.model.tokens(mfs, page_size=ref.page_size)
    free = ref.model.headroom_gib(mfs, max_running_requests=mrr, context_len=ref.context_len,
                                  cuda_graph_max_bs=int(graph_bs) if graph_bs else None)
    extra = mrr - ref.slots
    if extra > 0:
        free -= extra * slot_cost_gib
    if drafts is not None:
        free -= drafts.extra_gib(ref, mrr, family, tokens)
    return tokens, free


@dataclass(frozen=True)
class _Drafts:
    """The draft's memory for a candidate, predicted from a start's :class:`DraftMemory` (§1.5, §2.1).

    The target's verify graphs hold ``num_draft_tokens`` tokens per request and the draft's own
    graphs one, for every captured batch size, so both scale with the captured sizes' count, and
    the verify graphs with the draft tokens too (:meth:`DraftMemory.predict`). Before 0.5.16 the
    draft's KV pool also comes out of the reserve with as many tokens as the target's pool.
    """

    graphs: GraphFacts | None
    latest: DraftMemory | None
    version: str | None

    def extra_gib(self, ref: Point, mrr: int, family: Family, tokens: int) -> float:
        """GiB the candidate (``family`` at ``mrr`` slots, a pool of ``tokens``) needs beyond
        what ``ref``'s start held for a draft: negative when it needs less (speculation off, a
        smaller shape or fewer captured sizes)."""
        have = ref.draft
        if have is None and self.latest is None:
            return 0.0
        held = _draft_gib(have) if have is not None else 0.0
        if self._shape(family, have) is None and have is not None:
            # Off: the verify graphs become decode graphs of one token a request.
            ratio = self._captured(mrr, family) / have.capture_sizes if have.capture_sizes else 1.0
            return (have.verify_graph_gib or 0.0) / max(have.num_draft_tokens, 1) * ratio - held
        predicted = self.predicted(ref, mrr, family, tokens)
        if predicted is None:
            return 0.0
        known = have or self.latest
        assert known is not None
        extra = _draft_gib(predicted) - held
        if known.in_budget and known.kv_gib is not None and known.kv_tokens and predicted.kv_gib is not None:
            # 0.5.16+ budgets the draft's pool as a share of the cell by layers: a draft dtype
            # smaller than the start's leaves part of that share free (the flag's help: "the saving
            # shows up as free device memory"), a larger one takes the rest from the reserve.
            extra += predicted.kv_gib - known.kv_gib * tokens / known.kv_tokens
        return extra

    def predicted(self, ref: Point, mrr: int, family: Family, tokens: int) -> DraftMemory | None:
        """The candidate's draft memory (None: it runs no draft): ``ref``'s draft, else the
        study's latest, at the candidate's shape, pool and captured sizes."""
        known = ref.draft or self.latest
        shape = self._shape(family, known)
        if known is None or shape is None:
            return None
        dtype = dict(family).get("speculative_draft_kv_cache_dtype")
        return known.predict(shape, tokens=tokens, capture_sizes=self._captured(mrr, family),
                             kv_dtype=None if dtype is None else str(dtype))

    def _shape(self, family: Family, have: DraftMemory | None) -> SpecShape | None:
        """The candidate's draft shape (None: no draft), the reference's where the family
        does not set it."""
        knobs = dict(family)
        if knobs.get("speculative_algorithm") is False:
            return None
        if all(knobs.get(k) is not None for k in SPEC_SHAPE_KNOBS):
            return resolve_shape(*(int(knobs[k]) for k in SPEC_SHAPE_KNOBS))
        known = have or self.latest
        if known is None:
            return None
        return SpecShape(1, 1, known.num_draft_tokens)  # only num_draft_tokens sizes the graphs

    def _captured(self, mrr: int, family: Family) -> int:
        """How many batch sizes a speculative candidate captures: SGLang's speculative list cut at
        ``cuda_graph_max_bs`` (the family's, else the unit's default) and the request slots (§2.1)."""
        graph_bs = dict(family).get("cuda_graph_max_bs")
        default = self.graphs.default_max_bs if self.graphs is not None else None
        max_bs = int(graph_bs) if graph_bs else int(default or mrr)
        cov = GraphCoverage.predict(max_bs=max_bs, max_running_requests=mrr, speculative=True,
                                    disable_padding=self.graphs is not None and not self.graphs.padding,
                                    version=self.version or "0.5.5", max_bs_is_default=graph_bs is None)
        return len(cov.captured)


def _draft_gib(draft: DraftMemory) -> float:
    """What a draft takes from the reserve: its graphs and the target's verify graphs, and its
    KV pool where SGLang does not count it inside the budget (before 0.5.16)."""
    reserve = (draft.graph_gib or 0.0) + (draft.verify_graph_gib or 0.0)
    return reserve if draft.in_budget else reserve + (draft.kv_gib or 0.0)


def _effective_prefill(cps: Any, settings: ModelSettings) -> float:
    cps = int(cps)
    longest = settings.longest_input_tokens or settings.context_tokens
    return float(cps) if cps > 0 else float(min(16384, max(longest, 1)))


def _slot_cost(points: Sequence[Point], settings: ModelSettings, drafts: _Drafts | None = None) -> float:
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
            _, predicted = _predict(a, b.params["mem_fraction_static"], mb, family_of(b.params), 0.0, drafts)
            cost = max(cost, (predicted - fb - _LOG_RESOLUTION_GIB) / (mb - ma))
    return cost



def _without_graphs(family: Family) -> Family:
    """``family`` without ``cuda_graph_max_bs``."""
    return tuple((k, v) for k, v in family if k != "cuda_graph_max_bs")


def bracket_key(space: Space, family: Family) -> Family:
    """The SLO bracket ``family`` shares (:attr:`Calibration.bounds`): its knobs snapped to
    ``space``, without ``cuda_graph_max_bs``. Configs that differ in the graphs only run the same
    workload on the same scheduler; their windows are told apart by the batches that replayed a
    graph (:attr:`tuner.study.slo_bound.SLOPoint.graphed`), not kept in separate brackets (§2.1)."""
    snapped = space.snap({**dict(family), "mem_fraction_static": space.mem_fraction_static[0],
                          "max_running_requests": space.max_running_requests[0]})
    return _without_graphs(family_of(snapped))


def _graphed(coverage: GraphCoverage | None, running: float) -> int | None:
    """The batches of ``1..running`` that replayed a graph as one number: ``running`` itself when
    every one did, else the largest captured size below the first eager batch; ``None``: unknown."""
    if coverage is None:
        return None
    eager = coverage.eager_above(int(running))
    return int(running) if eager is None else eager - 1


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
