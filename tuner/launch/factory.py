"""Build a launcher from plain settings, and restore a service from the state a session left.

Settings are a dict or any object with these attributes (``tuner.config.ServiceSection`` has them):
``launcher`` (``"systemd"`` | ``"process"``), ``unit``, ``command``, ``url``, ``systemctl``,
``journalctl``, ``dropin_dir``, ``runtime_dropin_dir``, ``state_dir``, ``log_dir``, ``workdir``, ``allow_foreign``,
``stop_timeout_s``; and ``dropin_name`` (systemd: the drop-in file a start writes; default the
trial's ``90-tuner-trial.conf``; ``tuner apply`` passes ``80-tuner.conf``). Every session records
the settings it was built from in its state file, so ``tuner restore --unit U`` rebuilds the very
launcher a killed tuner used (its ``nsenter`` prefix, its drop-in folder) from the state file alone.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner.errors import LaunchError
from tuner.launch.base import GuardedLauncher, LaunchState
from tuner.launch.process import ProcessLauncher
from tuner.launch.session import StateStore, default_state_dir
from tuner.launch.systemd import TRIAL_DROPIN, SystemdLauncher
from tuner.launch.unit import DEFAULT_DROPIN_DIR, DEFAULT_RUNTIME_DROPIN_DIR

__all__ = ["SETTING_KEYS", "build_launcher", "restore_service"]

SETTING_KEYS = ("launcher", "unit", "command", "url", "systemctl", "journalctl", "dropin_dir", "runtime_dropin_dir",
                "state_dir", "log_dir", "workdir", "allow_foreign", "stop_timeout_s", "dropin_name")
"""The settings :func:`build_launcher` reads (others are ignored)."""


def _get(settings: Mapping[str, Any] | Any, key: str) -> Any:
    if isinstance(settings, Mapping):
        return settings.get(key)
    return getattr(settings, key, None)


def _argv(value: Any, what: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
        return list(value)
    raise LaunchError(f"{what} must be a command line (a string or a list of strings), not {value!r}",
                      hint=f"write {what} = [\"systemctl\"] or a string")


def build_launcher(settings: Mapping[str, Any] | Any, *, gpu: Any | None = None) -> GuardedLauncher:
    """A :class:`SystemdLauncher` or :class:`ProcessLauncher` from settings (see module docstring).

    Args:
        settings: Dict or object with the keys of :data:`SETTING_KEYS`.
        gpu: Optional :class:`tuner.gpu.GPUMonitor` checked before each start.

    Returns:
        The launcher; it records ``settings`` in its state file for ``tuner restore``.

    Raises:
        LaunchError: ``launcher`` is unknown, or ``unit`` / ``command`` is missing or malformed.
    """
    kind = _get(settings, "launcher") or "systemd"
    url = _get(settings, "url") or "http://127.0.0.1:30000"
    state_dir = Path(_get(settings, "state_dir") or default_state_dir())
    common: dict[str, Any] = {"url": url, "state_dir": state_dir, "gpu": gpu,
                              "allow_foreign": bool(_get(settings, "allow_foreign"))}
    if _get(settings, "stop_timeout_s"):
        common["release_timeout_s"] = float(_get(settings, "stop_timeout_s"))
    if kind == "systemd":
        unit = _get(settings, "unit")
        if not unit:
            raise LaunchError("the systemd launcher needs a unit", hint="set unit = \"sglang.service\" or pass --unit")
        launcher: GuardedLauncher = SystemdLauncher(
            unit,
            systemctl=_argv(_get(settings, "systemctl"), "systemctl") or ["systemctl"],
            journalctl=_argv(_get(settings, "journalctl"), "journalctl") or ["journalctl"],
            dropin_dir=_get(settings, "dropin_dir") or DEFAULT_DROPIN_DIR,
            runtime_dropin_dir=_get(settings, "runtime_dropin_dir") or DEFAULT_RUNTIME_DROPIN_DIR,
            dropin_name=_get(settings, "dropin_name") or TRIAL_DROPIN,
            **common,
        )
    elif kind == "process":
        command = _argv(_get(settings, "command"), "command")
        if not command:
            raise LaunchError("the process launcher needs the server command",
                              hint="set command = [\"python\", \"-m\", \"sglang.launch_server\", ...]")
        launcher = ProcessLauncher(command, name=_get(settings, "unit"), log_dir=_get(settings, "log_dir"),
                                   cwd=_get(settings, "workdir"), **common)
    else:
        raise LaunchError(f"unknown launcher {kind!r}", hint="use launcher = \"systemd\" or \"process\"")
    launcher.settings = {k: _jsonable(_get(settings, k)) for k in SETTING_KEYS if _get(settings, k) is not None}
    launcher.settings.update({"launcher": kind, "url": url, "state_dir": str(state_dir), "unit": launcher.key})
    return launcher


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def restore_service(
    settings: Mapping[str, Any] | Any | None = None,
    *,
    unit: str | None = None,
    state_dir: Path | str | None = None,
    timeout_s: float = 900.0,
    gpu: Any | None = None,
) -> tuple[GuardedLauncher, LaunchState, str]:
    """Put a service back as it was before a tuning session (``tuner restore``).

    With a state file left by a session (after a crash or ``kill -9``) its recorded settings and
    original are used; without one the service is reset to its own configuration (the trial
    drop-in removed) and restarted if it was running.

    Args:
        settings: Launcher settings (the config's ``[service]``); optional when ``unit`` names a
            state file.
        unit: The unit (or process launcher name) whose state file to use.
        state_dir: Folder of state files (default: the settings', else the default).
        timeout_s: Limit for the service to become healthy.
        gpu: Optional GPU monitor.

    Returns:
        ``(launcher, final state, what was restored)``: ``"state file"``, ``"leftover trial
        change"`` (no state file, but a stray trial drop-in was removed), ``"already original"``
        (a state file, but the service already ran its own command, healthy: only the file was
        removed, nothing restarted) or ``"nothing"``.

    Raises:
        LockHeldError: A live tuner holds the unit.
        LaunchError: Nothing identifies the service, or it did not come back healthy.
    """
    folder = Path(state_dir or (settings is not None and _get(settings, "state_dir")) or default_state_dir())
    key = unit or (settings is not None and _get(settings, "unit")) or None
    recorded = None
    if key:
        for candidate in (key, key if "." in key else f"{key}.service"):
            recorded = StateStore(folder, candidate).load()
            if recorded is not None:
                break
    if recorded is not None and recorded.extra.get("settings"):
        base = dict(recorded.extra["settings"])
        if settings is not None:
            base.update({k: _get(settings, k) for k in SETTING_KEYS if _get(settings, k) is not None})
        base["state_dir"] = str(folder)
        launcher = build_launcher(base, gpu=gpu)
    elif settings is not None:
        launcher = build_launcher({**{k: _get(settings, k) for k in SETTING_KEYS}, "state_dir": str(folder)}, gpu=gpu)
    elif unit:
        launcher = build_launcher({"launcher": "systemd", "unit": unit, "state_dir": str(folder)}, gpu=gpu)
    else:
        raise LaunchError("nothing to restore: no unit and no config given", hint="pass --unit UNIT or --config FILE")
    if launcher.store.load() is not None:
        source = "state file"
    elif launcher.has_leftover_change():
        source = "leftover trial change"
    else:
        source = "nothing"
    state = launcher.restore(timeout_s=timeout_s)
    return launcher, state, "already original" if launcher.already_original else source
