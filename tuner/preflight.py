"""Preflight: every check a command needs, made before it takes the unit's lock, writes a state file
or calls a ``systemctl`` verb that changes anything.

On a production box a refusal must change nothing, not even a restart. So ``tuner run``, ``tuner
apply``, ``tuner restore`` and ``tuner launch`` validate here first and only then take the unit's
lock and write the state file (:meth:`tuner.launch.base.GuardedLauncher.session`):

* **config**: a budget or a trial cap; ``[service] url`` on the command's ``--port``
  (:func:`tuner.config.check_url_matches_port`, ``shared/sglang-reference.md`` §2.4); an explicit
  artifacts folder that exists; a ``[quality] tasks`` evaluation JSONL that reads
  (:func:`tuner.load.quality.read_tasks`); the structural levers ``[space]`` lists, each by its
  own rule (:func:`tuner.knobs.check_listed_levers`: not an empty list, a flag the version has, a
  size that divides ``--tp-size``).
* **storage** (:func:`tuner.study.storage.check_run_storage`): an explicit SQLite folder that
  exists and is writable; an existing file that is an SQLite database (not 0 bytes, not corrupt),
  empty or an Optuna storage; the study, when stored, recorded in this environment.
* **command** (:func:`check_command`, first, as soon as the flag table is known: the plan reads
  the command): the service's own command (the baseline) as its SGLang version reads it: no flag
  the version lacks, values of the flag's type and range; the simulator's command through the
  simulator's own parser (its model, GPU and ``--sim-*`` values).
* **budget**: at least one trial's estimated cost (:func:`tuner.study.budget.require_one_trial`,
  with the stored trials' durations when the study exists).
* **service** (:meth:`tuner.launch.base.GuardedLauncher.preflight`): ``systemctl`` reachable, the
  unit known and its command readable, the drop-in folder writable, the journal readable and
  journald running (systemd); the port free (process launcher); the state and lock folders
  writable.

Each check raises a :class:`~tuner.errors.TunerError` whose message is one line naming the problem
and the fix; none of them changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna

from tuner.config import TunerConfig, check_url_matches_port
from tuner.errors import ConfigError, FlagError, StudyError
from tuner.knobs import check_listed_levers
from tuner.load.quality import read_tasks
from tuner.sglang.flags import FlagTable, flag_int, parse_argv, server_args, unknown_flags, validate
from tuner.sglang.versions import release
from tuner.study.budget import Budget, budget_name, prior_trial_cost_s, require_one_trial
from tuner.study.optuna_io import check_environment, environment_binds, records, study_info
from tuner.study.storage import (
    check_artifacts_folder,
    check_run_storage,
    read_storage,
    stored_values,
    study_storage_url,
)

__all__ = ["check_run", "check_service", "check_command"]


def check_service(launcher: Any, *, restore: bool = False) -> None:
    """The service checks of ``apply``, ``restore`` and ``launch`` (and ``run``, via :func:`check_run`).

    Args:
        launcher: The :class:`tuner.launch.base.GuardedLauncher` the command would hold.
        restore: Only what a restore needs (the manager reachable, the unit known, the state and
            lock folders writable); whether the drop-ins can be rewritten is checked by the
            restore itself before it stops anything, against what it has to write.

    Raises:
        LaunchError: The first service check that fails (one line with its fix).
    """
    launcher.preflight(restore=restore)


def check_run(
    config: TunerConfig,
    launcher: Any,
    *,
    environment: Mapping[str, Any],
    storage_url: str | None,
    budget_s: float | None,
    max_trials: int | None,
    allow_mixed_environment: bool,
    planning: bool = False,
) -> None:
    """Everything ``tuner run`` checks before it takes the unit or writes anything.

    Args:
        config: The validated config.
        launcher: The :class:`tuner.launch.base.GuardedLauncher` the run would hold.
        environment: This run's environment facts (:func:`tuner.entrypoints.resolve_environment`).
        storage_url: ``--storage`` (else the config's).
        budget_s: The wall-clock budget in seconds, or ``None``.
        max_trials: The trial cap, or ``None``.
        allow_mixed_environment: ``--allow-mixed-environment``.
        planning: ``--dry-run``: a budget is not needed (when one is given, it is checked).

    Raises:
        TunerError: The first check that fails (see the module docstring), one line with its fix.
    """
    if budget_s is None and max_trials is None and not planning:
        raise StudyError("no --budget and no --trials given", hint="pass e.g. --budget 4h or --trials 20")
    check_url_matches_port(launcher.url, launcher.current_argv())
    check_listed_levers(config.space, version=environment.get("sglang_version"),
                        tp=flag_int(launcher.current_argv(), "--tp-size", "--tp", "--tensor-parallel-size") or 1)
    if config.quality.enabled and config.quality.tasks:
        read_tasks(config.quality.tasks)  # a malformed evaluation JSONL: one line, before anything changes
    url = storage_url or study_storage_url(config)
    check_artifacts_folder(config)
    durations: list[float] = []
    if check_run_storage(url, config.study.name):
        durations = _check_stored_study(config.study.name, url, environment, allow_mixed_environment)
    if budget_s is not None:
        require_one_trial(budget_s, Budget.estimate(durations, prior_trial_cost_s(config)).seconds,
                          reserve_s=config.budget.restore_reserve_s, name=budget_name(config, budget_s))
    check_hooks(config)
    check_paths(config)
    check_service(launcher)


_FIX_COMMAND = "fix the service's command ([service] command, or the unit's ExecStart): its first trial, the baseline, runs it as it is"


def _simulator_refuses(args: list[str]) -> str | None:
    """What the simulator (:mod:`tuner.sim`) says of its command line before it starts, as its own
    parser reads it (exit 2 at launch: an unknown flag, an unknown ``--model-path`` preset or
    ``--sim-gpu``, a value SGLang's server-args checks reject); ``None`` when it accepts it."""
    import contextlib
    import io

    from tuner.sim.errors import SimError
    from tuner.sim.startup import plan_from_argv

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            plan_from_argv(args)
    except SimError as err:
        return str(err)
    except SystemExit as done:  # argparse: "usage: ...\nprog: error: unrecognized arguments: --x"
        if not done.code:
            return None
        last = (said.getvalue().strip().splitlines() or ["it refuses its arguments"])[-1]
        return last.split("error: ", 1)[-1]
    return None


def check_command(config: TunerConfig, argv: list[str], table: FlagTable) -> None:
    """The service's own command, the study's baseline, as the server would read it at launch: the
    run would otherwise create its study and store a failed baseline before anyone read why; and
    the workload's longest request within the model's context length (:func:`check_context`).

    SGLang's command (after ``sglang.launch_server`` or ``sglang serve``) is read with the
    version's flag table (``shared/sglang-flags/``, :class:`tuner.sglang.flags.FlagTable`): a
    flag the version lacks (only when the table is the version's own, not the nearest older one:
    a newer patch release may add flags), a value not of the flag's type
    (``--mem-fraction-static abc``), or one :func:`tuner.sglang.flags.validate` refuses
    (``--mem-fraction-static 1.5``, ``--port 70000``). The simulator's command is read by the
    simulator's own parser (:func:`tuner.sim.startup.plan_from_argv`).

    Args:
        config: The validated config (its workload and model).
        argv: The service's command (:meth:`tuner.launch.base.Launcher.current_argv`).
        table: The service's SGLang flag table.

    Raises:
        FlagError: The first problem of the command, naming the flag and the fix.
        ConfigError: The workload does not fit the model's context length.
    """
    sim_args = server_args(argv, "tuner.sim")
    if sim_args is not None:
        problem = _simulator_refuses(sim_args)
        if problem is not None:
            raise FlagError(f"the service's command is refused by the simulator: {problem}", hint=_FIX_COMMAND)
        _check_values(parse_argv(sim_args, table), table)  # what SGLang refuses at startup, the simulator too
        check_context(config, parse_argv(sim_args, table), preset=True)
        return
    _check_sglang_command(argv, table)
    check_context(config, parse_argv(argv, table), preset=False)


def check_context(config: TunerConfig, flags: Mapping[str, Any], *, preset: bool) -> None:
    """The workload's longest request (input + output, and ``[objective] context_tokens``) within
    the server's context length: ``--context-length``, else the model's ``max_position_embeddings``
    (SGLang's ``context_len``, ``sglang-reference.md`` §1.6) from ``[model] config_json`` or a
    local ``--model-path`` (:func:`tuner.study.lever_space.study_model`), or, for the simulator
    (``preset``), its bundled preset (``tuner/data/models/<name>/config.json``). SGLang refuses a
    longer request (HTTP 400), so every request of the study would fail. Unknown context: no check.

    Raises:
        ConfigError: Naming the longest request, the context length, where it came from, and the fix.
    """
    from importlib import resources

    from tuner.errors import TunerError
    from tuner.load.workloads import build_workload
    from tuner.sglang.modelconfig import load_model_config
    from tuner.study.lever_space import study_model

    context, source = flags.get("context_length"), "--context-length"
    if not isinstance(context, int):
        model = study_model(config, flags)
        name = flags.get("model_path")
        if model is None and preset and isinstance(name, str) and "/" not in name:
            try:
                model = load_model_config(str(resources.files("tuner.data") / "models" / name))
            except TunerError:
                model = None
        context, source = (model.max_position_embeddings if model else None), "the model's max_position_embeddings"
    if not context:
        return
    longest = build_workload(config.workload, seed=config.study.seed).context_tokens
    if longest > context:
        raise ConfigError(f"[workload]'s longest request ({longest:,} tokens, input + output) exceeds the server's "
                          f"context length ({context:,} tokens, {source})",
                          hint="shorten [workload] (input_len, output_len), or raise the server's --context-length")
    wanted = config.objective.context_tokens
    if wanted is not None and wanted > context:
        raise ConfigError(f"[objective] context_tokens {wanted:,} exceeds the server's context length "
                          f"({context:,} tokens, {source})",
                          hint=f"set context_tokens to at most {context}, or raise the server's --context-length")


def _check_sglang_command(argv: list[str], table: FlagTable) -> None:
    """SGLang's own command read with the version's flag table (see :func:`check_command`)."""
    args = server_args(argv, "sglang.launch_server")
    if args is not None and release(table.version) == release(table.table_version):
        unknown = unknown_flags(args, table)
        if unknown:
            raise FlagError(f"the service's command: {unknown[0].split(' — ')[0]}", hint=_FIX_COMMAND)
    _check_values(parse_argv(args if args is not None else argv, table), table)


def _check_values(params: dict[str, Any], table: FlagTable) -> None:
    """The command's values: of the flag's type, and none :func:`tuner.sglang.flags.validate` refuses."""
    for field, value in params.items():
        option = table.option(field)
        if option.type in ("int", "float", "human_readable_int") and isinstance(value, str):
            kind = "a number" if option.type == "float" else "an integer"
            raise FlagError(f"the service's command: {option.flags[0]} {value!r} is not {kind}", hint=_FIX_COMMAND)
    reasons = validate(params, table)
    if reasons:
        raise FlagError(f"the service's command: {reasons[0].split(' — ')[0]}", hint=_FIX_COMMAND)


def check_paths(config: TunerConfig) -> None:
    """The config's other paths hold what the run will read: ``[service] workdir`` is a folder (a
    missing one read as "server command not found" after the study was created), ``[model]
    config_json`` a readable model config (a missing one was ignored, and the levers said "set
    [model] config_json" while it was set).

    Raises:
        ConfigError: Naming the key, the path and the fix.
    """
    from pathlib import Path

    from tuner.errors import ModelConfigError
    from tuner.sglang.modelconfig import load_model_config

    workdir = config.service.workdir
    if workdir is not None and not Path(workdir).is_dir():
        raise ConfigError(f"[service] workdir {workdir!r} is not a folder",
                          hint="point workdir at the folder the server runs in, or leave it out")
    if config.model.config_json is not None:
        try:
            load_model_config(config.model.config_json)
        except ModelConfigError as err:
            raise ConfigError(f"[model] config_json: {err.message}", hint="point it at the model's config.json (or its "
                              "folder), or leave it out to read --model-path's") from None


def check_hooks(config: TunerConfig) -> None:
    """The ``[service]`` hooks' programs exist and may be run (a hook that cannot run would stop the
    run at its first restart, after its study was created).

    Raises:
        ConfigError: Naming the hook and the program.
    """
    import os
    import shutil

    for name in ("pre_restart", "post_ready"):
        command = getattr(config.service, name)
        if not command:
            continue
        program = command[0]
        found = shutil.which(program) if os.sep not in program else (program if os.access(program, os.X_OK) else None)
        if found is None:
            raise ConfigError(f"[service] {name} program {program!r} is not an executable file or on PATH",
                              hint=f"fix [service] {name} (an argv list like [\"/usr/local/bin/drain\", \"sglang\"]), or remove it")


def _check_stored_study(name: str, url: str, environment: Mapping[str, Any], allow_mixed: bool) -> list[float]:
    """Check a stored study's environment; return its finished trials' durations in seconds."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = read_storage(url, checked=True)  # check_run_storage read the file just before
    with stored_values(url):
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            return []  # a storage without this study: the run creates it there
        info = study_info(study)
        if info is not None and environment_binds(study):
            check_environment(info.environment, dict(environment), allow_mixed=allow_mixed)
        return [r.duration_s or 0.0 for _, r in records(study) if r.outcome in ("ok", "failed")]
