"""The read model of a stored study: where it is, its trials as views, its Pareto front and best.

The readers' side of :mod:`tuner.records`: everything here reads what :mod:`tuner.study` stored
(Optuna trials with the ``tuner.record`` user attribute, the study's ``tuner.study`` attribute) and
never writes to the study. Rendering lives in :mod:`tuner.report`; applying in :mod:`tuner.apply`.

Objectives are ``values = [context_capacity, output_throughput]`` (both maximized); a trial is
feasible when it is COMPLETE and every stored constraint is ≤ 0 (Optuna's rule,
:data:`tuner.records.CONSTRAINT_NAMES`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeVar

import optuna
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.engine import make_url

from tuner.config import ObjectiveSection, load_config
from tuner.errors import ConfigError, StudyError
from tuner.records import CONSTRAINT_NAMES, RECORD_ATTR, STUDY_ATTR, Constraints, StudyInfo, TrialRecord
from tuner.study.best import BestChoice, MetricDelta, admission_line, capacity_label, choose_best, stored_policy
from tuner.study.decide.rungs import lever_neutral, rung_flags
from tuner.study.hosts import REQUEUED_ATTR
from tuner.study.optuna_io import HOST_ATTR, KIND_ATTR
from tuner.study.storage import (
    STUDIES_DIR,
    default_artifacts_dir,
    default_storage_url,
    display_url,
    read_storage,
    stored_values,
    study_artifacts_dir,
    study_storage_url,
)

__all__ = [
    "status_text",
    "METRICS",
    "SORT_KEYS",
    "StudyLocation",
    "TrialView",
    "StoredStudy",
    "BestTrial",
    "CacheEffect",
    "cache_effect",
    "best_trial",
    "present_best",
    "best_notes",
    "resolve_location",
    "open_study",
    "select_trials",
    "storage_urls",
]

_M = TypeVar("_M", bound=BaseModel)

METRICS: Mapping[str, tuple[str, Literal["max", "min"]]] = MappingProxyType({
    "context_capacity": ("OOM-safe context capacity (requests)", "max"),
    "slo_context_capacity": ("SLO-safe context capacity (sessions)", "max"),
    "token_capacity": ("token capacity (tokens)", "max"),
    "output_throughput_tok_s": ("output throughput (tok/s)", "max"),
    "goodput_req_s": ("goodput (req/s)", "max"),
    "p99_ttft_ms": ("p99 TTFT (ms)", "min"),
    "p99_itl_ms": ("p99 ITL (ms)", "min"),
    "free_gib_after_graphs": ("free after CUDA graphs (GiB)", "min"),
})
"""The measured fields of a :class:`~tuner.records.TrialRecord` shown in tables and deltas:
field name → (label with unit, which direction is better)."""

SORT_KEYS: Mapping[str, str] = MappingProxyType({
    "number": "number",
    "capacity": "context_capacity",
    "context_capacity": "context_capacity",
    "slo_capacity": "slo_context_capacity",
    "slo_context_capacity": "slo_context_capacity",
    "tokens": "token_capacity",
    "token_capacity": "token_capacity",
    "throughput": "output_throughput_tok_s",
    "output_throughput_tok_s": "output_throughput_tok_s",
    "goodput": "goodput_req_s",
    "goodput_req_s": "goodput_req_s",
    "ttft": "p99_ttft_ms",
    "p99_ttft_ms": "p99_ttft_ms",
    "itl": "p99_itl_ms",
    "p99_itl_ms": "p99_itl_ms",
})
"""``tuner trials --sort`` keys (short aliases and field names) → :class:`TrialView` field."""


class StudyLocation(BaseModel):
    """Where a study lives.

    Attributes:
        storage_url: SQLAlchemy URL of the Optuna storage (``sqlite:///studies/demo.db``).
        study_name: The study's name; ``None`` means "the only study in that storage".
        artifacts_dir: The artifact folder when a config names it (``[storage] artifacts_dir``).
    """

    model_config = ConfigDict(frozen=True)

    storage_url: str
    study_name: str | None = None
    artifacts_dir: Path | None = None


def _location_from_config(config_path: Path, study: str | None) -> StudyLocation:
    """Read ``[study]``/``[storage]`` through :mod:`tuner.config` (the writer owns that schema)."""
    cfg = load_config(config_path)
    return StudyLocation(
        storage_url=study_storage_url(cfg),
        study_name=study or cfg.study.name,
        artifacts_dir=study_artifacts_dir(cfg) if cfg.storage.artifacts_dir else None,
    )


def resolve_location(
    *, study: str | None = None, storage: str | None = None, config: Path | None = None
) -> StudyLocation:
    """Resolve which study the history commands read.

    Order: an explicit ``--storage`` URL; else the ``--config`` file's ``[study]``/``[storage]``;
    else ``sqlite:///studies/<study>.db`` for ``--study``; else the only ``studies/*.db``.

    Args:
        study: ``--study NAME`` or ``None``.
        storage: ``--storage URL`` or ``None``.
        config: ``--config FILE`` or ``None``.

    Returns:
        The location; its ``study_name`` may be ``None`` (resolved by :func:`open_study`).

    Raises:
        StudyError: Nothing says which study, and ``studies/`` holds no single database.
        ConfigError: The config file is invalid (from :mod:`tuner.config`).
    """
    if storage:
        return StudyLocation(storage_url=storage, study_name=study)
    if config is not None:
        return _location_from_config(config, study)
    if study:
        return StudyLocation(storage_url=default_storage_url(study), study_name=study)
    candidates = sorted(STUDIES_DIR.glob("*.db")) if STUDIES_DIR.is_dir() else []
    if len(candidates) == 1:
        return StudyLocation(storage_url=f"sqlite:///{candidates[0]}")
    found = ", ".join(p.stem for p in candidates) or "none"
    raise StudyError(
        f"no study given and {STUDIES_DIR}/ holds {len(candidates)} study databases ({found})",
        hint="pass --study NAME, --storage URL or --config FILE",
    )


def storage_urls(*, storage: str | None = None, config: Path | None = None) -> list[str]:
    """The storages ``tuner studies`` lists: ``--storage``, else the ``--config`` file's, else
    every ``studies/*.db``.

    Raises:
        StudyError: Nothing given and ``studies/`` holds no database.
        ConfigError: The config file is invalid.
    """
    if storage:
        return [storage]
    if config is not None:
        return [study_storage_url(load_config(config))]
    found = sorted(STUDIES_DIR.glob("*.db")) if STUDIES_DIR.is_dir() else []
    if not found:
        raise StudyError(
            f"no study databases in {STUDIES_DIR}/",
            hint="pass --storage URL or --config FILE, or run `tuner run` first",
        )
    return [f"sqlite:///{path}" for path in found]


def _parsed(raw: Any, model: type[_M]) -> _M | None:
    """A stored JSON attribute as ``model``; ``None`` when absent or malformed (a reader lists
    what it can rather than failing on one bad attribute)."""
    if not isinstance(raw, dict):
        return None
    try:
        return model.model_validate(raw)
    except ValidationError:
        return None


def _constraint_name(key: str) -> str:
    """Optuna's list-format constraints come back keyed ``"0"``, ``"1"``...: name them."""
    if key.isdigit() and int(key) < len(CONSTRAINT_NAMES):
        return CONSTRAINT_NAMES[int(key)]
    return key


class TrialView(BaseModel):
    """One stored trial as the readers see it: Optuna's state and values plus the tuner's record.

    Attributes:
        number: Optuna trial number.
        state: Optuna state name (``COMPLETE``, ``PRUNED``, ``FAIL``, ``RUNNING``, ``WAITING``).
        values: ``[context_capacity, output_throughput_tok_s]`` when COMPLETE, else ``None``.
        constraints: Constraint name → value (feasible when ≤ 0), as Optuna stored them.
        feasible: COMPLETE, with values, and every constraint ≤ 0 (the record's own ``feasible``
            when no constraint was stored).
        params: The parameters by SGLang field name (the record's, else Optuna's).
        record: The parsed ``tuner.record`` attribute; ``None`` for a trial written by something
            else (it is still listed).
        started_at: ISO start time (the record's, else Optuna's ``datetime_start``).
        host: The host that ran the trial (:data:`tuner.study.hosts.HOST_ATTR`), ``None`` for a
            trial stored before hosts were recorded.
    """

    model_config = ConfigDict(frozen=True)

    number: int
    state: str
    values: list[float] | None = None
    constraints: dict[str, float] = Field(default_factory=dict)
    feasible: bool = False
    params: dict[str, Any] = Field(default_factory=dict)
    record: TrialRecord | None = None
    started_at: str | None = None
    host: str | None = None

    @classmethod
    def from_frozen(cls, trial: optuna.trial.FrozenTrial) -> TrialView:
        """Build a view from an Optuna trial; a malformed record is dropped, not fatal."""
        record = _parsed(trial.user_attrs.get(RECORD_ATTR), TrialRecord)
        constraints = {
            _constraint_name(str(k)): float(v) for k, v in trial.constraints.items()
        }
        complete = trial.state == optuna.trial.TrialState.COMPLETE and trial.values is not None
        if constraints:
            feasible = complete and Constraints.holds(constraints)
        else:
            feasible = complete and (record.feasible if record is not None else True)
        started = record.started_at if record and record.started_at else None
        if started is None and trial.datetime_start is not None:
            started = trial.datetime_start.isoformat(timespec="seconds")
        return cls(
            number=trial.number,
            state=trial.state.name,
            values=list(trial.values) if trial.values is not None else None,
            constraints=constraints,
            feasible=feasible,
            params=dict(record.params) if record and record.params else dict(trial.params),
            record=record,
            started_at=started,
            host=trial.user_attrs.get(HOST_ATTR),
        )

    def metric(self, name: str) -> Any:
        """A measured field of the record (see :data:`METRICS`), ``None`` when unknown.

        ``context_capacity`` and ``output_throughput_tok_s`` fall back to Optuna's values;
        ``slo_context_capacity`` is :attr:`tuner.records.SloCapacity.contexts` (``None`` where not
        measured).
        """
        if name == "slo_context_capacity":
            return self.record.slo_capacity.contexts if self.record is not None else None
        value = getattr(self.record, name, None) if self.record is not None else None
        if value is None and self.values is not None and self.state == "COMPLETE":
            if name == "context_capacity":
                value = round(self.values[0])  # Optuna stores the objective's count as a float
            elif name == "output_throughput_tok_s" and len(self.values) > 1:
                value = self.values[1]
        return value

    @property
    def kind(self) -> str | None:
        """``baseline`` / ``predicted`` / ``sampled`` / ``enqueued``, or ``None`` without a record."""
        return self.record.kind if self.record else None

    @property
    def outcome(self) -> str | None:
        """``ok`` / ``failed`` / ``skipped`` / ``budget``, or ``None`` without a record."""
        return self.record.outcome if self.record else None

    @property
    def failure_class(self) -> str | None:
        """The stored failure class value (``startup_kv_oom``, ...) or ``None``."""
        if self.record is None or self.record.failure_class is None:
            return None
        return self.record.failure_class.value

    @property
    def failed(self) -> bool:
        """True for a startup/runtime failure, an Optuna FAIL, or a proven-infeasible skip."""
        return (
            self.state == "FAIL"
            or self.outcome in ("failed", "skipped")
            or self.failure_class is not None
        )

    def row(self) -> dict[str, Any]:
        """A flat JSON-ready summary (``tuner trials --json``): number, state, kind, outcome,
        params, the :data:`METRICS` fields, feasible, failure_class, values, constraints (``None``
        for a skipped config: it was never launched, so nothing was violated), skipped_reason and
        proved_by_trial (why a config needed no restart, and the trial that shows it),
        started_at, host, quality (the quality gate's facts without the reference's answers, or
        ``None``); ``slo_capacity`` (:class:`tuner.records.SloCapacity` as stored, with
        ``stress_slo_met``, the stress load's verdict, and ``describe``), ``None`` without an SLO
        judged; ``objective_capacity``, the capacity Optuna's ``values[0]`` holds (the SLO-safe one
        where the study's objective used it)."""
        skipped = self.outcome == "skipped" or self.state == "PRUNED"
        record = self.record
        row: dict[str, Any] = {
            "number": self.number,
            "state": self.state,
            "kind": self.kind,
            "outcome": self.outcome,
            "params": self.params,
        }
        row.update({name: self.metric(name) for name in METRICS})
        row.update(
            feasible=self.feasible,
            failure_class=self.failure_class,
            values=self.values,
            constraints=None if skipped else self.constraints,
            skipped_reason=record.skipped_reason if record is not None else None,
            proved_by_trial=record.proved_by_trial if record is not None else None,
            slo_capacity=_slo_row(record),
            objective_capacity=record.objective_capacity if record is not None else None,
            started_at=self.started_at,
            host=self.host,
            quality=record.quality.stored() if record is not None and record.quality.status else None,
        )
        return row


def _slo_row(record: TrialRecord | None) -> dict[str, Any] | None:
    """The SLO-safe capacity as ``trials --json`` carries it, or ``None`` when no SLO was judged."""
    if record is None or not record.slo_capacity.limits:
        return None
    slo = record.slo_capacity
    stress = slo.stress
    return {**slo.model_dump(mode="json"), "stress_slo_met": stress.met if stress is not None else None,
            "describe": slo.describe()}


@dataclass(frozen=True)
class StoredStudy:
    """A study read from its storage, with every trial as a :class:`TrialView`.

    Attributes:
        location: Where it was read from (``study_name`` resolved).
        study: The loaded Optuna study (read it, never tell or enqueue through it).
        info: The ``tuner.study`` attribute, or ``None`` for a study the tuner did not write.
        trials: Every trial, by number.
    """

    location: StudyLocation
    study: optuna.Study
    info: StudyInfo | None
    trials: tuple[TrialView, ...]

    @property
    def name(self) -> str:
        """The study's name."""
        return self.study.study_name

    def rerun_of(self, number: int) -> int | None:
        """The trial that ran failed trial ``number``'s params again (queued by another host's
        reaper, :data:`tuner.study.hosts.REQUEUED_ATTR`, or by an interrupted run: the next
        ``enqueued`` trial with the same params), or ``None``."""
        frozen = self.study.get_trials(deepcopy=False)
        if number >= len(frozen):
            return None
        params = frozen[number].params
        for trial in frozen[number + 1:]:
            requeued = trial.user_attrs.get(REQUEUED_ATTR)
            if isinstance(requeued, dict) and requeued.get("trial") == number:
                return trial.number
            if requeued is None and trial.user_attrs.get(KIND_ATTR) == "enqueued" and params and trial.params == params:
                return trial.number
        return None

    def trial(self, number: int) -> TrialView:
        """The trial with this number.

        Raises:
            StudyError: No such trial in the study.
        """
        for view in self.trials:
            if view.number == number:
                return view
        last = self.trials[-1].number if self.trials else None
        span = f"trials 0-{last}" if last is not None else "no trials"
        raise StudyError(
            f"study {self.name!r} has no trial {number} ({span})",
            hint="list them with `tuner trials`",
        )

    def baseline(self) -> TrialView | None:
        """The trial of kind ``baseline`` (the unit's flags before the study) the study compares
        with: the newest one that measured, else the first one; ``None`` without any. A baseline
        that failed (a typo in the model path, fixed before the next run) is then not what the
        best is compared with once a later run measured the service's flags."""
        baselines = [v for v in self.trials if v.kind == "baseline"]
        measured = [v for v in baselines if v.outcome == "ok"]
        return measured[-1] if measured else (baselines[0] if baselines else None)

    def pareto_front(self) -> list[TrialView]:
        """Feasible trials on the Pareto front of (context capacity, throughput).

        Optuna's ``study.best_trials`` (which already keeps only trials whose constraints are all
        ≤ 0), restricted to :attr:`TrialView.feasible`; sorted by capacity, highest first.
        """
        numbers = {t.number for t in self.study.best_trials}
        front = [v for v in self.trials if v.number in numbers and v.feasible]
        return sorted(front, key=lambda v: (-(v.metric("context_capacity") or 0), v.number))

    def artifacts_dir(self) -> Path:
        """Where the study's ``FileSystemArtifactStore`` keeps files.

        The config's ``[storage] artifacts_dir`` when the study was located through a config;
        else, for an SQLite file, ``<db dir>/<study>/artifacts`` beside it (where the writer puts
        them, :func:`tuner.study.storage.study_artifacts_dir`) when that exists; else
        ``studies/<study>/artifacts`` of the working directory (a server database, and studies
        whose runs wrote there before artifacts followed ``--storage``).
        """
        if self.location.artifacts_dir is not None:
            return self.location.artifacts_dir
        default = default_artifacts_dir(self.name)
        url = make_url(self.location.storage_url)
        if url.get_backend_name() == "sqlite" and url.database:
            beside = Path(url.database).parent / self.name / "artifacts"
            if beside.is_dir():
                return beside
        return default

    def artifact_paths(self, view: TrialView) -> dict[str, Path]:
        """Artifact name → file path of one trial (paths may be missing if files were moved)."""
        if view.record is None:
            return {}
        base = self.artifacts_dir()
        return {name: base / artifact_id for name, artifact_id in view.record.artifacts.items()}


def status_text(view: TrialView) -> str:
    """Why a trial is not feasible, in words: its failure class, ``interrupted``, running, queued,
    stopped without a result, ``skipped``, or the violated constraints; ``""`` for a feasible one."""
    if view.failure_class:
        return view.failure_class
    if view.record is not None and (view.record.failure_evidence or "").startswith("interrupted"):
        return "interrupted"
    if view.state == "RUNNING":
        return "running, or killed (`tuner run` resumes it)"
    if view.state == "WAITING":
        return "queued (the next `tuner run` measures it)"
    if view.state == "FAIL" and view.record is None:
        return "stopped without a result (its run was killed or its host went silent; its params queued again)"
    if view.outcome == "skipped" or view.state == "PRUNED":
        reason = view.record.skipped_reason if view.record is not None else None
        return f"skipped: {reason}" if reason else "skipped"
    if view.feasible or view.state != "COMPLETE":
        return ""
    return ",".join(k for k, v in view.constraints.items() if v > 0) or "infeasible"


def open_study(location: StudyLocation) -> StoredStudy:
    """Load a study and all its trials, read-only.

    Raises:
        StudyError: The storage does not exist, cannot be read or holds a value that cannot be
            parsed (:func:`~tuner.study.storage.stored_values`); the study name is unknown; no
            name was given and the storage holds zero or several studies.
    """
    with stored_values(location.storage_url):
        return _load_study(location, read_storage(location.storage_url))


def _load_study(location: StudyLocation, storage: optuna.storages.BaseStorage) -> StoredStudy:
    names = [s.study_name for s in optuna.get_all_study_summaries(storage, False)]
    name = location.study_name
    if name is None:
        if len(names) != 1:
            raise StudyError(
                f"storage {display_url(location.storage_url)} holds {len(names)} studies "
                f"({', '.join(names) or 'none'})",
                hint="pick one with --study NAME (see `tuner studies`)",
            )
        name = names[0]
    elif name not in names:
        raise StudyError(
            f"storage {display_url(location.storage_url)} has no study {name!r} "
            f"(it has: {', '.join(names) or 'none'})",
            hint="check --study, or list them with `tuner studies`",
        )
    study = optuna.load_study(study_name=name, storage=storage)
    info = _parsed(study.user_attrs.get(STUDY_ATTR), StudyInfo)
    trials = tuple(TrialView.from_frozen(t) for t in study.get_trials(deepcopy=False))
    return StoredStudy(
        location=location.model_copy(update={"study_name": name}),
        study=study,
        info=info,
        trials=trials,
    )


def _sort_key(field: str) -> Any:
    better = METRICS.get(field, ("", "min"))[1]

    def key(view: TrialView) -> tuple[int, float, int]:
        value = view.number if field == "number" else view.metric(field)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return (1, 0.0, view.number)
        signed = -float(value) if better == "max" and field != "number" else float(value)
        return (0, signed, view.number)

    return key


def select_trials(
    trials: Iterable[TrialView],
    *,
    feasible: bool = False,
    failed: bool = False,
    sort: str | None = None,
) -> list[TrialView]:
    """Filter and sort trials for ``tuner trials``.

    Args:
        trials: The study's trials.
        feasible: Keep only feasible trials.
        failed: Keep only failed or proven-infeasible trials (see :attr:`TrialView.failed`).
        sort: A :data:`SORT_KEYS` key; "better" first (highest capacity/throughput, lowest
            latency), unknown values last; ``None`` keeps trial order.

    Raises:
        ConfigError: Unknown sort key, or both ``feasible`` and ``failed``.
    """
    if feasible and failed:
        raise ConfigError(
            "--feasible and --failed exclude each other", hint="pass at most one of them"
        )
    out = [v for v in trials if (not feasible or v.feasible) and (not failed or v.failed)]
    if sort is not None:
        field = SORT_KEYS.get(sort)
        if field is None:
            raise ConfigError(
                f"--sort {sort!r} is not a sort key",
                hint=f"use one of: {', '.join(sorted(SORT_KEYS))}",
            )
        out.sort(key=_sort_key(field))
    return out


_CACHE_KNOBS = ("enable_hierarchical_cache", "hicache_ratio", "hicache_size", "hicache_write_policy",
                "hicache_io_backend", "hicache_mem_layout")


class CacheEffect(BaseModel):
    """What the hierarchical cache bought one trial: hit rates by tier, the host pool it pinned,
    and TTFT / throughput against the same config without the cache (``shared/sglang-reference.md`` §7).

    Attributes:
        number: The trial.
        hicache: Whether it ran with the hierarchical cache.
        hit_rate, device_hit_rate, host_hit_rate, storage_hit_rate: Shares of prompt tokens (0-1).
        hit_rate_source: ``cached_tokens_details`` (per request) or ``/metrics`` (counters).
        host_pool_gb: Decimal GB pinned on the host (per rank × ranks), ``host_pool_ranks`` ranks.
        without: The measured trial with the same flags but no hierarchical cache, if any.
        p99_ttft_ms, output_throughput_tok_s: This trial's.
        without_p99_ttft_ms, without_output_throughput_tok_s: The counterpart's.
    """

    model_config = ConfigDict(frozen=True)

    number: int
    hicache: bool
    hit_rate: float | None = None
    device_hit_rate: float | None = None
    host_hit_rate: float | None = None
    storage_hit_rate: float | None = None
    hit_rate_source: str | None = None
    host_pool_gb: float | None = None
    host_pool_gb_per_rank: float | None = None
    host_pool_ranks: int | None = None
    p99_ttft_ms: float | None = None
    output_throughput_tok_s: float | None = None
    without: int | None = None
    without_p99_ttft_ms: float | None = None
    without_output_throughput_tok_s: float | None = None

    def describe(self) -> str:
        """One line: tiers, host pool, and the comparison (or why there is none)."""
        pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
        parts = [f"prefix-cache hits {pct(self.hit_rate)} of prompt tokens"]
        if self.host_hit_rate is not None:
            tiers = f"device {pct(self.device_hit_rate)}, host {pct(self.host_hit_rate)}"
            if self.storage_hit_rate is not None:
                tiers += f", storage {pct(self.storage_hit_rate)}"
            parts.append(f"({tiers}; from {self.hit_rate_source})")
        if self.hicache and self.host_pool_gb is not None:
            parts.append(f"; host pool {self.host_pool_gb_per_rank:g} GB × {self.host_pool_ranks} ranks = "
                         f"{self.host_pool_gb:g} GB pinned")
        if self.hicache:
            if self.without is None:
                parts.append("; no measured trial of the same flags without the cache to compare with")
            else:
                parts.append(f"; vs the same flags without it (trial {self.without}): p99 TTFT "
                             f"{_num(self.without_p99_ttft_ms)} → {_num(self.p99_ttft_ms)} ms, output "
                             f"{_num(self.without_output_throughput_tok_s)} → {_num(self.output_throughput_tok_s)} tok/s")
        return " ".join(parts).replace(" ;", ";")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def cache_effect(stored: StoredStudy, view: TrialView) -> CacheEffect | None:
    """The :class:`CacheEffect` of ``view``, or None when it recorded no cache facts."""
    rec = view.record
    if rec is None or not rec.cache.measured:
        return None
    on = bool(view.params.get("enable_hierarchical_cache"))
    counterpart: TrialView | None = None
    if on:
        mine = {k: v for k, v in view.params.items() if k not in _CACHE_KNOBS}
        for other in stored.trials:
            o = other.record
            if (other.number == view.number or o is None or o.outcome != "ok"
                    or other.params.get("enable_hierarchical_cache")):
                continue
            if {k: v for k, v in other.params.items() if k not in _CACHE_KNOBS} == mine:
                counterpart = other
    c = rec.cache
    return CacheEffect(
        number=view.number, hicache=on, hit_rate=c.hit_rate, device_hit_rate=c.device_hit_rate,
        host_hit_rate=c.host_hit_rate, storage_hit_rate=c.storage_hit_rate,
        hit_rate_source=c.hit_rate_source, host_pool_gb=c.host_pool_gb,
        host_pool_gb_per_rank=c.host_pool_gb_per_rank, host_pool_ranks=c.host_pool_ranks,
        p99_ttft_ms=rec.p99_ttft_ms, output_throughput_tok_s=rec.output_throughput_tok_s,
        without=counterpart.number if counterpart else None,
        without_p99_ttft_ms=counterpart.record.p99_ttft_ms if counterpart and counterpart.record else None,
        without_output_throughput_tok_s=(counterpart.record.output_throughput_tok_s
                                         if counterpart and counterpart.record else None),
    )


class BestTrial(BaseModel):
    """The chosen trial as the readers show it: the view, why it won, and its deltas vs the baseline.

    The choice itself is :func:`tuner.study.best.choose_best` (:attr:`choice`), the same one
    ``tuner run``'s summary carries.

    Attributes:
        trial: The chosen trial.
        front: The feasible Pareto front it was chosen from (highest capacity first).
        policy: The ``[objective]`` policy applied.
        reason: One sentence saying why this trial won.
        baseline: The baseline trial, if the study has one.
        deltas: :data:`METRICS` field → :class:`MetricDelta`.
    """

    model_config = ConfigDict(frozen=True)

    trial: TrialView
    front: list[TrialView]
    policy: ObjectiveSection
    reason: str
    baseline: TrialView | None = None
    deltas: dict[str, MetricDelta] = Field(default_factory=dict)
    choice: BestChoice | None = None
    cache: CacheEffect | None = None
    notes: list[str] = Field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """JSON-ready form (``tuner best --json``)."""
        return {
            "notes": self.notes,
            "cache": self.cache.model_dump() if self.cache else None,
            "trial": self.trial.row(),
            "reason": self.reason,
            "policy": self.policy.model_dump(),
            "front": [v.row() for v in self.front],
            "baseline": self.baseline.row() if self.baseline else None,
            "deltas": {k: d.model_dump() for k, d in self.deltas.items()},
        }


def _deltas(best: TrialView, baseline: TrialView | None) -> dict[str, MetricDelta]:
    out: dict[str, MetricDelta] = {}
    for name in METRICS:
        new = best.metric(name)
        old = baseline.metric(name) if baseline is not None else None
        delta = new - old if new is not None and old is not None else None
        ratio = new / old if new is not None and old not in (None, 0) else None
        out[name] = MetricDelta(baseline=old, best=new, delta=delta, ratio=ratio)
    return out


def best_trial(stored: StoredStudy, policy: ObjectiveSection | None = None) -> BestTrial:
    """Choose the best trial of a study under a policy.

    The choice itself is :func:`tuner.study.best.choose_best`, fed with every feasible trial (the
    pool ``tuner run`` chooses from; the capacity band of ``throughput_within_capacity`` may hold
    dominated trials, and its count in the reason counts them). ``tuner run``'s closing summary
    calls this function on the stored study, so both say the same.

    Args:
        stored: The study.
        policy: The ``[objective]`` policy; ``None`` reads the study's stored one.

    Returns:
        The choice, with the reason and the deltas against the baseline trial.

    Raises:
        StudyError: The study has no feasible trial, or its stored policy is invalid.
    """
    policy = policy or stored_policy(stored.info)
    pairs = [(v.number, v.record) for v in stored.trials if v.feasible and v.record is not None]
    choice = (
        choose_best(
            pairs,
            policy=policy.policy,
            capacity_tolerance=policy.capacity_tolerance,
            throughput_noise=policy.throughput_noise,
            capacity=policy.capacity,
        )
        if pairs
        else None
    )
    if choice is None:
        done = sum(1 for v in stored.trials if v.state == "COMPLETE")
        raise StudyError(
            f"study {stored.name!r} has no feasible trial ({len(stored.trials)} trials, "
            f"{done} complete, none met every constraint)",
            hint="see why with `tuner trials --failed`, then widen the config's space or relax its slo "
            "and run again",
        )
    return present_best(stored, choice, policy)


def best_notes(chosen: TrialView, baseline: TrialView | None, basis: str) -> list[str]:
    """What a reader of the choice must know beside its figures: which context capacity ranked it,
    the chosen trial's SLO-safe capacity with the stress load's SLO verdict, and whether baseline
    and best were measured at equal load (the measured window's streams)."""
    rec = chosen.record
    notes = [f"ranked by the {capacity_label(basis)}"]  # type: ignore[arg-type]
    if rec is not None and rec.slo_capacity.limits:
        notes.append(f"trial {chosen.number}: OOM-safe context capacity {cell_int(rec.context_capacity)}, "
                     f"SLO-safe {rec.slo_capacity.describe()}")
        admits = admission_line(rec)
        if admits is not None:
            notes.append(admits)
    base = baseline.record if baseline is not None else None
    if rec is not None and base is not None:
        old, new = base.measured_load.streams, rec.measured_load.streams
        if old is not None and new is not None and old != new:
            notes.append(f"throughput compared at unequal load: the baseline's window ran {old:g} streams, "
                         f"trial {chosen.number}'s {new:g} (each at the concurrency its pool admits)")
        elif old is not None and new is not None:
            notes.append(f"throughput compared at equal load ({new:g} streams in both measured windows)")
    return notes


def cell_int(value: int | None) -> str:
    """An integer figure or ``-``."""
    return "-" if value is None else str(value)


def present_best(stored: StoredStudy, choice: BestChoice, policy: ObjectiveSection) -> BestTrial:
    """The readers' form of a choice already made (``tuner run``'s :attr:`RunSummary.best`, or
    :func:`best_trial`'s): the chosen view, the feasible Pareto front (with the chosen trial in
    it: a choice among throughput ties may be one Optuna's front leaves out), deltas vs the
    baseline and :func:`best_notes`.

    Raises:
        StudyError: The chosen trial is not in ``stored``.
    """
    front = stored.pareto_front()
    chosen = stored.trial(choice.number)
    if all(v.number != chosen.number for v in front):
        front = sorted([*front, chosen], key=lambda v: (-(v.metric("context_capacity") or 0), v.number))
    baseline = stored.baseline()
    return BestTrial(
        choice=choice,
        trial=chosen,
        front=front,
        policy=policy,
        reason=f"trial {chosen.number}: {choice.reason} (policy {policy.policy})",
        baseline=baseline,
        deltas=_deltas(chosen, baseline),
        cache=cache_effect(stored, chosen),
        notes=[*best_notes(chosen, baseline, choice.basis), *lever_lines(stored.trials, chosen, baseline)],
    )


def _ratio(new: float | None, old: float | None) -> str:
    return f" ({new / old:.2f}×)" if new is not None and old else ""


def _lever_names(flags: Mapping[str, Any], base: Mapping[str, Any]) -> list[str]:
    """``kv_cache_dtype auto → fp8_e4m3`` for each lever ``flags`` moves from ``base`` (:func:`rung_flags`)."""
    words = {"enable_dp_attention": None, "dp_size": "dp_size (DP attention)"}
    out = []
    for key, neutral in lever_neutral().items():
        old, new = base.get(key, neutral), flags.get(key, neutral)
        if old != new:
            out.append(f"{words.get(key) or key} {old} → {new}")
    return out


def lever_lines(trials: Iterable[TrialView], chosen: TrialView, baseline: TrialView | None) -> list[str]:
    """What a trial's structural levers (fp8 KV, DCP, DP attention; issue 23) bought over the
    baseline and what they cost, for ``tuner show``, ``best`` and the report; ``[]`` when the trial
    runs the baseline's rung.

    Lines: the levers moved; the context capacity and tokens (per rank, across the deployment) vs
    the baseline's; per lever, the study's best feasible trial that moved that lever alone; the
    costs: output throughput and p99 ITL (decode speed) vs the baseline's, one request's ceiling
    (``per_request_max_tokens``: one DP rank's pool under DP attention), and the numerics with the
    quality gate's verdict.
    """
    if baseline is None or chosen.record is None or baseline.record is None:
        return []
    rec, base = chosen.record, baseline.record
    mine, theirs = rung_flags(rec.params), rung_flags(base.params)
    moved = _lever_names(mine, theirs)
    if not moved:
        return []
    ranks = int(mine.get("dcp_size", 1)) * int(mine.get("dp_size", 1))
    across = f", {rec.token_capacity * ranks:,} across {ranks} ranks" if rec.token_capacity and ranks > 1 else ""
    lines = [f"structural levers of trial {chosen.number} over the baseline (trial {baseline.number}): {', '.join(moved)}",
             f"  capacity: {cell_int(rec.context_capacity)} requests of {rec.context_tokens or '?'} tokens vs "
             f"{cell_int(base.context_capacity)}{_ratio(rec.context_capacity, base.context_capacity)}; tokens per rank "
             f"{cell_int(rec.token_capacity)} vs {cell_int(base.token_capacity)}{across}"]
    levers_of = {v.number: {n.split()[0] for n in _lever_names(rung_flags(v.record.params), theirs)}
                 for v in trials if v.feasible and v.record is not None}
    alone = []
    for name in moved:
        key = name.split()[0]
        single = [v for v in trials if levers_of.get(v.number) == {key}]
        top = max(single, key=lambda v: v.record.context_capacity or 0, default=None)  # type: ignore[union-attr]
        if top is not None and top.record is not None:
            alone.append(f"{key} alone {cell_int(top.record.context_capacity)} requests"
                         f"{_ratio(top.record.context_capacity, base.context_capacity)} (trial {top.number})")
        else:
            alone.append(f"{key} alone: not measured feasible")
    lines.append("  per lever: " + "; ".join(alone))
    quality = rec.quality
    numerics = (f"changes numerics ({', '.join(quality.changes)}): quality gate {quality.status}"
                if quality.changes else "numerics unchanged")
    lines.append(f"  costs: output throughput {_num(rec.output_throughput_tok_s)} vs {_num(base.output_throughput_tok_s)} "
                 f"tok/s{_ratio(rec.output_throughput_tok_s, base.output_throughput_tok_s)}, p99 ITL "
                 f"{_num(rec.p99_itl_ms)} vs {_num(base.p99_itl_ms)} ms{_ratio(rec.p99_itl_ms, base.p99_itl_ms)} "
                 f"(decode speed); one request's ceiling {cell_int(rec.per_request_max_tokens)} vs "
                 f"{cell_int(base.per_request_max_tokens)} tokens; {numerics}")
    return lines
