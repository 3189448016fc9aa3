"""The composition root: the one place that wires config, launcher, flag table, GPU monitor,
server under test, trial executor and study loop together (``tuner run`` and ``tuner run --dry-run``).

Everything else receives its parts as arguments; :mod:`tuner.apply` and the CLI import the public
``resolve_*`` functions from here rather than choosing launchers or flag tables themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import optuna
from sqlalchemy.exc import SQLAlchemyError

from tuner.config import TunerConfig
from tuner.errors import ConfigError, HookError, ServiceControlError, TunerError
from tuner.launch.base import Launcher
from tuner.launch.hostmem import read_host_memory
from tuner.load import build_workload
from tuner.load.workloads import for_speculation
from tuner.preflight import check_command, check_run
from tuner.served import LaunchedServer
from tuner.sglang.flags import FlagTable, flag_value, parse_argv, runs_simulator
from tuner.study.baseline import latest_baseline, reference_plan, study_hicache, study_levers
from tuner.study.budget import prior_trial_cost_s, slo_bracket_cost_s
from tuner.study.hostcheck import ranks_of
from tuner.study.loop import run_study
from tuner.study.optuna_io import records
from tuner.study.outage import ResultJournal
from tuner.study.progress import RunSummary
from tuner.study.space import SEARCHED_FIELDS, resolve_space
from tuner.study.stops import restored_text
from tuner.study.storage import display_url, read_storage, stored_values, study_artifacts_dir, study_storage_url
from tuner.trial import TrialExecutor
from tuner.units import format_duration

__all__ = ["resolve_gpu_monitor", "resolve_launcher", "resolve_flag_table", "resolve_environment", "tune", "dry_run"]

_log = logging.getLogger(__name__)


def resolve_gpu_monitor(config: TunerConfig) -> Any | None:
    """The GPU monitor the config asks for (``auto``: the simulator's ledger for ``tuner.sim``,
    else NVML when it can be opened; without it a warning, and activation peaks are not measured).

    Raises:
        ConfigError: ``[service] gpu_monitor`` names a monitor (``nvml``, ``sim``) that cannot be
            opened: the run would go on without what the config asked for (review N22).
    """
    from tuner.gpu import GPUMonitor

    asked = config.service.gpu_monitor
    kind = asked
    if kind == "auto":
        kind = "sim" if runs_simulator(config.service.command or []) else "nvml"
    if kind == "none":
        return None
    try:
        return GPUMonitor.for_target(kind, config.service.url)
    except TunerError as err:
        if asked != "auto":
            raise ConfigError(f"[service] gpu_monitor = {asked!r} cannot be used: {err.message}",
                              hint=err.hint or 'set [service] gpu_monitor = "none" to run without GPU memory '
                              "readings") from err
        _log.warning("no GPU monitor (%s); activation peaks will not be measured", err)
        return None


def resolve_launcher(config: TunerConfig, *, gpu: Any | None = None) -> Launcher:
    """The launcher of ``[service]`` (systemd unit or plain process), by :mod:`tuner.launch.factory`.

    Raises:
        LaunchError: The unit or command is unusable.
    """
    from tuner.launch.factory import build_launcher as factory

    return factory(config.service, gpu=gpu)


def resolve_flag_table(config: TunerConfig, argv: list[str]) -> FlagTable:
    """SGLang's flag table: ``[service] python`` introspected live, else ``sglang_version``'s bundled
    table, else the simulator's ``--sim-version``, else the newest bundled one (§3)."""
    service = config.service
    if service.python and not service.sglang_version:
        return FlagTable.from_python(service.python)
    version = service.sglang_version
    if version is None:
        version = flag_value(argv, "--sim-version")
    if version is None and runs_simulator(argv):
        version = "0.5.5"  # the simulator's default mimicked version
    return FlagTable.for_version(version or FlagTable.bundled_versions()[-1])


def resolve_environment(config: TunerConfig, argv: list[str], table: FlagTable, gpu: Any | None) -> dict[str, Any]:
    """SGLang version, GPU name/count/size, driver and model: what a study refuses to mix."""
    explicit = parse_argv(argv, table)
    env: dict[str, Any] = {
        "sglang_version": table.version,
        "model": config.model.name or explicit.get("model_path"),
        "gpu_count": int(explicit.get("tp_size") or 1) * int(explicit.get("pp_size") or 1),
    }
    if (sim_gpu := flag_value(argv, "--sim-gpu")) is not None:
        env["gpu_name"] = sim_gpu
        env["driver_version"] = "simulated"
    snapshot = []
    if gpu is not None:
        try:
            snapshot = gpu.snapshot()
        except TunerError:
            snapshot = []
    if snapshot:  # the device's own size (NVML, or the simulator's ledger), never parsed from a name
        env["gpu_total_mib"] = min(g.total_mib for g in snapshot)
    # The identity must not depend on whether the unit runs now: the simulator's device is named by
    # --sim-gpu (its ledger, readable only while it runs, has no name), a real one by NVML.
    if gpu is not None and "gpu_name" not in env:
        if snapshot:
            env["gpu_name"] = snapshot[0].name
            env["gpu_count"] = len(snapshot)
        backend = getattr(gpu, "backend", None)
        driver = getattr(backend, "driver_version", None)
        if callable(driver):
            driver = driver()
        if driver:
            env["driver_version"] = str(driver)
    return env


def speculative_workload(config: TunerConfig, argv: list[str], table: FlagTable) -> TunerConfig:
    """``config`` with a workload fit for the service: when the service runs a draft model
    (``--speculative-algorithm``), random token ids are replaced by text prompts of the same
    lengths (:func:`tuner.load.workloads.for_speculation`; random ids overstate acceptance)."""
    if not parse_argv(argv, table).get("speculative_algorithm"):
        return config
    workload = for_speculation(config.workload)
    return config if workload is config.workload else config.model_copy(update={"workload": workload})


def tune(
    config: TunerConfig,
    *,
    budget_s: float | None,
    max_trials: int | None = None,
    allow_mixed_environment: bool = False,
    storage_url: str | None = None,
    on_progress: Callable[[Any], None] | None = None,
) -> RunSummary:
    """``tuner run``: hold the service, run the study, put the service back as it was.

    Args:
        config: The validated config.
        budget_s: Wall-clock budget (s), or ``None`` with ``max_trials``.
        max_trials: Cap on trials in this run.
        allow_mixed_environment: Add to a study recorded in another environment.
        storage_url: Override of ``[storage] url``.
        on_progress: Receives :class:`tuner.study.loop.Progress` events.

    Returns:
        The :class:`tuner.study.loop.RunSummary`.

    Raises:
        TunerError: Bad config, unit, storage, budget or environment, found by
            :func:`tuner.preflight.check_run` before the lock or any change (nothing was changed
            then); or a failure during the run, after the service was restored.
        KeyboardInterrupt: Ctrl-C or SIGTERM, after the service was restored (when the run had
            changed it); its ``service`` attribute says which, as :attr:`RunSummary.service` does.

    .. note:: Restarts the production service for every trial and restores it at the end, on
       Ctrl-C, on SIGTERM and on any error; a run that started no trial restarts nothing, and a
       ``pre_restart`` drain that fails stops the run without a restart (the message says what the
       service runs and what to do).
    """
    gpu = resolve_gpu_monitor(config)
    launcher = resolve_launcher(config, gpu=gpu)
    argv = launcher.current_argv()
    table = resolve_flag_table(config, argv)
    check_command(config, argv, table)  # the plan and the environment read the command: a broken one first
    config = speculative_workload(config, argv, table)
    environment = resolve_environment(config, argv, table, gpu)
    check_run(config, launcher, environment=environment, storage_url=storage_url, budget_s=budget_s,
              max_trials=max_trials, allow_mixed_environment=allow_mixed_environment)
    url = storage_url or study_storage_url(config)
    journal = ResultJournal(launcher.store.journal_path, config.study.name, url)
    server: LaunchedServer | None = None
    try:
        with launcher.session():
            # Per-trial files live in the unit's work folder until run_study uploads them to the
            # artifact store; a killed run's folder is emptied by the next run or `tuner restore`.
            work_dir = launcher.store.fresh_work_dir()
            stopped: BaseException | None = None
            try:
                server = LaunchedServer(config, launcher, gpu=gpu, environment=environment)
                executor = TrialExecutor(config, server, table, work_dir=work_dir)
                summary = run_study(
                    config, executor, budget_s=budget_s, max_trials=max_trials, journal=journal,
                    allow_mixed_environment=allow_mixed_environment, storage_url=url, on_progress=on_progress,
                )
            except BaseException as err:
                stopped = err
                raise
            finally:
                launcher.store.drop_work_dir()
                if launcher.needs_restore and server is not None:
                    _drain_before_restore(server, launcher, stopped)  # the session's exit restarts the original next
    except KeyboardInterrupt as err:  # the CLI's line says what became of the service
        setattr(err, "service", _service_text(config, launcher.restored_on_exit))  # noqa: B010 - an exception's attribute
        raise
    finally:
        if launcher.restored_on_exit and server is not None:  # put back, and checked healthy
            _restore_hook(server, "post_ready")
    summary.service = _service_text(config, launcher.restored_on_exit)
    return summary


UNCHANGED_SERVICE = "not restarted: the run changed nothing, the service runs its own flags as before"
"""What a run that never restarted the service says of it (:attr:`RunSummary.service`)."""


def _service_text(config: TunerConfig, restored: bool) -> str:
    """What the run's end did to the service (:attr:`RunSummary.service`)."""
    if restored:
        return restored_text(config, datetime.now())
    return UNCHANGED_SERVICE


def _drain_before_restore(server: LaunchedServer, launcher: Launcher, stopped: BaseException | None) -> None:
    """``[service] pre_restart`` before the final restore. A drain that fails means no restart:
    the service is held as it is (:meth:`~tuner.launch.base.GuardedLauncher.hold`, the state file
    kept for ``tuner restore``) and the run stops in one line saying so, and why the run had
    stopped when it was an error or an interrupt (``stopped``).

    Raises:
        HookError: The hook failed (the message says what the service runs and what to do).
    """
    try:
        server.hook("pre_restart", "restore")
    except HookError as err:
        why = ""
        if isinstance(stopped, TunerError):
            why = f" (the run had stopped: {stopped.message})"
        elif isinstance(stopped, KeyboardInterrupt):
            why = " (the run was interrupted)"
        raise HookError(f"{err.message} before the final restore; {launcher.hold()}{why}", hook=err.hook,
                        hint=err.hint) from stopped


def _restore_hook(server: LaunchedServer, name: str) -> None:
    """Run ``[service]`` hook ``name`` after the final restore; a failure there is logged (the
    service runs its own flags again; the hook must be run by hand), not raised."""
    try:
        server.hook(name, "restore")
    except ServiceControlError as err:
        _log.warning("%s (after the final restore: the service runs its own flags again; run the hook by hand)",
                     err.message)


def dry_run(config: TunerConfig, *, budget_s: float | None, max_trials: int | None,
            storage_url: str | None = None) -> str:
    """``tuner run --dry-run``: the plan and the first candidate's launch, changing nothing.

    Returns:
        The plan, as text.
    """
    launcher = resolve_launcher(config, gpu=None)
    argv = launcher.current_argv()
    table = resolve_flag_table(config, argv)
    check_command(config, argv, table)  # the plan and the environment read the command: a broken one first
    config = speculative_workload(config, argv, table)
    explicit = parse_argv(argv, table)
    baseline = {k: explicit[k] for k in SEARCHED_FIELDS if k in explicit}
    ranks = ranks_of(argv)
    host = read_host_memory(argv, url=config.service.url, unit=getattr(launcher, "unit", None))
    hicache = study_hicache(config, device_tokens=None, version=table.version, host=host, ranks=ranks)
    gpu_name = resolve_environment(config, argv, table, None).get("gpu_name")
    levers = study_levers(config, argv, table.version, gpu_name)
    space = resolve_space(config.space, baseline, hicache=hicache, levers=levers)
    workload = build_workload(config.workload, seed=config.study.seed)
    per_trial = prior_trial_cost_s(config)
    lines = [
        f"study {config.study.name!r} in {display_url(storage_url or study_storage_url(config))} "
        f"(artifacts {study_artifacts_dir(config, storage_url)})",
        f"service: {config.service.launcher} {config.service.unit or ''} at {config.service.url}, "
        f"SGLang flags of {table.version}",
        f"workload: {workload.describe()}",
        f"objectives: context capacity at {config.objective.context_tokens or workload.context_tokens} tokens, "
        f"output throughput; best = {config.objective.policy} (tolerance {config.objective.capacity_tolerance:.0%})",
        f"budget: {format_duration(budget_s) if budget_s else 'none'}, trials cap {max_trials or 'none'}, "
        f"first-trial estimate {format_duration(per_trial)}"
        + (f" (with up to {1 + config.budget.slo_capacity_steps} steady windows of the SLO-safe capacity, "
           f"{_steady_text(config)} each)" if slo_bracket_cost_s(config) else "")
        + (f" → about {int(budget_s // per_trial)} trials" if budget_s else ""),
        "space (baseline-derived ranges are widened once the baseline is measured):",
    ]
    for name, dist in space.distributions().items():
        lines.append(f"  {name}: {_range_text(dist)}")
    lines.append(f"hierarchical cache: {hicache.reason}"
                 + ("" if config.space.hierarchical_cache is not None else
                    " (decided again with the measured device pool once the baseline runs)"))
    lines.append(f"structural levers (GPU {gpu_name or 'unknown until the baseline runs'}; decided again with the "
                 "baseline's startup log):")
    lines += [f"  {reason}" for reason in levers.reasons]
    if hicache.include:
        lines.append(f"host memory before each launch: {host.source}; a config whose pools (per rank × {ranks} "
                     "ranks) do not fit MemAvailable or the unit's MemoryMax is skipped without a restart")
    stored = _stored_progress(config, storage_url)
    if stored is not None and stored[2] is not None:
        lines.append(stored[2])
    if stored is None or stored[1] is None:
        lines.append("first candidate: the baseline (the service's current flags), launched as:")
    else:
        lines.append(f"first candidate: chosen from the study's {stored[0]} measured trial(s) (a re-queued one first; "
                     f"the baseline is trial {stored[1]}); the service's current flags, as the launcher starts them:")
    lines.append(launcher.dry_run(argv))
    return "\n".join(lines)


def _stored_progress(config: TunerConfig, storage_url: str | None) -> tuple[int, int | None, str | None] | None:
    """``(measured trials, the latest baseline's number or None, the quality gate's reference
    line or None)`` of the study a run would resume (:func:`tuner.study.baseline.reference_plan`),
    or ``None`` when there is none yet or it cannot be read (the checks after the plan say why)."""
    url = storage_url or study_storage_url(config)
    try:
        with stored_values(url):
            study = optuna.load_study(study_name=config.study.name, storage=read_storage(url))
            done = records(study)
    except (TunerError, KeyError, SQLAlchemyError):
        return None
    finished = [(t.number, r) for t, r in done]
    found = latest_baseline(finished)
    plan = reference_plan(finished, gate_on=config.quality.enabled)
    return (sum(1 for _, r in done if r.outcome in ("ok", "failed")), (found[0] if found is not None else None),
            plan[0] if plan is not None else None)


def dry_run_checks(config: TunerConfig, *, budget_s: float | None, max_trials: int | None,
                   storage_url: str | None = None, allow_mixed_environment: bool = False) -> None:
    """The checks ``tuner run`` makes before it changes anything (:func:`tuner.preflight.check_run`),
    made for ``--dry-run`` after its plan: the storage it would use, the stored study's environment,
    the budget when one is given, and the service (its command's executable, the unit, the
    folders, the port). Changes nothing.

    Raises:
        TunerError: The first check that fails, one line with its fix.
    """
    resolve_gpu_monitor(config)  # the monitor the config names must open (nothing is measured here)
    launcher = resolve_launcher(config, gpu=None)
    argv = launcher.current_argv()
    table = resolve_flag_table(config, argv)
    check_command(config, argv, table)  # the plan and the environment read the command: a broken one first
    check_run(config, launcher, environment=resolve_environment(config, argv, table, None), storage_url=storage_url,
              budget_s=budget_s, max_trials=max_trials, allow_mixed_environment=allow_mixed_environment,
              planning=True)


def _range_text(dist: Any) -> str:
    """An Optuna distribution as the dry run shows it: ``0.78 to 0.95 step 0.01``, ``one of 1024, 2048``."""
    choices = getattr(dist, "choices", None)
    if choices is not None:
        return "one of " + ", ".join(str(c) for c in choices)
    step = getattr(dist, "step", None)
    text = f"{dist.low:g} to {dist.high:g}"
    if step not in (None, 1):
        text += f" step {step:g}"
    return text + (" (log scale)" if getattr(dist, "log", False) else "")


def _steady_text(config: TunerConfig) -> str:
    """``ramp 5 s + warm-up 2 s + window 10 s``: one steady window's time (:mod:`tuner.load.steady`)."""
    window = config.budget.steady_window()
    return f"ramp {window.ramp:g} s + warm-up {window.settle_s:g} s + window {window.duration_s:g} s"
