"""Trial records: what one trial asked for, what SGLang resolved, and what was measured.

This is the contract between the writer (:mod:`tuner.study` / :mod:`tuner.trial`) and the readers
(:mod:`tuner.report`, :mod:`tuner.apply`). A record is stored as the JSON user attribute
:data:`RECORD_ATTR` of its Optuna trial; study-level facts under :data:`STUDY_ATTR`. A record is
frozen and typed throughout (:class:`MemoryFacts`, :class:`Prediction`, :class:`CacheFacts`,
:class:`MeasuredLoad`); a record stored by an earlier version (plain dictionaries, a stored
``feasible``) still validates (``tests/test_records.py`` reads one).

Objectives (Optuna ``directions = ["maximize", "maximize"]``): ``values[0]`` is the context
capacity (requests of the workload's context length resident at once), ``values[1]`` the output
throughput in tokens/s. Constraints (Optuna ``trial.set_constraint``; feasible when every value
≤ 0): see :data:`CONSTRAINT_NAMES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, model_validator

from tuner.sglang.failures import FailureClass
from tuner.sglang.memory import KVCapacityModel
from tuner.sglang.speculative import DraftMemory

__all__ = [
    "RECORD_ATTR",
    "STUDY_ATTR",
    "CONSTRAINT_NAMES",
    "Constraints",
    "PhaseResult",
    "MemoryFacts",
    "Prediction",
    "CacheFacts",
    "MeasuredLoad",
    "QualityFacts",
    "SloStep",
    "SloCapacity",
    "CapacityBasis",
    "CapacityMeasure",
    "TrialRecord",
    "StudyInfo",
    "context_capacity",
    "now_iso",
]

RECORD_ATTR = "tuner.record"
"""Optuna trial user attribute holding ``TrialRecord.model_dump(mode="json")``."""
STUDY_ATTR = "tuner.study"
"""Optuna study user attribute holding ``StudyInfo.model_dump(mode="json")``."""
CONSTRAINT_NAMES = ("oom_or_crash", "slo", "stress", "quality", "context_fits")
"""Order of the constraint values Optuna stores for a trial (``trial.set_constraint``):
``oom_or_crash`` is 1.0 on any startup/runtime failure else -1.0; ``slo`` is the largest relative
SLO overshoot (``measured/target - 1``; ≤ 0 when met); ``stress`` is 1.0 when the stress phase
failed (an OOM, errored requests, a cut load) else -1.0; ``quality`` is 1.0 when the candidate
changes numerics and its answers failed the quality gate or could not be compared, else -1.0 (a
record stored before the gate existed has none, and reads -1.0: :data:`BEFORE_GATE`);
``context_fits`` is 1.0 when the workload's longest request (input + output) is longer than one
request's ceiling (``per_request_max_tokens``: one DP rank's pool under DP attention, the logical
pool under DCP, ``context_len``; issue 23), else -1.0 (a record stored before it reads -1.0)."""

BEFORE_GATE = {"quality": -1.0, "context_fits": -1.0}
"""The value of a constraint added after records were stored without it: a record from before the
quality gate changed no numerics through the study (``tuner apply`` still refuses a numerics change
never probed, from its flags and :class:`QualityFacts`)."""


class Constraints(BaseModel):
    """THE feasibility rule: a trial is feasible when every constraint value is ≤ 0, and a
    constraint the trial never got to measure counts as violated (1.0).

    The values follow :data:`CONSTRAINT_NAMES` (Optuna's ``set_constraint`` names). Every place
    that decides feasibility (the trial's record, the study's tell, the readers' views, the
    offline benchmark's runner) goes through this class.

    Attributes:
        oom_or_crash: 1.0 on any startup or runtime failure, else -1.0.
        slo: The largest relative SLO overshoot (``measured/target - 1``; ≤ 0 when met).
        stress: 1.0 when the stress phase failed (an OOM, errored requests, a cut load), else -1.0.
        quality: 1.0 when the quality gate failed or could not judge a numerics change, else -1.0.
        context_fits: 1.0 when the workload's longest request does not fit one request's ceiling, else -1.0.
    """

    model_config = ConfigDict(frozen=True)

    oom_or_crash: float = 1.0
    slo: float = 1.0
    stress: float = 1.0
    quality: float = 1.0
    context_fits: float = 1.0

    @classmethod
    def of(cls, values: Mapping[str, float]) -> Constraints:
        """The constraints in ``values`` (name → value); a name missing there is violated (one of
        :data:`BEFORE_GATE` reads its value there)."""
        values = {**BEFORE_GATE, **values}
        return cls(**{name: float(values[name]) for name in CONSTRAINT_NAMES if values.get(name) is not None})

    @classmethod
    def all_violated(cls) -> dict[str, float]:
        """Every constraint violated (1.0), by name: a trial that measured nothing."""
        return cls().values()

    @staticmethod
    def feasible_values(values: Mapping[str, float]) -> bool:
        """Whether ``values`` (name → value) are feasible: every constraint of
        :data:`CONSTRAINT_NAMES` present and ≤ 0 (:attr:`feasible` of :meth:`of`, without building
        the model: a study's readers ask it of every trial, often); one of :data:`BEFORE_GATE`
        missing reads its value there."""
        merged = {**BEFORE_GATE, **values}
        return all(merged.get(name) is not None and float(merged[name]) <= 0.0 for name in CONSTRAINT_NAMES)

    @staticmethod
    def holds(values: Mapping[str, float]) -> bool:
        """Whether every value in ``values`` is ≤ 0 (a stored set, names as stored)."""
        return all(float(v) <= 0.0 for v in values.values())

    def values(self) -> dict[str, float]:
        """Name → value, in :data:`CONSTRAINT_NAMES` order."""
        return {name: float(getattr(self, name)) for name in CONSTRAINT_NAMES}

    def violated(self) -> list[str]:
        """The names of the constraints that do not hold (value > 0)."""
        return [name for name, value in self.values().items() if value > 0.0]

    @property
    def feasible(self) -> bool:
        """Every constraint ≤ 0."""
        return not self.violated()


class PhaseResult(BaseModel):
    """One load phase of a trial (``warmup``, ``measure``, ``stress``, ``capacity_probe``).

    ``metrics`` uses bench_serving's key names (``shared/sglang-reference.md`` §6.2):
    ``request_throughput`` (req/s), ``output_throughput`` (tok/s), ``mean_ttft_ms``,
    ``p99_ttft_ms``, ``p99_itl_ms``, ``p99_tpot_ms``, ``p99_e2e_latency_ms``, ``concurrency``,
    plus ``goodput`` (req/s meeting every SLO), ``slo_attainment`` (0-1), ``error_rate`` (0-1),
    ``cache_hit_rate`` (0-1).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    duration_s: float
    completed: int = 0
    errored: int = 0
    incomplete: int = 0
    stopped_early: bool = False
    stop_reason: str | None = None
    metrics: dict[str, float | None] = Field(default_factory=dict)


_FACTS = ConfigDict(frozen=True, extra="allow")
"""Facts of a record: frozen; a key an earlier (or later) version stored is kept as it was."""


class MemoryFacts(BaseModel):
    """A started trial's memory report: SGLang's per-rank startup lines, what ``/get_server_info``
    said, the memory model calibrated on them, and what the GPU monitor measured under load
    (``shared/sglang-reference.md`` §1.2, §1.6, §4.2, §8). Empty (every field unset) for a trial
    that never started; a failed start keeps its ranks' lines only.

    Attributes:
        ranks: Per rank prefix (``"TP0"``), the parsed startup lines as stored
            (:class:`tuner.sglang.logs.RankMemory` fields).
        server_info: ``weight_gib``, ``kvcache_gib``, ``graph_gib``, ``startup_available_gib`` (GiB)
            from ``/get_server_info``.
        scheduler: The scheduler's startup line (:class:`tuner.sglang.logs.SchedulerInfo` fields).
        context_len: SGLang's ``context_len`` (tokens).
        page_size: SGLang's page size (tokens).
        weight_gib: Weights ``W`` of the primary rank (GiB).
        kv_pool_gib: The KV pool (GiB).
        graph_gib: CUDA graphs (GiB).
        capacity_model: The memory model calibrated on this start, or ``None``.
        capacity_model_error: Why no model could be calibrated (or a stored one read).
        draft: The draft model's memory on this start (weights, KV pool, its graphs and the
            target's verify graphs; :class:`tuner.sglang.speculative.DraftMemory`), or ``None``
            without a draft.
        probe_only: The boot probe showed a capacity too low to matter: no load ran.
        retractions: Retraction lines in the trial's log.
        gpu_used_gib_after_start: GPU memory in use after the start (GiB, the GPU monitor).
        gpu_peak_used_gib_under_load: The peak under load (GiB).
        peak_activation_gib: Their difference: the activation peak the planner sizes headroom with.
    """

    model_config = _FACTS

    ranks: dict[str, dict[str, Any]] = Field(default_factory=dict)
    server_info: dict[str, float | None] = Field(default_factory=dict)
    scheduler: dict[str, Any] | None = None
    context_len: int | None = None
    page_size: int = 1
    weight_gib: float | None = None
    kv_pool_gib: float | None = None
    graph_gib: float | None = None
    capacity_model: KVCapacityModel | None = None
    capacity_model_error: str | None = None
    draft: DraftMemory | None = None
    probe_only: bool = False
    retractions: int | None = None
    gpu_used_gib_after_start: float | None = None
    gpu_peak_used_gib_under_load: float | None = None
    peak_activation_gib: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _stored(cls, data: Any) -> Any:
        """A stored memory model that no longer validates (written by an older version) is kept as
        an error, not a failure to read the whole record; a missing page size is SGLang's 1."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("page_size") is None:
            data.pop("page_size", None)
        model = data.get("capacity_model")
        if isinstance(model, dict):
            try:
                KVCapacityModel.model_validate(model)
            except ValidationError as err:
                data.pop("capacity_model")
                data.setdefault("capacity_model_error", f"stored memory model unreadable: {err.error_count()} errors")
        return data

    @property
    def calibrates(self) -> bool:
        """Whether this start calibrates the memory model (a model and SGLang's ``context_len``)."""
        return self.capacity_model is not None and bool(self.context_len)

    def stored(self) -> dict[str, Any]:
        """The facts as stored (JSON; unset fields left out), for readers of the stored shape."""
        return self.model_dump(mode="json", exclude_none=True)


class Prediction(BaseModel):
    """What the planner expected of a config before it was launched (stored with its trial).

    Attributes:
        token_capacity: Predicted ``max_total_num_tokens``.
        context_capacity: Predicted context capacity (requests).
        free_gib_after_graphs: Predicted GPU memory free after CUDA graphs (GiB).
        need_gib: The headroom the stress load was predicted to need (GiB).
        calibrated_on_trial: The trial whose memory model made the prediction.
        running_requests: Requests predicted to run at once in the measured window.
        slo_safe_running_requests: The SLO bracket's largest safe running-request count.
        slo_safe_trial: The trial that measured it.
        slo_broken_running_requests: The bracket's smallest SLO-breaking count.
        slo_broken_trial: The trial that measured it.
        believed_pending_capacity: The capacity believed of trials running on other hosts.
        compare_with_trial: The trial this one is measured against (the cache candidate's flags).
        why: One line: why the planner proposed it.
    """

    model_config = _FACTS

    token_capacity: int | None = None
    context_capacity: int | None = None
    free_gib_after_graphs: float | None = None
    need_gib: float | None = None
    calibrated_on_trial: int | None = None
    running_requests: float | None = None
    slo_safe_running_requests: float | None = None
    slo_safe_trial: int | None = None
    slo_broken_running_requests: float | None = None
    slo_broken_trial: int | None = None
    believed_pending_capacity: int | None = None
    compare_with_trial: int | None = None
    why: str | None = None

    def stored(self) -> dict[str, Any]:
        """The prediction as stored (JSON; unset fields left out)."""
        return self.model_dump(mode="json", exclude_none=True)


class CacheFacts(BaseModel):
    """The prefix cache's tiers in the measured window (``shared/sglang-reference.md`` §7).

    Attributes:
        hit_rate: Share of prompt tokens served from the cache (0-1).
        device_hit_rate: Of them from GPU memory (0-1).
        host_hit_rate: From the hierarchical cache's host tier (0-1).
        storage_hit_rate: From a storage backend (0-1).
        hit_rate_source: ``cached_tokens_details`` (per request, 0.5.10+) or ``/metrics``.
        host_pool_gb_per_rank: The host pool one rank pinned (decimal GB).
        host_pool_ranks: Ranks that pinned one.
        host_pool_gb: Their sum (decimal GB).
        host_pool_tokens_per_rank: Tokens one rank's host pool holds.
    """

    model_config = _FACTS

    hit_rate: float | None = None
    device_hit_rate: float | None = None
    host_hit_rate: float | None = None
    storage_hit_rate: float | None = None
    hit_rate_source: str | None = None
    host_pool_gb_per_rank: float | None = None
    host_pool_ranks: int | None = None
    host_pool_gb: float | None = None
    host_pool_tokens_per_rank: int | None = None

    @property
    def measured(self) -> bool:
        """Whether anything about the cache was measured or pinned."""
        return self.hit_rate is not None or self.host_pool_gb is not None


class MeasuredLoad(BaseModel):
    """The load the server ran in the measured window (the SLO model learns from it).

    Attributes:
        streams: Closed-loop concurrency of the load generator.
        running_requests: Requests the server ran at once (at most its effective
            ``max_running_requests``).
        chunk_tokens: Tokens per prefill chunk (``chunked_prefill_size``; the longest prompt with
            chunking off).
    """

    model_config = _FACTS

    streams: float | None = None
    running_requests: float | None = None
    chunk_tokens: float | None = None


class QualityFacts(BaseModel):
    """The quality gate's facts of a trial (:mod:`tuner.load.quality`): what it changes in the
    numerics, and how its greedy answers compare with the baseline's.

    Attributes:
        numerics: The numerics-relevant flags the launch sets (:func:`tuner.sglang.numerics.numerics_key`).
        changes: The flags on which they differ from the baseline's (empty: nothing to gate).
        status: ``reference`` (its answers are the study's reference), ``same`` (the baseline's
            numerics; not probed), ``passed`` / ``failed`` (probed, or ``cached_from_trial``'s
            probe of the same numerics), ``unprobed`` (a change never compared: the gate was off,
            there was no reference, the probe could not run; ``reason`` says which).
        probed_on_trial: The trial whose probe gave the figures (this one, or an earlier one with
            the same numerics: one probe per distinct numerics per study).
        reference_trial: The trial whose answers were the reference.
        prompts: Prompts compared.
        exact_match_share: Share of answers token-for-token identical to the reference's (0-1).
        first_divergence: The earliest token position at which any answer differs (tokens;
            ``None``: none differs).
        mean_abs_logprob_delta: Mean |Δ logprob| of the chosen tokens over each answer's prefix
            shared with the reference (nats).
        task_accuracy: Share of the task set answered right (0-1, scored by ``[quality]
            task_scoring``), when one is configured.
        reference_task_accuracy: The reference's on the same set (0-1).
        task_lost, task_gained: Tasks the reference answered right and this launch wrong, and the
            other way round (the paired comparison's discordant items), of ``task_items``.
        task_drop_ci: The 95 % confidence interval of the accuracy drop below the reference's
            (paired, 0-1 each; ``[low, high]``).
        probe_s: The probe's wall time, seconds.
        digest: What the probe asked (prompts, answer lengths, tasks): probes are comparable only
            with the same digest.
        reason: One line: why it failed, or why it was not probed.
        answers: The reference's answers (``reference`` only): ``digest`` of the prompts and
            settings, ``token_ids`` and ``logprobs`` per prompt.
    """

    model_config = _FACTS

    numerics: dict[str, Any] = Field(default_factory=dict)
    changes: list[str] = Field(default_factory=list)
    status: Literal["reference", "same", "passed", "failed", "unprobed"] | None = None
    probed_on_trial: int | None = None
    reference_trial: int | None = None
    prompts: int | None = None
    exact_match_share: float | None = None
    first_divergence: int | None = None
    mean_abs_logprob_delta: float | None = None
    task_accuracy: float | None = None
    reference_task_accuracy: float | None = None
    task_lost: int | None = None
    task_gained: int | None = None
    task_items: int | None = None
    task_drop_ci: list[float] | None = None
    probe_s: float | None = None
    digest: str | None = None
    reason: str | None = None
    answers: dict[str, Any] | None = None

    @property
    def probed(self) -> bool:
        """Whether its answers were compared with the reference (``passed`` or ``failed``)."""
        return self.status in ("passed", "failed")

    def stored(self) -> dict[str, Any]:
        """The facts as stored, without the reference's answers (JSON; unset fields left out)."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"answers"})


CapacityBasis = Literal["slo_safe", "oom_safe"]
"""Which context capacity a figure is: ``oom_safe`` (longest contexts that fit without OOM:
:attr:`TrialRecord.context_capacity`) or ``slo_safe`` (sessions at which the latency SLO still
holds in a steady window, measured: :attr:`SloCapacity.contexts`)."""

CapacityMeasure = Literal["steady", "burst"]
"""How an SLO-safe figure was measured: ``steady`` (closed-loop sessions started over a ramp,
judged on a steady window after the warm-up, :mod:`tuner.load.steady`; issue 36) or ``burst``
(every longest prompt sent at the same instant with a few output tokens: what studies stored
before issue 36 called SLO-safe; now the *burst admission* figure beside it)."""


class SloStep(BaseModel):
    """One load judged against the SLO's p99 TTFT/ITL/TPOT limits: a steady window of closed-loop
    sessions (a bracketing step of the SLO-safe capacity) or the burst of longest prompts.

    Attributes:
        contexts: Closed-loop sessions of the steady window (or longest prompts sent at once,
            for the burst).
        completed: Requests whose latencies the percentiles are over.
        p99_ttft_ms, p99_itl_ms, p99_tpot_ms: Their p99 (ms), ``None`` when not measured.
        p99_ttft_low_ms, p99_ttft_high_ms, p99_itl_low_ms, p99_itl_high_ms: 95 % order-statistic
            intervals of the p99s (ms; ``high`` ``None``: too few samples to bound it from above,
            :func:`tuner.load.metrics.quantile_interval`).
        attainment: The share of requests meeting every limit (0-1), with its 95 % Wilson
            interval ``attainment_low``-``attainment_high``; ``None`` where not judged.
        violations: Each limit's relative overshoot (``measured / limit − 1``; ≤ 0 holds).
        met: Every limit held and no request errored.
    """

    model_config = _FACTS

    contexts: int
    completed: int = 0
    p99_ttft_ms: float | None = None
    p99_itl_ms: float | None = None
    p99_tpot_ms: float | None = None
    p99_ttft_low_ms: float | None = None
    p99_ttft_high_ms: float | None = None
    p99_itl_low_ms: float | None = None
    p99_itl_high_ms: float | None = None
    attainment: float | None = None
    attainment_low: float | None = None
    attainment_high: float | None = None
    violations: dict[str, float | None] = Field(default_factory=dict)
    met: bool = False


class SloCapacity(BaseModel):
    """The SLO-safe capacity: how many closed-loop sessions of the workload (a share of their
    requests at the longest context) the server serves within the SLO's p99 TTFT/ITL (and TPOT)
    limits in a steady window (:mod:`tuner.load.steady`), bracketed downwards from the OOM-safe
    capacity (the next count interpolated from the measured overshoot,
    :func:`tuner.load.search.bracket_level`); and beside it the *burst admission*: every longest
    prompt sent at once, judged by the same limits (the OOM stress, never the SLO-safe figure).

    Attributes:
        limits: The limits judged (``{"p99_ttft_ms": 30000.0, ...}``); empty: no SLO, nothing judged.
        contexts: The largest session count measured to meet them (0: none measured did; ``None``:
            not measured: no SLO, no capacity phase, or the burst failed).
        broken_at: The smallest count measured to break them (the bracket's upper end), or ``None``.
        at_least: The first window was capped by ``[budget] max_concurrency`` below the OOM-safe
            capacity and met the SLO: more may meet it.
        steps: Every window judged, in order (``measure`` ``burst``: ``steps[0]`` is the burst).
        basis: The capacity the study's objective used for this trial (:data:`CapacityBasis`,
            from ``[objective] capacity``).
        measure: How :attr:`contexts` was measured (:data:`CapacityMeasure`); a record stored
            before issue 36 reads ``burst``.
        burst: The burst admission: the longest prompts at once (the OOM stress) judged by the
            limits, or ``None`` when not judged.
    """

    model_config = _FACTS

    limits: dict[str, float] = Field(default_factory=dict)
    contexts: int | None = None
    broken_at: int | None = None
    at_least: bool = False
    steps: list[SloStep] = Field(default_factory=list)
    basis: CapacityBasis = "oom_safe"
    measure: CapacityMeasure = "steady"
    burst: SloStep | None = None

    @model_validator(mode="before")
    @classmethod
    def _stored(cls, data: Any) -> Any:
        """A record stored before issue 36 has no ``measure``: its figure came from the burst
        (its ``steps[0]`` is the burst), so it reads ``measure="burst"`` with that burst beside it."""
        if not isinstance(data, dict) or "measure" in data or not data.get("steps"):
            return data
        return {**data, "measure": "burst", "burst": data.get("burst") or data["steps"][0]}

    @property
    def stress(self) -> SloStep | None:
        """The burst's own verdict, or ``None`` when it was not judged."""
        return self.burst if self.burst is not None else (self.steps[0] if self.steps else None)

    def none_held(self) -> str | None:
        """Why no session count holds the SLO, with the fix, in one clause; ``None`` unless the
        steady windows measured 0 (:attr:`contexts`).

        Where 1 session broke the SLO, no admission limit makes the config hold it: ``"no session
        count meets the SLO (1 session breaks it): loosen the SLO or choose another config"``.
        Where the bracket's windows ran out above 1 (``[budget] slo_capacity_steps``, every count
        measured broke it), the counts below :attr:`broken_at` were never measured and may hold:
        the fix is more windows, not another SLO.
        """
        if self.contexts != 0 or self.measure != "steady":
            return None
        if self.broken_at is None or self.broken_at <= 1:
            return "no session count meets the SLO (1 session breaks it): loosen the SLO or choose another config"
        measured = ", ".join(str(s.contexts) for s in self.steps)
        return (f"no session count measured meets the SLO ({measured} sessions broke it; 1-{self.broken_at - 1} "
                f"not measured: the bracket's windows ran out): raise [budget] slo_capacity_steps, or measure "
                f"the count with `tuner load --max-under-slo --ramp ...`")

    def describe(self) -> str:
        """One line: the SLO-safe count with its evidence, the burst admission beside it, or why
        there is none.

        ``"6 sessions (steady window: 6 meet the SLO: p99 TTFT 19,550 ms, ITL 2,015 ms over 40
        requests; 8 break the SLO: ...); burst admission: 4 longest prompts at once break the SLO
        (p99 TTFT 15,662 ms, ITL 4,905 ms over 4 requests)"``; a record stored before issue 36 says
        its figure is the burst's.
        """
        if not self.limits:
            return "no SLO set"
        burst = self.stress
        burst_text = (f"burst admission: {burst.contexts} longest prompts at once "
                      f"{'meet' if burst.met else 'break'} the SLO ({_latencies(burst)})") if burst is not None else None
        if self.contexts is None or not self.steps:
            return "not measured (no steady window judged)" + (f"; {burst_text}" if burst_text else "")
        if self.measure == "burst":
            return f"{'≥ ' if self.at_least else ''}{self.contexts} by burst admission " \
                   f"(stored before steady windows: {_burst_steps(self)})"
        text = f"{'≥ ' if self.at_least else ''}{self.contexts} sessions"
        parts = []
        met = next((s for s in self.steps if s.met and s.contexts == self.contexts), None)
        if met is not None:
            parts.append(f"{met.contexts} meet the SLO: {_latencies(met)}")
        elif self.contexts == 0:
            parts.append(self.none_held() or "no session count measured meets the SLO")
        broken = next((s for s in self.steps if not s.met and s.contexts == self.broken_at), None)
        if broken is not None:
            parts.append(f"{broken.contexts} break the SLO: {_latencies(broken)}")
        line = f"{text} (steady window: {'; '.join(parts)})"
        return f"{line}; {burst_text}" if burst_text else line


def _burst_steps(capacity: SloCapacity) -> str:
    """A stored burst-based figure's steps: ``burst at 8 breaks the SLO (...); 5 meets it (...)``."""
    first = capacity.steps[0]
    parts = [f"burst at {first.contexts}: {_latencies(first)} {'meets' if first.met else 'breaks'} the SLO"]
    met = next((s for s in capacity.steps if s.met and s.contexts == capacity.contexts), None)
    if met is not None and met is not first:
        parts.append(f"{met.contexts} meets it: {_latencies(met)}")
    return "; ".join(parts)


def _latencies(step: SloStep) -> str:
    """``p99 TTFT 31,285 ms [95 %: 29,000-∞], ITL 6,154 ms over 8 requests, SLO attainment 88 % [..]``."""
    parts = []
    if step.p99_ttft_ms is not None:
        interval = ""
        if step.p99_ttft_low_ms is not None:
            high = "∞" if step.p99_ttft_high_ms is None else f"{step.p99_ttft_high_ms:,.0f}"
            interval = f" [95 %: {step.p99_ttft_low_ms:,.0f}-{high}]"
        parts.append(f"p99 TTFT {step.p99_ttft_ms:,.0f} ms{interval}")
    if step.p99_itl_ms is not None:
        parts.append(f"ITL {step.p99_itl_ms:,.0f} ms")
    if step.p99_tpot_ms is not None:
        parts.append(f"TPOT {step.p99_tpot_ms:,.0f} ms")
    text = f"{', '.join(parts) or 'no latency'} over {step.completed} requests"
    if step.attainment is not None:
        text += f", SLO attainment {step.attainment:.0%}"
        if step.attainment_low is not None and step.attainment_high is not None:
            text += f" [95 %: {step.attainment_low:.0%}-{step.attainment_high:.0%}]"
    return text


class TrialRecord(BaseModel):
    """Everything known about one trial.

    Units are in the names: ``_gib`` (2^30 bytes), ``_tokens``, ``_ms``, ``_s``, ``_tok_s``.

    Attributes:
        params: What the tuner asked for, by SGLang field name (``mem_fraction_static``,
            ``max_running_requests``, ``chunked_prefill_size`` (-1 = disabled),
            ``enable_hierarchical_cache``, ``hicache_ratio``, ...).
        argv: The full server command line that was launched.
        resolved: What SGLang resolved, with its source, e.g. ``{"max_total_num_tokens":
            {"value": 159277, "source": "log:scheduler"}}``.
        kind: ``baseline`` (the unit's current flags), ``predicted`` (memory-model candidate),
            ``sampled`` (the sampler), ``enqueued`` (re-run after a killed run).
        outcome: ``ok`` (measured), ``failed`` (startup or runtime failure), ``skipped``
            (proved infeasible without a restart), ``budget`` (not started: no time left).
        per_request_max_tokens: The longest single request (input + output tokens) the started
            server holds: ``min(context_len − 1, pool − 1)`` with one DP rank's pool under DP
            attention and the logical pool under DCP (§1.4, issue 23); the ``context_fits``
            constraint compares the workload's longest request with it.
        cache: The prefix cache's tiers in the measured window (§7): ``hit_rate``,
            ``device_hit_rate``, ``host_hit_rate`` (``storage_hit_rate`` with a storage backend),
            all 0-1 of prompt tokens, ``hit_rate_source`` (``cached_tokens_details`` or
            ``/metrics``), and with the hierarchical cache ``host_pool_gb_per_rank``,
            ``host_pool_ranks``, ``host_pool_gb`` (decimal GB pinned on the host).
        itl_exceedance: The measured window's share of token gaps above the SLO's ITL limit over
            the share its percentile allows (≤ 1 holds; :func:`tuner.load.metrics.itl_exceedance`),
            ``None`` without a percentile ITL limit. ``itl_exceedance_low``: its 95 % lower bound over
            the window's decode steps (:func:`tuner.load.metrics.itl_exceedance_low`).
        measured_load: The load the server ran in the measured window (:class:`MeasuredLoad`).
        repeat_of: The trial this one re-measures (same config, to measure the noise), or ``None``.
        constraints: Constraint values by name (:data:`CONSTRAINT_NAMES`; a missing one was not
            measured, and counts as violated); :attr:`feasible` derives from them.
        prediction: What the planner expected (:class:`Prediction`).
        memory: The memory report (:class:`MemoryFacts`).
        windows: Measured windows this record's throughput averages (a reader merges a config
            measured more than once; 1 as stored).
        quality: The quality gate's facts (:class:`QualityFacts`).
        slo_capacity: The SLO-safe context capacity beside the OOM-safe :attr:`context_capacity`
            (:class:`SloCapacity`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    params: dict[str, Any] = Field(default_factory=dict)
    argv: list[str] = Field(default_factory=list)
    resolved: dict[str, dict[str, Any]] = Field(default_factory=dict)
    kind: Literal["baseline", "predicted", "sampled", "enqueued"] = "sampled"
    outcome: Literal["ok", "failed", "skipped", "budget"] = "ok"
    context_tokens: int | None = None
    context_capacity: int | None = None
    token_capacity: int | None = None
    per_request_max_tokens: int | None = None
    free_gib_after_graphs: float | None = None
    output_throughput_tok_s: float | None = None
    goodput_req_s: float | None = None
    p99_ttft_ms: float | None = None
    p99_itl_ms: float | None = None
    itl_exceedance: float | None = None
    itl_exceedance_low: float | None = None
    measured_load: MeasuredLoad = Field(default_factory=MeasuredLoad)
    repeat_of: int | None = None
    constraints: dict[str, float] = Field(default_factory=dict)
    failure_class: FailureClass | None = None
    failure_evidence: str | None = None
    skipped_reason: str | None = None
    proved_by_trial: int | None = None
    prediction: Prediction = Field(default_factory=Prediction)
    memory: MemoryFacts = Field(default_factory=MemoryFacts)
    cache: CacheFacts = Field(default_factory=CacheFacts)
    phases: list[PhaseResult] = Field(default_factory=list)
    artifacts: dict[str, str] = Field(default_factory=dict)
    log_excerpt: list[str] = Field(default_factory=list)
    started_at: str | None = None
    duration_s: float | None = None
    windows: int = 1
    quality: QualityFacts = Field(default_factory=QualityFacts)
    slo_capacity: SloCapacity = Field(default_factory=SloCapacity)

    @model_validator(mode="before")
    @classmethod
    def _stored(cls, data: Any) -> Any:
        """A stored record carries ``feasible`` beside the constraints it derives from: it is
        dropped (:attr:`feasible` is computed), and refused when it contradicts them (a record
        made by hand that says feasible without its constraints).

        Raises:
            ValueError: ``feasible`` disagrees with ``constraints``.
        """
        if not isinstance(data, dict) or "feasible" not in data:
            return data
        data = dict(data)
        stated = data.pop("feasible")
        if bool(stated) != Constraints.feasible_values(data.get("constraints") or {}):
            raise ValueError(f"feasible={stated} contradicts constraints {data.get('constraints') or {}}")
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def feasible(self) -> bool:
        """Every constraint ≤ 0, a missing one counting as violated (:class:`Constraints`); stored
        with the record for readers of the stored JSON (and dropped when it is read back)."""
        return Constraints.feasible_values(self.constraints)

    def capacity(self, basis: CapacityBasis) -> int | None:
        """The context capacity on ``basis``: ``oom_safe`` is :attr:`context_capacity`;
        ``slo_safe`` is :attr:`SloCapacity.contexts` where it was measured, else the OOM-safe one
        (no SLO, or no stress phase judged: nothing narrower is known)."""
        if basis == "slo_safe" and self.slo_capacity.contexts is not None:
            return min(self.slo_capacity.contexts, self.context_capacity or self.slo_capacity.contexts)
        return self.context_capacity

    @property
    def objective_capacity(self) -> int | None:
        """The capacity the study's objective was told for this trial (Optuna's ``values[0]``):
        :meth:`capacity` on :attr:`SloCapacity.basis`."""
        return self.capacity(self.slo_capacity.basis)


class StudyInfo(BaseModel):
    """Study-level facts: the environment every trial ran in and how "best" is chosen.

    Attributes:
        environment: ``sglang_version``, ``gpu_name``, ``gpu_count``, ``driver_version``,
            ``model`` (path or name); a study refuses to mix environments unless told to.
        target: ``launcher`` (``systemd`` / ``process``), ``unit`` or ``command``, ``url``.
        baseline_argv: The command line the service ran before the study.
        policy: The "best" selection policy (see :mod:`tuner.config`).
        context_tokens: The workload's context length used for context capacity.
    """

    model_config = ConfigDict(extra="forbid")

    environment: dict[str, Any] = Field(default_factory=dict)
    target: dict[str, Any] = Field(default_factory=dict)
    baseline_argv: list[str] = Field(default_factory=list)
    policy: dict[str, Any] = Field(default_factory=dict)
    context_tokens: int | None = None
    config_path: str | None = None


def context_capacity(effective_max_running_requests: int | None, max_total_num_tokens: int, context_tokens: int) -> int:
    """Requests of ``context_tokens`` that can be resident at once.

    ``min(effective max_running_requests, floor(max_total_num_tokens / context_tokens))``, with
    both numbers as the server resolved them (§2.3, §4.2 line 8).
    """
    by_tokens = max_total_num_tokens // max(1, context_tokens)
    if effective_max_running_requests is None:
        return by_tokens
    return min(effective_max_running_requests, by_tokens)


def now_iso() -> str:
    """The current UTC time as ISO 8601 to the second (``2026-12-02T04:17:20+00:00``): a trial's
    ``started_at``, an apply's time."""
    return datetime.now(UTC).isoformat(timespec="seconds")
