"""``tuner upgrade-check``: what another SGLang installation does to the current best config.

Before an operator switches SGLang, the check reads the other installation's flag table (SGLang's
own parser in its Python, :meth:`tuner.sglang.flags.FlagTable.from_python`, or a bundled table for
a version, :meth:`~tuner.sglang.flags.FlagTable.for_version`; the simulator stands in for versions
with ``--sim-version``) and reports, for the study's best config (:func:`tuner.results.best_trial`):

- **renamed**: a flag the command sets whose spelling the new version does not accept, but whose
  knob it has under another name (``--cuda-graph-max-bs`` → ``--cuda-graph-max-bs-decode`` in
  0.5.23, ``shared/sglang-reference.md`` §3.2); the new command is rendered with it;
- **removed**: a flag the command sets that the new version has no knob for (the command would
  not start: argparse exits 2);
- **deprecated**: a flag the new version still accepts but marks deprecated;
- **default**: a memory-relevant knob the command leaves at SGLang's default (the searched knobs,
  the layout and structural flags of :mod:`tuner.study.fingerprint`) whose default changed.

Beside them it prints the deployment's fingerprint (:mod:`tuner.study.fingerprint`): what a boot
of the new version is compared with. Nothing is persisted.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tuner.config import TunerConfig
from tuner.errors import ConfigError, FlagError
from tuner.results import StoredStudy, TrialView, best_trial
from tuner.served import LaunchedServer
from tuner.sglang.flags import FlagTable, parse_argv, replace_flags, runs_simulator
from tuner.study.fingerprint import (
    FINGERPRINT_ATTR,
    LAYOUT_FLAGS,
    STRUCTURAL_FLAGS,
    Fingerprint,
    parse_fingerprint,
    start_facts,
)

__all__ = ["FlagChange", "UpgradeCheck", "BootResult", "MEMORY_DEFAULTS", "flag_changes", "plan_upgrade", "boot",
           "in_window"]

MEMORY_DEFAULTS = ("mem_fraction_static", "max_running_requests", "chunked_prefill_size", "max_prefill_tokens",
                   "cuda_graph_max_bs", "max_total_tokens", "schedule_conservativeness", "hicache_ratio",
                   "hicache_size", "hicache_write_policy", "hicache_io_backend", "hicache_mem_layout",
                   *LAYOUT_FLAGS, *STRUCTURAL_FLAGS)
"""Knobs whose SGLang default sets the memory decomposition or the capacity (§1-§2): a changed
default of one the command leaves unset changes the deployment without a changed command."""


class FlagChange(BaseModel):
    """One difference the new version makes to the best config's command.

    Attributes:
        field: The SGLang field name.
        change: ``renamed``, ``removed``, ``deprecated`` or ``default``.
        old: The old spelling (renamed, removed, deprecated) or default (as the table gives it).
        new: The new spelling or default; ``None`` when removed.
    """

    model_config = ConfigDict(frozen=True)

    field: str
    change: Literal["renamed", "removed", "deprecated", "default"]
    old: Any = None
    new: Any = None

    def line(self) -> str:
        """One line for the report."""
        if self.change == "renamed":
            return f"{self.field}: renamed {self.old} → {self.new}"
        if self.change == "removed":
            return f"{self.field}: {self.old} removed (the new version has no such knob; the command would not start)"
        if self.change == "deprecated":
            return f"{self.field}: {self.old} is deprecated in the new version"
        return f"{self.field}: default {self.old!r} → {self.new!r} (the command leaves it unset)"


class UpgradeCheck(BaseModel):
    """The report of ``tuner upgrade-check`` (nothing of it is stored).

    Attributes:
        study: The study.
        trial: The best trial whose flags are checked.
        from_version: The study's SGLang version.
        to_version: The other installation's.
        changes: The flag changes (:class:`FlagChange`).
        argv: The best config's command as the study ran it.
        new_argv: The same flags rendered for the new version (renamed spellings replaced), or
            ``None`` when a removed flag leaves no command to start.
        fingerprint: The study's fingerprint (what a boot of the new version is compared with).
        to_table: The bundled flag table the new version's flags were read from, when it is not
            that version's own (``--version`` of a release with no bundled table: the nearest at
            or below it, :meth:`tuner.sglang.flags.FlagTable.for_version`); ``None`` otherwise.
    """

    model_config = ConfigDict(frozen=True)

    study: str
    trial: int
    from_version: str
    to_version: str
    changes: list[FlagChange] = Field(default_factory=list)
    argv: list[str] = Field(default_factory=list)
    new_argv: list[str] | None = None
    fingerprint: Fingerprint | None = None
    to_table: str | None = None

    def lines(self) -> list[str]:
        """The report as text lines."""
        out = [f"study {self.study}, best trial {self.trial}: SGLang {self.from_version} → {self.to_version}"]
        if self.to_table is not None:
            out.append(f"  SGLang {self.to_version} has no bundled flag table: its flags are those of {self.to_table}, "
                       "the nearest bundled one; pass --python of the new installation to read its own")
        out += [f"  {c.line()}" for c in self.changes] or ["  no flag of the best config changes"]
        if self.fingerprint is not None:
            f = self.fingerprint.figures()
            out.append(f"  fingerprint ({self.fingerprint.key.describe()}): B {f['baseline_gib']} GiB, weights "
                       f"{f['weight_gib']} GiB, KV {f['cell_bytes']} bytes/token, draft {f['draft_gib']} GiB")
        return out


def _tokens(argv: Sequence[str]) -> list[str]:
    """The ``--flag`` words of a command (``--flag=value`` cut at ``=``)."""
    return [w.split("=", 1)[0] for w in argv if w.startswith("--")]


def _accepts(table: FlagTable, word: str) -> str | None:
    """The dest SGLang's argparse selects for ``word`` in ``table``'s version: the exact spelling,
    or a unique prefix (``allow_abbrev``); ``None`` when it refuses it (unknown or ambiguous)."""
    exact = table.option_for_flag(word) if table.has(word) else None
    if exact is not None:
        return exact.dest
    dests = {o.dest for o in table.options for f in o.flags if f.startswith(word)}
    return next(iter(dests)) if len(dests) == 1 else None


def flag_changes(argv: Sequence[str], old: FlagTable, new: FlagTable, fields: Iterable[str] = MEMORY_DEFAULTS) -> list[FlagChange]:
    """What ``new`` changes of the command ``argv`` that ran on ``old`` (see the module).

    Args:
        argv: The command (its ``--flag`` words are checked; values are not).
        old: The version it ran on.
        new: The other version.
        fields: Knobs whose changed default is reported when the command leaves them unset.
    """
    changes: list[FlagChange] = []
    seen: set[str] = set()
    for word in _tokens(argv):
        option = old.option_for_flag(word)
        if option is None:
            continue  # not SGLang's (the simulator's --sim-*), or unknown already
        field = old.canonical(option.dest)
        if field in seen:
            continue
        seen.add(field)
        if not new.has(field):
            changes.append(FlagChange(field=field, change="removed", old=word))
            continue
        target = new.option(field)
        if _accepts(new, word) != target.dest:
            changes.append(FlagChange(field=field, change="renamed", old=word, new=target.flags[0]))
        elif target.is_deprecated:
            changes.append(FlagChange(field=field, change="deprecated", old=word))
    for field in fields:
        if field in seen or not old.has(field) or not new.has(field):
            continue
        before, after = old.option(field).default, new.option(field).default
        if before != after:
            changes.append(FlagChange(field=field, change="default", old=before, new=after))
    return changes


def _renamed_argv(argv: Sequence[str], changes: Sequence[FlagChange], old: FlagTable, new: FlagTable) -> list[str] | None:
    """``argv`` with each renamed flag in the new spelling (its value kept); ``None`` when a flag
    was removed."""
    if any(c.change == "removed" for c in changes):
        return None
    renamed = {c.field for c in changes if c.change == "renamed"}
    if not renamed:
        return list(argv)
    values = {k: v for k, v in parse_argv(list(argv), old).items() if k in renamed}
    kept = [w for i, w in enumerate(argv) if not _drops(argv, i, renamed, old)]
    try:
        return replace_flags(kept, values, new)
    except FlagError:
        return None


def _drops(argv: Sequence[str], i: int, fields: set[str], table: FlagTable) -> bool:
    """Whether word ``i`` of ``argv`` is a flag of ``fields`` (or its value)."""
    def field_of(word: str) -> str | None:
        option = table.option_for_flag(word.split("=", 1)[0]) if word.startswith("--") else None
        return table.canonical(option.dest) if option is not None else None

    word = argv[i]
    if word.startswith("--"):
        return field_of(word) in fields
    if i > 0 and argv[i - 1].startswith("--") and "=" not in argv[i - 1]:
        option = table.option_for_flag(argv[i - 1])
        return option is not None and option.takes_value and table.canonical(option.dest) in fields
    return False


def plan_upgrade(stored: StoredStudy, old: FlagTable, new: FlagTable, view: TrialView | None = None) -> UpgradeCheck:
    """The upgrade report for ``stored``'s best trial (or ``view``) from ``old`` to ``new``.

    Raises:
        StudyError: The study has no feasible trial (from :func:`tuner.results.best_trial`).
    """
    view = view or best_trial(stored).trial
    argv = list(view.record.argv) if view.record is not None else []
    changes = flag_changes(argv, old, new, (*MEMORY_DEFAULTS, *view.params))
    stored_fp = parse_fingerprint(stored.name, stored.study.user_attrs[FINGERPRINT_ATTR]) \
        if FINGERPRINT_ATTR in stored.study.user_attrs else None
    return UpgradeCheck(study=stored.name, trial=view.number, from_version=old.version, to_version=new.version,
                        changes=changes, argv=argv, new_argv=_renamed_argv(argv, changes, old, new),
                        fingerprint=stored_fp.fingerprint if stored_fp is not None else None,
                        to_table=new.table_version if new.table_version != new.version else None)


class BootResult(BaseModel):
    """One start of the best flags on the new version (``--boot``), beside the fingerprint.

    Attributes:
        argv: The command that was started.
        outcome: ``ok`` or ``failed`` (the record's).
        failure: The failure's class and evidence, if it failed.
        token_capacity: ``max_total_num_tokens`` on the new version (tokens).
        context_capacity: Its context capacity (requests).
        free_gib_after_graphs: Free GPU memory after graphs (GiB).
        draft_gib: The draft model's share (GiB), with speculative decoding.
        before: The same figures from the fingerprint's start of the same flags (or its best), if any.
        loaded: Whether a short load ran (``--load``).
        output_throughput_tok_s: Its output throughput, when it ran.
    """

    model_config = ConfigDict(frozen=True)

    argv: list[str]
    outcome: str
    failure: str | None = None
    token_capacity: int | None = None
    context_capacity: int | None = None
    free_gib_after_graphs: float | None = None
    draft_gib: float | None = None
    before: dict[str, Any] = Field(default_factory=dict)
    loaded: bool = False
    output_throughput_tok_s: float | None = None

    def lines(self) -> list[str]:
        """The boot's figures beside the fingerprint's, one line each."""
        if self.outcome != "ok" and self.token_capacity is None:
            return [f"boot on the new version failed: {self.failure}; the service was restored"]
        out = ["boot on the new version (the service was restored afterwards):"]
        for name, unit in (("token_capacity", "tokens"), ("context_capacity", "contexts"),
                           ("free_gib_after_graphs", "GiB free after graphs"), ("draft_gib", "GiB draft share"),
                           ("output_throughput_tok_s", "tok/s")):
            now, was = getattr(self, name), self.before.get(name)
            if now is None and was is None:
                continue
            delta = ""
            if isinstance(now, (int, float)) and isinstance(was, (int, float)) and was:
                delta = f" ({(now - was) / abs(was):+.1%})"
            out.append(f"  {name}: {_fmt(was)} → {_fmt(now)} {unit}{delta}")
        if self.failure:
            out.append(f"  it failed on the new version: {self.failure[:200]}")
        return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def in_window(window: str, now: datetime.time) -> bool:
    """Whether ``now`` lies in ``window`` (``HH:MM-HH:MM``, local time; it may wrap midnight).

    Raises:
        ConfigError: ``window`` is not ``HH:MM-HH:MM``.
    """
    try:
        start, end = (datetime.time.fromisoformat(part.strip()) for part in window.split("-", 1))
    except ValueError as err:
        raise ConfigError(f"--window {window!r} is not HH:MM-HH:MM", hint="pass e.g. --window 02:00-04:00") from err
    return start <= now <= end if start <= end else (now >= start or now <= end)


def _on_new_version(argv: Sequence[str], *, python: str | None, version: str | None) -> list[str]:
    """The command on the other installation: its Python as the interpreter (a command run as
    ``PYTHON -m ...``), or the simulator's ``--sim-version`` standing in for a version."""
    out = list(argv)
    if version is not None and runs_simulator(out):
        if "--sim-version" in out:
            out[out.index("--sim-version") + 1] = version
        else:
            out += ["--sim-version", version]
    if python is not None and len(out) > 1 and out[1] == "-m":
        out[0] = python
    return out


def _before(check: UpgradeCheck, params: dict[str, Any], view: TrialView) -> dict[str, Any]:
    """The best trial's figures on the current version: its record, and its start's facts in the
    fingerprint (the draft's share)."""
    record = view.record
    out: dict[str, Any] = {} if record is None else {
        "token_capacity": record.token_capacity, "context_capacity": record.context_capacity,
        "free_gib_after_graphs": record.free_gib_after_graphs}
    if check.fingerprint is None:
        return out
    starts = [s for s in check.fingerprint.starts if s.outcome == "ok"]
    same = next((s for s in starts if s.params == params), None) or next((s for s in starts if s.trial == check.trial), None)
    if same is not None:
        out["draft_gib"] = same.draft_gib
    return out


def boot(config: TunerConfig, stored: StoredStudy, check: UpgradeCheck, old: FlagTable, new: FlagTable, *,
         python: str | None, version: str | None, load: bool = False) -> BootResult:
    """Start the best flags once on the new version, under the unit's lock and state file, and
    restore the service (:meth:`tuner.launch.base.GuardedLauncher.session`, as ``tuner run`` does
    for a trial): one boot probe (the trial's start and probe), or with ``load`` one short load
    (the config's ``[budget]`` phases). Nothing is stored in the study.

    Raises:
        LaunchError: A service check fails (before the lock: nothing changed).
        LockHeldError: Another tuner holds the unit.
        FlagError: A flag of the command was removed in the new version (nothing changed).
    """
    from tuner.entrypoints import resolve_environment, resolve_gpu_monitor, resolve_launcher
    from tuner.preflight import check_service
    from tuner.study.job import TrialJob
    from tuner.trial import TrialExecutor

    gpu = resolve_gpu_monitor(config)
    launcher = resolve_launcher(config, gpu=gpu)
    current = launcher.current_argv()
    renamed = _renamed_argv(current, flag_changes(current, old, new, ()), old, new)
    if renamed is None:
        removed = [c.line() for c in flag_changes(current, old, new, ()) if c.change == "removed"]
        raise FlagError(f"the service's command cannot start on SGLang {new.version}: {'; '.join(removed)}",
                        hint="drop the flag from the unit's command first; nothing was changed")
    argv = _on_new_version(renamed, python=python, version=version)
    check_service(launcher)
    view = stored.trial(check.trial)
    params = dict(view.params)
    context_tokens = (stored.info.context_tokens if stored.info else None) or config.objective.context_tokens or 1
    with launcher.session():
        work_dir = launcher.store.fresh_work_dir()
        try:
            environment = resolve_environment(config, argv, new, gpu)
            server = _NewVersionServer(config, launcher, gpu=gpu, environment=environment, argv=argv)
            job = TrialJob(number=0, kind="sampled", params=params, context_tokens=context_tokens,
                           capacity_floor=0 if load else 2**31)
            record = TrialExecutor(config, server, new, work_dir=work_dir).run(job, lambda *_a: None)
        finally:
            launcher.store.drop_work_dir()
    facts = start_facts(0, record)
    failure = None
    if record.failure_class is not None:
        failure = f"{record.failure_class.value}: {record.failure_evidence or ''}".strip()
    return BootResult(argv=list(record.argv) or argv, outcome=record.outcome, failure=failure,
                      token_capacity=record.token_capacity, context_capacity=record.context_capacity,
                      free_gib_after_graphs=record.free_gib_after_graphs,
                      draft_gib=facts.draft_gib if facts else None, before=_before(check, params, view),
                      loaded=load and not record.memory.probe_only,
                      output_throughput_tok_s=record.output_throughput_tok_s if load and record.outcome == "ok" else None)


class _NewVersionServer(LaunchedServer):
    """The service on the new version: :class:`tuner.served.LaunchedServer` whose command is the
    new installation's (the trial renders the best flags into it with the new flag table)."""

    def __init__(self, config: TunerConfig, launcher: Any, *, gpu: Any, environment: dict[str, Any],
                 argv: list[str]) -> None:
        super().__init__(config, launcher, gpu=gpu, environment=environment)
        self._new_argv = list(argv)

    def baseline_argv(self) -> list[str]:
        """The new installation's command (not the unit's current one)."""
        return list(self._new_argv)
