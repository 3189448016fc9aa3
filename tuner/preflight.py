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
from tuner.errors import ConfigError, StudyError
from tuner.knobs import check_listed_levers
from tuner.load.quality import read_tasks
from tuner.sglang.flags import flag_int
from tuner.study.budget import Budget, prior_trial_cost_s, require_one_trial
from tuner.study.optuna_io import check_environment, environment_binds, records, study_info
from tuner.study.storage import (
    check_artifacts_folder,
    check_run_storage,
    read_storage,
    stored_values,
    study_storage_url,
)

__all__ = ["check_run", "check_service"]


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
                          reserve_s=config.budget.restore_reserve_s)
    check_hooks(config)
    check_paths(config)
    check_service(launcher)


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
