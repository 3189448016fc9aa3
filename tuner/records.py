"""Trial records: what one trial asked for, what SGLang resolved, and what was measured.

This is the contract between the writer (:mod:`tuner.study` / :mod:`tuner.trial`) and the readers
(:mod:`tuner.report`, :mod:`tuner.apply`). A record is stored as the JSON user attribute
:data:`RECORD_ATTR` of its Optuna trial; study-level facts under :data:`STUDY_ATTR`.

Objectives (Optuna ``directions = ["maximize", "maximize"]``): ``values[0]`` is the context
capacity (requests of the workload's context length resident at once), ``values[1]`` the output
throughput in tokens/s. Constraints (Optuna ``constraints_func``; feasible when every value ≤ 0):
see :data:`CONSTRAINT_NAMES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tuner.sglang.failures import FailureClass

__all__ = [
    "RECORD_ATTR",
    "STUDY_ATTR",
    "CONSTRAINT_NAMES",
    "Constraints",
    "PhaseResult",
    "TrialRecord",
    "StudyInfo",
    "context_capacity",
    "now_iso",
]

RECORD_ATTR = "tuner.record"
"""Optuna trial user attribute holding ``TrialRecord.model_dump(mode="json")``."""
STUDY_ATTR = "tuner.study"
"""Optuna study user attribute holding ``StudyInfo.model_dump(mode="json")``."""
CONSTRAINT_NAMES = ("oom_or_crash", "slo", "stress")
"""Order of the constraint values stored with ``optuna.samplers._base._CONSTRAINTS_KEY``:
``oom_or_crash`` is 1.0 on any startup/runtime failure else -1.0; ``slo`` is the largest relative
SLO overshoot (``measured/target - 1``; ≤ 0 when met); ``stress`` is 1.0 when the stress phase
failed (OOM, errors, retraction storm) else -1.0."""


class Constraints(BaseModel):
    """THE feasibility rule: a trial is feasible when every constraint value is ≤ 0, and a
    constraint the trial never got to measure counts as violated (1.0).

    The values follow :data:`CONSTRAINT_NAMES` (Optuna's ``set_constraint`` names). Every place
    that decides feasibility (the trial's record, the study's tell, the readers' views, the
    offline benchmark's runner) goes through this class.

    Attributes:
        oom_or_crash: 1.0 on any startup or runtime failure, else -1.0.
        slo: The largest relative SLO overshoot (``measured/target - 1``; ≤ 0 when met).
        stress: 1.0 when the stress phase failed (OOM, errors, retraction storm), else -1.0.
    """

    model_config = ConfigDict(frozen=True)

    oom_or_crash: float = 1.0
    slo: float = 1.0
    stress: float = 1.0

    @classmethod
    def of(cls, values: Mapping[str, float]) -> Constraints:
        """The constraints in ``values`` (name → value); a name missing there is violated."""
        return cls(**{name: float(values[name]) for name in CONSTRAINT_NAMES if values.get(name) is not None})

    @classmethod
    def all_violated(cls) -> dict[str, float]:
        """Every constraint violated (1.0), by name: a trial that measured nothing."""
        return cls().values()

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
        cache: The prefix cache's tiers in the measured window (§7): ``hit_rate``,
            ``device_hit_rate``, ``host_hit_rate`` (``storage_hit_rate`` with a storage backend),
            all 0-1 of prompt tokens, ``hit_rate_source`` (``cached_tokens_details`` or
            ``/metrics``), and with the hierarchical cache ``host_pool_gb_per_rank``,
            ``host_pool_ranks``, ``host_pool_gb`` (decimal GB pinned on the host).
        measured_load: The load the server ran in the measured window: ``streams`` (closed-loop
            concurrency), ``running_requests`` (of them, at most the effective
            max_running_requests), ``chunk_tokens`` (tokens per prefill chunk); the planner's SLO
            model learns where the latency SLO breaks from it.
        repeat_of: The trial this one re-measures (same config, to measure the noise), or ``None``.
    """

    model_config = ConfigDict(extra="forbid")

    params: dict[str, Any] = Field(default_factory=dict)
    argv: list[str] = Field(default_factory=list)
    resolved: dict[str, dict[str, Any]] = Field(default_factory=dict)
    kind: Literal["baseline", "predicted", "sampled", "enqueued"] = "sampled"
    outcome: Literal["ok", "failed", "skipped", "budget"] = "ok"
    context_tokens: int | None = None
    context_capacity: int | None = None
    token_capacity: int | None = None
    free_gib_after_graphs: float | None = None
    output_throughput_tok_s: float | None = None
    goodput_req_s: float | None = None
    p99_ttft_ms: float | None = None
    p99_itl_ms: float | None = None
    measured_load: dict[str, float] = Field(default_factory=dict)
    repeat_of: int | None = None
    feasible: bool = False
    constraints: dict[str, float] = Field(default_factory=dict)
    failure_class: FailureClass | None = None
    failure_evidence: str | None = None
    skipped_reason: str | None = None
    proved_by_trial: int | None = None
    prediction: dict[str, Any] = Field(default_factory=dict)
    memory: dict[str, Any] = Field(default_factory=dict)
    cache: dict[str, Any] = Field(default_factory=dict)
    phases: list[PhaseResult] = Field(default_factory=list)
    artifacts: dict[str, str] = Field(default_factory=dict)
    log_excerpt: list[str] = Field(default_factory=list)
    started_at: str | None = None
    duration_s: float | None = None


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
