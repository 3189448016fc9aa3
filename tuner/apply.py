"""Applying a trial's config to the service: an explicit state machine with verify and rollback.

``tuner apply best|N`` persists a trial's tuned flags the systemd way, as a drop-in
``<unit>.d/80-tuner.conf`` (separate from the trial drop-in ``90-tuner-trial.conf``, which sorts
after it), restarts the unit, waits until it is ready, and verifies that the server holds what the
trial promised: the same token capacity (``max_total_num_tokens`` from the server, ± 1 %), the
tuned flags in ``/get_server_info``, and a short load check against the study's SLO. On any
failure it restores the previous drop-in (or its absence), restarts, waits healthy, and says what
failed. Every apply, undo and rollback is recorded in the study's storage (table
``tuner_applies``) and listed by ``tuner applies``; ``tuner apply --undo`` returns to the state
before the last verified apply.

The steps are states with allowed transitions (as httpx's ``ClientState``)::

    PLANNED ──► STARTED ──► READY ──► VERIFIED
       │           │          │
       │           └──────────┴──► ROLLING_BACK ──► ROLLED_BACK | ROLLBACK_FAILED
       └──► PRINTED   (process launcher: the command line is printed or written, nothing runs)

The restart is the systemd launcher's, driven through its public calls as a trial drives it
(:mod:`tuner.launch.base`): ``SystemdLauncher(dropin_name="80-tuner.conf")``, then inside
``launcher.session(restore_on_exit=False)`` (the unit's lock held throughout, the previous
drop-ins recorded in the unit's state file *before* the first change) ``launcher.start(argv,
dropin=planned_text)`` and the launcher's fail-fast ``wait``. A verified apply ends with
``launcher.commit()``; the rollback is the launcher's
:meth:`~tuner.launch.base.GuardedLauncher.restore` of the recorded state. A tuner killed mid-apply
leaves that state file, which ``tuner restore --unit`` puts back.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import shlex
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import SQLAlchemyError

from tuner.errors import ApplyError, TunerError
from tuner.launch.systemd import SystemdLauncher
from tuner.launch.unit import SystemdUnit, atomic_write_text
from tuner.records import now_iso
from tuner.results import StoredStudy, TrialView, status_text
from tuner.sglang.client import SGLangClient
from tuner.sglang.flags import FlagTable, parse_argv, replace_flags
from tuner.sglang.numerics import numerics_changes
from tuner.study.hosts import host_name
from tuner.study.launch import launch_changes, record_numerics
from tuner.study.storage import check_storage, display_url, is_shared_url

__all__ = [
    "PERSISTENT_DROPIN",
    "CAPACITY_TOLERANCE",
    "ApplyState",
    "Check",
    "LoadCheck",
    "ApplyPlan",
    "ApplyRecord",
    "ApplyLog",
    "plan_apply",
    "plan_undo",
    "execute",
    "service_settings",
    "gpu_monitor",
    "study_config",
    "load_check_for",
]

log = logging.getLogger(__name__)

PERSISTENT_DROPIN = "80-tuner.conf"
"""File name of the applied config's drop-in (sorts before the trial drop-in ``90-tuner-trial.conf``)."""
CAPACITY_TOLERANCE = 0.01
"""Allowed relative difference between the applied server's token capacity and the trial's."""
_SERVER_FLAGS = (
    "mem_fraction_static",
    "max_running_requests",
    "chunked_prefill_size",
    "enable_hierarchical_cache",
    "hicache_ratio",
)
"""Tuned fields that ``/get_server_info`` reports back (§5.2), checked after a restart."""


class ApplyState(str, Enum):
    """Where an apply (or undo) is; see the module docstring for the transitions."""

    PLANNED = "planned"
    STARTED = "started"
    READY = "ready"
    VERIFIED = "verified"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    ROLLBACK_FAILED = "rollback_failed"
    PRINTED = "printed"


_TRANSITIONS: Mapping[ApplyState, frozenset[ApplyState]] = MappingProxyType({
    ApplyState.PLANNED: frozenset({ApplyState.STARTED, ApplyState.PRINTED}),
    ApplyState.STARTED: frozenset({ApplyState.READY, ApplyState.ROLLING_BACK}),
    ApplyState.READY: frozenset({ApplyState.VERIFIED, ApplyState.ROLLING_BACK}),
    ApplyState.ROLLING_BACK: frozenset({ApplyState.ROLLED_BACK, ApplyState.ROLLBACK_FAILED}),
})


class Check(BaseModel):
    """One verification check.

    Attributes:
        name: ``ready``, ``restart``, ``token_capacity``, ``flags``, ``load``.
        ok: Whether it passed.
        detail: What was expected and observed, one line.
        expected: The expected number, when the check compares one (tokens for
            ``token_capacity``).
        observed: The observed number.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    ok: bool
    detail: str
    expected: float | None = None
    observed: float | None = None


class LoadCheck(BaseModel):
    """The short load check run after a restart.

    Attributes:
        workload: The study's workload spec (``[workload]``, a :data:`tuner.load.WorkloadSpec`).
        concurrency: Closed-loop concurrency.
        duration_s: Measured window, s.
        slo: The study's SLO (``[slo]``, :class:`tuner.load.SLO` as a dict).
        seed: Workload seed.
    """

    model_config = ConfigDict(frozen=True)

    workload: dict[str, Any]
    concurrency: int = Field(ge=1)
    duration_s: float = Field(gt=0)
    slo: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0

    def slo_text(self) -> str:
        """The SLO as ``p99 ttft ≤ 2000 ms, ...`` (``no SLO`` when empty)."""
        items = [
            f"{pct} {metric} ≤ {limit:g} ms"
            for metric in ("ttft", "itl", "tpot", "e2e_latency")
            for pct, limit in (self.slo.get(f"{metric}_ms") or {}).items()
        ]
        return ", ".join(items) or "no SLO"


class ApplyPlan(BaseModel):
    """What an apply or undo will do, decided before anything changes.

    Attributes:
        action: ``apply`` or ``undo``.
        study: Study name.
        trial: The trial applied (for an undo: the trial of the state returned to, if known).
        launcher: ``systemd`` or ``process``.
        target: The unit name, or the process launcher's command name.
        previous_argv: The command the service runs now.
        new_argv: The command it will run.
        previous_dropin: Current content of ``80-tuner.conf`` (``None``: absent).
        new_dropin: Content to write (``None``: remove the file).
        dropin_path: Where the drop-in lives (systemd).
        expected_token_capacity: Token capacity the server must report (``None``: not checked).
        expected_flags: Tuned field → value the server must report.
        load: The load check (``None``: none).
        undoes: For an undo: the id of the apply record being undone.
        settings: The launcher settings (the config's ``[service]``, ``state_dir``).
        admission_limit: The ``max_running_requests`` the apply carries instead of the trial's
            own, so that the applied config holds the SLO it was measured to hold
            (:func:`tuner.study.best.admission_limit`); ``None``: the trial's own admission.
    """

    model_config = ConfigDict(frozen=True)

    action: Literal["apply", "undo"] = "apply"
    study: str
    trial: int | None = None
    launcher: Literal["systemd", "process"]
    target: str
    previous_argv: list[str]
    new_argv: list[str]
    previous_dropin: str | None = None
    new_dropin: str | None = None
    dropin_path: str | None = None
    expected_token_capacity: int | None = None
    expected_flags: dict[str, Any] = Field(default_factory=dict)
    load: LoadCheck | None = None
    undoes: int | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    admission_limit: int | None = None

    def command_diff(self) -> str:
        """The command-line change, one flag (with its values) per line, as a unified diff."""
        diff = difflib.unified_diff(
            [f"{line}\n" for line in _flag_lines(self.previous_argv)],
            [f"{line}\n" for line in _flag_lines(self.new_argv)],
            "current command",
            "new command",
            n=0,
        )
        lines = []
        for i, line in enumerate(diff):
            if i < 2 or line.startswith("@@"):  # the ---/+++ file headers, the hunk headers
                continue
            lines.append(f"{line[0]} {line[1:]}")
        return "".join(lines) or "(no change)\n"

    def render(self, *, timeout_s: float) -> str:
        """The ``--dry-run`` text: what is written where, the command-line diff, and the checks."""
        what = f"trial {self.trial}" if self.action == "apply" else "undo"
        head = f"{what} of study {self.study!r} on {self.target} ({self.launcher} launcher)\n"
        if self.launcher == "process":
            return (
                f"{head}the process launcher runs no unit: the new command line is printed "
                f"(or written with --write FILE):\n{shlex.join(self.new_argv)}\n"
                f"command-line diff (- current, + new):\n{self.command_diff()}"
            )
        if self.new_dropin is None:
            body = f"would remove {self.dropin_path}\n"
        else:
            verb = "replace" if self.previous_dropin is not None else "create"
            body = f"would {verb} {self.dropin_path}:\n{self.new_dropin}"
        checks = [f"ready within {timeout_s:.0f} s"]
        if self.expected_token_capacity is not None:
            checks.append(
                f"token capacity {self.expected_token_capacity} ± {CAPACITY_TOLERANCE:.0%}"
            )
        if self.expected_flags:
            checks.append("server flags " + ", ".join(f"{k}={v}" for k, v in self.expected_flags.items()))
        if self.load is not None:
            checks.append(
                f"{self.load.duration_s:.0f} s load at concurrency {self.load.concurrency} "
                f"({self.load.slo_text()})"
            )
        return (
            f"{head}{body}"
            f"then: daemon-reload, restart {self.target}, verify: {'; '.join(checks)}; "
            "on any failure restore the previous drop-in and restart\n"
            f"command-line diff (- current, + new):\n{self.command_diff()}"
        )


def _flag_lines(argv: Sequence[str]) -> list[str]:
    """Group argv into lines: the program, then each ``--flag`` with its values."""
    lines: list[list[str]] = []
    for word in argv:
        if word.startswith("--") or not lines:
            lines.append([word])
        else:
            lines[-1].append(word)
    return [shlex.join(words) for words in lines]


class ApplyRecord(BaseModel):
    """One recorded apply, undo or rollback (a row of ``tuner_applies``).

    Attributes:
        id: Row id (``None`` before it is stored).
        at: ISO time (UTC) it finished.
        action: ``apply``, ``undo`` or ``rollback`` (the automatic rollback of a failed one).
        study, trial, target: What was applied where.
        outcome: The final :class:`ApplyState` value.
        previous_command, new_command: argv before and after.
        previous_dropin, new_dropin: ``80-tuner.conf`` before and after (``None``: absent).
        checks: The verification checks.
        message: One line on what happened.
        undoes: For an undo, the id of the apply it undid; for a rollback, the failed attempt's.
    """

    model_config = ConfigDict(frozen=True)

    id: int | None = None
    at: str
    action: Literal["apply", "undo", "rollback"]
    study: str
    trial: int | None
    target: str
    outcome: str
    previous_command: list[str]
    new_command: list[str]
    previous_dropin: str | None = None
    new_dropin: str | None = None
    checks: list[Check] = Field(default_factory=list)
    message: str = ""
    undoes: int | None = None


_METADATA = sa.MetaData()
_APPLIES = sa.Table(
    "tuner_applies",
    _METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", sa.String(40), nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("study", sa.String(512), nullable=False),
    sa.Column("trial", sa.Integer, nullable=True),
    sa.Column("target", sa.String(512), nullable=False),
    sa.Column("outcome", sa.String(32), nullable=False),
    sa.Column("previous_command", sa.Text, nullable=False),
    sa.Column("new_command", sa.Text, nullable=False),
    sa.Column("previous_dropin", sa.Text, nullable=True),
    sa.Column("new_dropin", sa.Text, nullable=True),
    sa.Column("checks", sa.Text, nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("undoes", sa.Integer, nullable=True),
)


class ApplyLog:
    """The record of applies in the study's storage database (table ``tuner_applies``).

    Args:
        storage_url: The Optuna storage URL; it must exist (see :func:`tuner.study.storage.check_storage`).

    Raises:
        StudyError: The storage does not exist.
    """

    def __init__(self, storage_url: str) -> None:
        check_storage(storage_url)
        self.storage_url = storage_url
        self._engine = sa.create_engine(storage_url)
        # A study shared by many hosts: every host's unit has the same name, so its records (and
        # its undo stack) are this host's own: the target is stored as "<host>/<unit>".
        self._prefix = f"{host_name()}/" if is_shared_url(storage_url) else ""

    def close(self) -> None:
        """Release the database connections."""
        self._engine.dispose()

    def check_writable(self) -> None:
        """Refuse, before the service changes, a storage the apply could not be recorded in: a write
        that changes nothing (the table made on first use, a DELETE of no row), rolled back.

        Raises:
            ApplyError: The database refused it (a read-only file, folder or mount, no privilege).
        """
        try:
            _METADATA.create_all(self._engine, tables=[_APPLIES])
            with self._engine.connect() as conn, conn.begin() as txn:
                conn.execute(_APPLIES.delete().where(sa.false()))
                txn.rollback()
        except SQLAlchemyError as err:
            raise ApplyError(
                f"the apply could not be recorded in {display_url(self.storage_url)}: "
                f"{' '.join(str(getattr(err, 'orig', err)).split())}; nothing was changed",
                hint="make the study database writable (ls -l, lsattr, mount) and run again",
            ) from err

    def add(self, record: ApplyRecord) -> ApplyRecord:
        """Store a record (creating the table on first use); returns it with its id.

        Raises:
            ApplyError: The database refused the write.
        """
        row = record.model_dump(exclude={"id"})
        if self._prefix and not row["target"].startswith(self._prefix):
            row["target"] = self._prefix + row["target"]
        row["previous_command"] = json.dumps(record.previous_command)
        row["new_command"] = json.dumps(record.new_command)
        row["checks"] = json.dumps([c.model_dump() for c in record.checks])
        try:
            _METADATA.create_all(self._engine, tables=[_APPLIES])
            with self._engine.begin() as conn:
                inserted = conn.execute(_APPLIES.insert().values(**row)).inserted_primary_key
                assert inserted is not None  # an INSERT of one row returns its key
                new_id = inserted[0]
        except SQLAlchemyError as err:
            raise ApplyError(
                f"cannot record the apply in {display_url(self.storage_url)}: {str(err).splitlines()[0]}",
                hint="check that the study database is writable",
            ) from err
        return record.model_copy(update={"id": int(new_id), "target": row["target"]})

    def records(self, *, target: str | None = None) -> list[ApplyRecord]:
        """Every record, oldest first (only ``target``'s on this host when given); empty when none yet."""
        if not sa.inspect(self._engine).has_table("tuner_applies"):
            return []
        query = sa.select(_APPLIES).order_by(_APPLIES.c.id)
        if target is not None:
            query = query.where(_APPLIES.c.target == self._prefix + target)
        with self._engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        out = []
        for row in rows:
            data = dict(row)
            data["previous_command"] = json.loads(data["previous_command"])
            data["new_command"] = json.loads(data["new_command"])
            data["checks"] = json.loads(data["checks"])
            out.append(ApplyRecord.model_validate(data))
        return out

    def applied_stack(self, target: str) -> list[ApplyRecord]:
        """The verified applies on ``target`` that no later undo took back, oldest first."""
        stack: list[ApplyRecord] = []
        for rec in self.records(target=target):
            if rec.outcome != ApplyState.VERIFIED.value:
                continue
            if rec.action == "apply":
                stack.append(rec)
            elif rec.action == "undo":
                stack = [r for r in stack if r.id != rec.undoes]
        return stack


def _build(settings: Mapping[str, Any], gpu: Any | None = None) -> Any:
    from tuner.launch.factory import build_launcher  # composition root of launchers

    return build_launcher(settings, gpu=gpu)


def gpu_monitor(config: Any) -> Any | None:
    """The GPU monitor ``tuner run`` uses for this config (``None`` when none is available): before
    the restart the old server's GPU memory must be released, or SGLang's baseline, and so the
    token capacity being verified, shrinks (§1.2)."""
    from tuner.entrypoints import resolve_gpu_monitor  # the run's own choice (nvml, the simulator's ledger, none)

    return resolve_gpu_monitor(config)


def study_config(stored: StoredStudy, config: Path | None = None) -> Any:
    """The study's config: ``--config``, else the file the study recorded (:attr:`StudyInfo.config_path`).

    Raises:
        ApplyError: Neither names an existing file.
        ConfigError: The file is invalid.
    """
    from tuner.config import load_config

    recorded = stored.info.config_path if stored.info else None
    path = config or (Path(recorded) if recorded else None)
    if path is None or not Path(path).is_file():
        where = f"it recorded {recorded}, which does not exist" if recorded else "it records none"
        raise ApplyError(
            f"tuner apply needs study {stored.name!r}'s config (its service, workload and slo "
            f"sections); {where}",
            hint="pass --config FILE",
        )
    return load_config(path)


def service_settings(config: Any, *, state_dir: Path | None = None) -> dict[str, Any]:
    """Launcher settings from a config's ``[service]`` (plus ``state_dir`` when given).

    Args:
        config: A :class:`tuner.config.TunerConfig`.
        state_dir: Folder of state files (default: the launcher's).
    """
    settings = config.service.model_dump(mode="json")
    if state_dir is not None:
        settings["state_dir"] = str(state_dir)
    return settings


def load_check_for(config: Any, view: TrialView, *, duration_s: float, admission_limit: int | None = None) -> LoadCheck:
    """The load check of an apply: the study's workload and SLO at the trial's concurrency.

    The concurrency is ``[budget] concurrency`` when set, else the concurrency the trial's
    measured window achieved (rounded up), else its context capacity; at most
    ``[budget] max_concurrency``, and at most ``admission_limit`` where the apply carries one (the
    sessions the applied config promises the SLO for; more would queue in SGLang's scheduler and
    wait, by design, past the TTFT limit).

    Args:
        config: The study's :class:`tuner.config.TunerConfig`.
        view: The trial applied.
        duration_s: Measured window of the check, s.
        admission_limit: The apply's :attr:`ApplyPlan.admission_limit`, or ``None``.
    """
    budget = config.budget
    concurrency = budget.concurrency
    if not concurrency and view.record is not None:
        measured = next((p for p in view.record.phases if p.name == "measure"), None)
        achieved = measured.metrics.get("concurrency") if measured else None
        if achieved:
            concurrency = math.ceil(achieved - 1e-6)
    if not concurrency:
        concurrency = int(view.metric("context_capacity") or 1)
    cap = min(getattr(budget, "max_concurrency", concurrency), admission_limit or concurrency)
    return LoadCheck(
        workload=config.workload.model_dump(mode="json"),
        concurrency=max(1, min(int(concurrency), cap)),
        duration_s=duration_s,
        slo=config.slo.model_dump(mode="json") if hasattr(config.slo, "model_dump") else {},
        seed=config.study.seed,
    )


def _expected_capacity(view: TrialView) -> int | None:
    rec = view.record
    if rec is None:
        return None
    if rec.token_capacity is not None:
        return int(rec.token_capacity)
    value = rec.resolved.get("max_total_num_tokens", {}).get("value")
    return int(value) if value is not None else None


def _new_argv(stored: StoredStudy, view: TrialView, argv: list[str], table: FlagTable,
              overrides: Mapping[str, Any] | None = None) -> list[str]:
    """The service's command with the trial's tuned flags (``overrides`` replacing the trial's
    values: the admission limit the apply carries, :attr:`ApplyPlan.admission_limit`).

    Every field the study tuned (the params of its non-baseline trials; the baseline's record
    also lists flags it merely resolved) is set to this trial's value, or removed (``None``) when
    it is a conditional field this trial lacks, e.g. ``hicache_ratio`` with the hierarchical cache
    off. A flag whose current value already equals the trial's is left as written, and so is a
    flag the command leaves unset whose value SGLang resolved to the trial's for the baseline (a
    default: pinning it would change nothing now and freeze today's default across an upgrade;
    operator review 2, R9).
    """
    tuned = [v for v in stored.trials if v.kind != "baseline"] or list(stored.trials)
    overrides = dict(overrides or {})
    names = sorted({name for v in tuned for name in v.params} | set(overrides))
    params = {**view.params, **overrides}
    current = parse_argv(argv, table)
    baseline = stored.baseline()
    defaults = baseline.params if baseline is not None else {}
    changes = {}
    for name in names:
        value = params.get(name)
        now = current.get(table.canonical(table.option(name).dest))
        if (value is None and now is None) or (value is not None and now is not None and _same(now, value)):
            continue
        if now is None and value is not None and name in defaults and _same(defaults[name], value):
            continue
        changes[name] = value
    return replace_flags(argv, launch_changes(changes, current), table) if changes else list(argv)


def unprobed_numerics(stored: StoredStudy, view: TrialView) -> tuple[list[str], str] | None:
    """The numerics-relevant flags a trial changes without a quality probe that passed, and why
    (:mod:`tuner.load.quality`), or ``None`` when it is safe on that count: the baseline's
    numerics, or a passed gate. Both keys are rebuilt from the stored launches
    (:func:`tuner.study.launch.record_numerics`): a trial stored before the key was resolved, that
    named the shape SGLang chose for the baseline, is the baseline's numerics. A record stored
    before the gate is read from its command line against the study's baseline command
    (:func:`tuner.sglang.numerics.numerics_changes`)."""
    record = view.record
    if record is None:
        return None
    facts = record.quality
    if facts.status in ("reference", "same", "passed"):
        return None
    base_view = stored.baseline()
    baseline = base_view.record if base_view is not None else None
    if facts.status is not None and baseline is not None and baseline.quality.status is not None and (
            record_numerics(record) == record_numerics(baseline)):
        return None
    if facts.status is None:
        info = stored.info
        if info is None or not info.baseline_argv or not record.argv:
            return None
        table = FlagTable.for_version(str(info.environment.get("sglang_version") or "0.5.5"))
        changes = numerics_changes(parse_argv(record.argv, table), parse_argv(info.baseline_argv, table))
        return (changes, "stored before the quality gate") if changes else None
    return facts.changes, facts.reason or f"quality gate {facts.status}"


def _flag_table(stored: StoredStudy, config: Any, argv: list[str]) -> FlagTable:
    """The run's flag table (:func:`tuner.entrypoints.resolve_flag_table`), or the SGLang version the study
    recorded when the config names none."""
    from tuner.entrypoints import resolve_flag_table

    recorded = (stored.info.environment if stored.info else {}).get("sglang_version")
    if recorded and not (config.service.sglang_version or config.service.python):
        return FlagTable.for_version(str(recorded))
    return resolve_flag_table(config, argv)


def plan_apply(
    stored: StoredStudy,
    view: TrialView,
    config: Any,
    *,
    state_dir: Path | None = None,
    load: LoadCheck | None = None,
    admission_limit: int | None = None,
) -> ApplyPlan:
    """Decide what applying ``view`` changes; reads the service, changes nothing.

    The new command is the service's current command with the trial's tuned flags replaced
    (:func:`tuner.sglang.flags.replace_flags`), so flags the operator set outside the study stay.
    With ``admission_limit`` (:func:`tuner.study.best.admission_limit`: the trial admits more
    longest contexts than the sessions that held the SLO) it carries ``--max-running-requests
    admission_limit`` instead of the trial's own, and the server must report it back.

    Args:
        stored: The study.
        view: The trial to apply; it must be feasible and carry its record.
        config: The study's :class:`tuner.config.TunerConfig` (its ``[service]``).
        state_dir: Folder of state files (default: the config's, else the launcher's).
        load: The load check to run after the restart, or ``None``.
        admission_limit: The ``max_running_requests`` to carry instead of the trial's, or ``None``.

    Returns:
        The plan.

    Raises:
        ApplyError: The trial is not feasible or has no record; the SGLang version is unknown.
        LaunchError: The unit or its command cannot be read.
        FlagError: A tuned field the SGLang version lacks.
    """
    if view.record is None or not view.params:
        raise ApplyError(
            f"trial {view.number} has no tuner record to apply",
            hint="pick a trial that `tuner trials` lists with params",
        )
    if not view.feasible:
        why = status_text(view) or "infeasible"
        raise ApplyError(
            f"trial {view.number} is not feasible ({why}); applying it would not be safe",
            hint="apply a feasible trial: see `tuner best` or `tuner trials --feasible`",
        )
    unprobed = unprobed_numerics(stored, view)
    if unprobed is not None:
        changes, why = unprobed
        path = getattr(config, "path", None) or "FILE"
        raise ApplyError(
            f"trial {view.number} changes numerics ({', '.join(changes)}) and its answers were never compared with "
            f"the baseline's ({why}); applying it could change what the model answers",
            hint=f"probe it: run the study with [quality] enabled = true (`tuner run --config {path}`): its first "
                 "launches record the baseline's reference answers and probe this config (`tuner run --dry-run` says "
                 "so); then apply the trial that probed it, or one that passed the quality gate (`tuner trials` shows it)",
        )
    settings = service_settings(config, state_dir=state_dir)
    overrides = {"max_running_requests": admission_limit} if admission_limit else {}
    params = {**view.params, **overrides}
    expected_flags = {k: params[k] for k in _SERVER_FLAGS if params.get(k) is not None}
    launcher = _build(settings)
    common: dict[str, Any] = dict(
        study=stored.name,
        trial=view.number,
        expected_token_capacity=_expected_capacity(view),
        expected_flags=expected_flags,
        load=load,
        settings=settings,
        admission_limit=admission_limit or None,
    )
    if not isinstance(launcher, SystemdLauncher):
        current = launcher.current_argv()
        return ApplyPlan(
            launcher="process",
            target=launcher.key,
            previous_argv=current,
            new_argv=_new_argv(stored, view, current, _flag_table(stored, config, current), overrides),
            **common,
        )
    unit = launcher.unit
    studied = (stored.info.target if stored.info else {}).get("unit")
    if studied and SystemdUnit(studied).name != unit.name:
        raise ApplyError(
            f"study {stored.name!r} tuned unit {studied}, but the config's service is {unit.name}",
            hint="pass the config the study was run with (--config FILE)",
        )
    command = unit.exec_command()
    new_argv = _new_argv(stored, view, command.argv, _flag_table(stored, config, command.argv), overrides)
    header = (
        f"Written by `tuner apply`: study {stored.name}, trial {view.number}, {now_iso()}.\n"
        "Undo with `tuner apply --undo`; see `tuner applies`."
    )
    return ApplyPlan(
        launcher="systemd",
        target=unit.name,
        previous_argv=command.argv,
        new_argv=new_argv,
        previous_dropin=unit.read_dropin(PERSISTENT_DROPIN),
        new_dropin=unit.exec_start_dropin(new_argv, prefix=command.prefix, header=header),
        dropin_path=str(unit.dropin_folder / PERSISTENT_DROPIN),
        **common,
    )


def plan_undo(
    stored: StoredStudy, config: Any, log_: ApplyLog, *, state_dir: Path | None = None
) -> ApplyPlan:
    """Plan the return to the state before the last verified apply on the service's unit.

    Args:
        stored: The study whose storage holds the apply records.
        config: The study's :class:`tuner.config.TunerConfig` (its ``[service]``).
        log_: The apply records.
        state_dir: Folder of state files.

    Raises:
        ApplyError: Nothing to undo, the launcher is not systemd, or ``80-tuner.conf`` was
            changed by hand since that apply.
    """
    settings = service_settings(config, state_dir=state_dir)
    launcher = _build(settings)
    if not isinstance(launcher, SystemdLauncher):
        raise ApplyError(
            "tuner apply --undo needs the systemd launcher",
            hint="with the process launcher, run the previous command line yourself",
        )
    unit = launcher.unit
    stack = log_.applied_stack(unit.name)
    if not stack:
        raise ApplyError(
            f"no verified apply on {unit.name} to undo (see `tuner applies`)",
            hint="nothing was applied, or every apply was already undone",
        )
    top = stack[-1]
    current = unit.read_dropin(PERSISTENT_DROPIN)
    if current != top.new_dropin:
        raise ApplyError(
            f"{unit.dropin_folder / PERSISTENT_DROPIN} changed since apply #{top.id}",
            hint="restore it by hand or apply a trial again; undo only returns to recorded states",
        )
    below = stack[-2] if len(stack) > 1 and stack[-2].new_dropin == top.previous_dropin else None
    expected = None
    if below is not None:
        expected = next(
            (int(c.observed) for c in below.checks
             if c.name == "token_capacity" and c.ok and c.observed is not None),
            None,
        )
    command = unit.exec_command()
    return ApplyPlan(
        action="undo",
        study=stored.name,
        trial=below.trial if below else None,
        launcher="systemd",
        target=unit.name,
        previous_argv=command.argv,
        new_argv=top.previous_command,
        previous_dropin=current,
        new_dropin=top.previous_dropin,
        dropin_path=str(unit.dropin_folder / PERSISTENT_DROPIN),
        expected_token_capacity=expected,
        undoes=top.id,
        settings=settings,
    )


class _Run:
    """One execution of a plan: the state machine, its checks, and its records."""

    def __init__(self, plan: ApplyPlan, log_: ApplyLog) -> None:
        self.plan = plan
        self.log = log_
        self.state = ApplyState.PLANNED
        self.checks: list[Check] = []

    def advance(self, new: ApplyState) -> None:
        if new not in _TRANSITIONS.get(self.state, frozenset()):
            raise RuntimeError(f"apply state {self.state.value} cannot go to {new.value}")
        log.info("apply %s: %s -> %s", self.plan.target, self.state.value, new.value)
        self.state = new

    def record(self, action: str, message: str, **extra: Any) -> ApplyRecord:
        plan = self.plan
        fields: dict[str, Any] = dict(
            at=now_iso(),
            action=action,
            study=plan.study,
            trial=plan.trial,
            target=plan.target,
            outcome=self.state.value,
            previous_command=plan.previous_argv,
            new_command=plan.new_argv,
            previous_dropin=plan.previous_dropin,
            new_dropin=plan.new_dropin,
            checks=self.checks,
            message=message,
            undoes=plan.undoes,
        )
        fields.update(extra)
        return self.log.add(ApplyRecord(**fields))


def _verify(plan: ApplyPlan, url: str) -> list[Check]:
    """The post-restart checks: token capacity, the tuned flags, the load check."""
    checks: list[Check] = []
    with SGLangClient(url, timeout_s=10.0) as client:
        info = client.server_info()
    if plan.expected_token_capacity is not None:
        got, want = info.max_total_num_tokens, plan.expected_token_capacity
        ok = got is not None and abs(got - want) <= CAPACITY_TOLERANCE * want
        change = f" ({(got - want) / want:+.1%})" if got is not None and want else ""
        checks.append(
            Check(
                name="token_capacity",
                ok=ok,
                detail=f"observed {got} tokens, expected {want}{change}; allowed ±{CAPACITY_TOLERANCE:.0%}",
                expected=want,
                observed=got,
            )
        )
    wrong = []
    for field, want in plan.expected_flags.items():
        got = getattr(info, field, None)
        if got is not None and not _same(got, want):
            wrong.append(f"{field}={got} (want {want})")
    if plan.expected_flags:
        checks.append(
            Check(
                name="flags",
                ok=not wrong,
                detail="; ".join(wrong) or "server reports "
                + ", ".join(f"{k}={getattr(info, k, None)}" for k in plan.expected_flags),
            )
        )
    if plan.load is not None and all(c.ok for c in checks):
        checks.append(_load_check(plan.load, url))
    return checks


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return bool(got) == bool(want)
    try:
        return abs(float(got) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
    except (TypeError, ValueError):
        return str(got) == str(want)


def _load_check(load: LoadCheck, url: str) -> Check:
    from pydantic import TypeAdapter

    from tuner.load import SLO, WorkloadSpec, build_workload, run_load_sync

    spec = TypeAdapter(WorkloadSpec).validate_python(load.workload)
    slo = SLO.model_validate(load.slo) if load.slo else None
    try:
        result = run_load_sync(
            url,
            build_workload(spec, seed=load.seed),
            concurrency=load.concurrency,
            duration_s=load.duration_s,
            slo=slo,
            timeout_s=load.duration_s * 4 + 120.0,
        )
    except TunerError as err:
        return Check(name="load", ok=False, detail=f"load check could not run: {err}")
    s = result.summary
    problems = []
    if s.completed == 0:
        problems.append("no request completed")
    if s.errored or result.partial:
        problems.append(f"{s.errored} errored, partial={result.partial}")
    if s.slo_met is False:
        over = ", ".join(f"{k}={v}" for k, v in s.slo_violations.items())
        problems.append(f"SLO missed ({over})")
    detail = (
        f"{s.completed} requests at concurrency {load.concurrency} in {s.duration:.0f} s: "
        f"p99 TTFT {s.p99_ttft_ms or 0:.0f} ms, p99 ITL {s.p99_itl_ms or 0:.1f} ms, "
        f"{s.output_throughput:.0f} tok/s"
    )
    return Check(name="load", ok=not problems, detail="; ".join(problems + [detail]))


def execute(
    plan: ApplyPlan,
    log_: ApplyLog,
    *,
    timeout_s: float = 900.0,
    write: Path | None = None,
    gpu: Any | None = None,
) -> ApplyRecord:
    """Carry out a plan: write, restart, wait, verify; roll back on any failure. Records it.

    With the process launcher nothing runs: the command line is returned in the record (and
    written to ``write`` when given).

    Args:
        plan: From :func:`plan_apply` or :func:`plan_undo`.
        log_: Where the apply (and a rollback) is recorded.
        timeout_s: Limit for the server to become ready (apply and rollback each).
        write: Process launcher: file to write the command line to.
        gpu: A :class:`tuner.gpu.GPUMonitor` (:func:`gpu_monitor`): each start waits until the
            stopped server's GPU memory is released.

    Returns:
        The record of a verified apply (or of the printed command).

    Raises:
        ApplyError: Verification failed and the previous config was restored (the message says
            what failed), or the rollback failed too (the state file is kept for ``tuner
            restore``).
        LockHeldError: Another tuner holds the unit.
        LaunchError: The service could not be read before any change, or a killed run left its
            state file or its trial drop-in (``tuner restore --unit`` first); nothing changed.

    .. note:: Changes the production service.
    """
    run = _Run(plan, log_)
    if plan.launcher == "process":
        run.advance(ApplyState.PRINTED)
        if write is not None:
            try:
                atomic_write_text(Path(write), shlex.join(plan.new_argv) + "\n")
            except OSError as err:
                raise ApplyError(
                    f"cannot write {write}: {err.strerror}", hint="pass a writable --write FILE"
                ) from err
        where = f"written to {write}" if write else "printed"
        return run.record(plan.action, f"process launcher: new command line {where}")
    launcher = _build({**plan.settings, "dropin_name": PERSISTENT_DROPIN}, gpu)
    # the launcher's session: lock, then the state file before the first change; it refuses a
    # state file or a trial drop-in a killed run left; it restores nothing on exit (_switch
    # commits or rolls back), and a kill before either leaves the state file for `tuner restore`
    with launcher.session(restore_on_exit=False):
        if launcher.current_argv() != plan.previous_argv:
            raise ApplyError(
                f"{plan.target}'s command changed since the plan was made",
                hint="run `tuner apply` again",
            )
        return _switch(run, launcher, timeout_s)


def _switch(run: _Run, launcher: SystemdLauncher, timeout_s: float) -> ApplyRecord:
    """STARTED → READY → VERIFIED, or ROLLING_BACK → ROLLED_BACK / ROLLBACK_FAILED."""
    plan = run.plan
    failure = ""
    try:
        run.advance(ApplyState.STARTED)
        launcher.start(plan.new_argv, dropin=plan.new_dropin)
        st = launcher.wait(timeout_s)
        if st.phase.value != "ready":
            why = f"{st.failure.failure_class.value}: {st.failure.evidence}" if st.failure else st.phase.value
            run.checks.append(Check(name="ready", ok=False, detail=why))
            failure = f"the server did not become ready ({why})"
        else:
            run.advance(ApplyState.READY)
            run.checks.append(Check(name="ready", ok=True, detail=f"ready after {st.elapsed_s:.0f} s"))
            run.checks.extend(_verify(plan, launcher.url))
            bad = [c for c in run.checks if not c.ok]
            if bad:
                failure = "; ".join(f"{c.name}: {c.detail}" for c in bad)
    except TunerError as err:
        failure = str(err)
        run.checks.append(Check(name="restart", ok=False, detail=failure))
    if not failure:
        run.advance(ApplyState.VERIFIED)
        launcher.commit()
        what = f"trial {plan.trial}" if plan.action == "apply" else f"undo of apply #{plan.undoes}"
        return run.record(plan.action, f"{what} applied and verified on {plan.target}")
    run.advance(ApplyState.ROLLING_BACK)
    rollback_error: TunerError | None = None
    try:
        launcher.restore(timeout_s=timeout_s)
        run.advance(ApplyState.ROLLED_BACK)
    except TunerError as err:
        rollback_error = err
        run.advance(ApplyState.ROLLBACK_FAILED)
    attempt = run.record(plan.action, f"verification failed: {failure}")
    run.record(
        "rollback",
        f"rollback failed: {rollback_error}" if rollback_error else "previous config restored and healthy",
        undoes=attempt.id,
        previous_command=plan.new_argv,
        new_command=plan.previous_argv,
        previous_dropin=plan.new_dropin,
        new_dropin=plan.previous_dropin,
        checks=[],
    )
    if rollback_error is not None:
        raise ApplyError(
            f"{plan.action} on {plan.target} failed ({failure}) and the rollback failed too: "
            f"{rollback_error}",
            hint=f"the state file {launcher.store.path} is kept: fix the unit, then "
            f"`tuner restore --unit {plan.target}`",
        ) from rollback_error
    raise ApplyError(
        f"{plan.action} on {plan.target} rolled back: {failure}",
        hint="the previous config is running again and healthy; see `tuner applies`",
    )
