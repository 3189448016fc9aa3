"""``tuner restore`` and ``tuner launch``: put the service back, or start it with flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from tuner.cli.common import (
    STATE_DIR_DEFAULT,
    app,
    check_seconds,
    check_state_dir,
    console,
    non_empty_path,
    non_empty_text,
)


def _launch_settings(config: Path | None, unit: str | None, state_dir: Path | None,
                     systemctl: str | None, journalctl: str | None, dropin_dir: Path | None,
                     url: str | None, runtime_dropin_dir: Path | None = None) -> dict[str, Any] | None:  # fmt: skip
    """The [service] settings of --config, overridden by the explicit options (None if neither)."""
    settings: dict[str, Any] = {}
    if config is not None:
        from tuner.config import load_config

        settings = load_config(config).service.model_dump()
    overrides = {"unit": unit, "state_dir": state_dir, "systemctl": systemctl, "journalctl": journalctl,
                 "dropin_dir": dropin_dir, "runtime_dropin_dir": runtime_dropin_dir, "url": url}  # fmt: skip
    settings.update({k: str(v) for k, v in overrides.items() if v is not None})
    return settings or None


def _check_unit_is_the_configs(config: Path, unit: str) -> None:
    """``--unit`` beside ``--config`` must name the config's own service (``sglang.service``, or
    the process launcher's ``process-<port>``); another one silently replaced it (review #189).

    Raises:
        ConfigError: ``unit`` names another service.
    """
    from tuner.config import load_config
    from tuner.errors import ConfigError
    from tuner.launch.factory import build_launcher

    own = build_launcher(load_config(config).service.model_dump()).key
    if own in (unit, f"{unit}.service") or unit == f"{own}.service":
        return
    raise ConfigError(f"--unit {unit} is not the service of --config {config} ({own})",
                      hint=f"pass --config alone to restore {own}, or --unit alone for another service")


@app.command("restore", short_help='Put the service back as it was before a tuning run.')
def restore_cmd(
    unit: Annotated[str | None, typer.Option("--unit", parser=non_empty_text, help="The unit (or process launcher name) to put back.")] = None,
    config: Annotated[Path | None, typer.Option("--config", parser=non_empty_path, help="The run's TOML config (its service section).")] = None,
    state_dir: Annotated[Path | None, typer.Option("--state-dir", parser=non_empty_path, help="Folder of the run's state files.", show_default=STATE_DIR_DEFAULT)] = None,
    systemctl: Annotated[str | None, typer.Option(parser=non_empty_text, help="systemctl command (e.g. 'nsenter -t PID -m -p systemctl').")] = None,
    journalctl: Annotated[str | None, typer.Option(parser=non_empty_text, help="journalctl command.")] = None,
    dropin_dir: Annotated[Path | None, typer.Option(parser=non_empty_path, help="Folder holding <unit>.d/.")] = None,
    runtime_dropin_dir: Annotated[Path | None, typer.Option(parser=non_empty_path, help="systemd's runtime unit folder, holding a trial's <unit>.d/ (default /run/systemd/system).")] = None,
    url: Annotated[str | None, typer.Option(parser=non_empty_text, help="Server URL checked for health.")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Seconds the server may take to be healthy.")] = 900.0,
) -> None:
    """Put the service back as it was before a tuning run (after a crash, kill -9 or Ctrl-C).

    Uses the state file the run wrote before its first change: the original command and
    drop-ins come back, the trial drop-in goes, and the server is restarted and checked healthy.
    """
    from tuner.errors import ConfigError
    from tuner.launch.factory import restore_service

    check_seconds(timeout_s, "--timeout-s")
    if unit is None and config is None:
        raise ConfigError("tuner restore needs the service", hint="pass --unit UNIT or --config FILE")
    check_state_dir(state_dir)
    if config is not None and unit is not None:
        _check_unit_is_the_configs(config, unit)
    settings = _launch_settings(config, unit, state_dir, systemctl, journalctl, dropin_dir, url, runtime_dropin_dir)
    launcher, state, source = restore_service(settings, unit=unit, state_dir=state_dir, timeout_s=timeout_s)
    shown = " ".join(launcher.current_argv())
    if source == "nothing" and state_dir is not None and not state_dir.exists():
        # A mistyped folder finds no state file: "nothing to restore" with exit 0 would hide the real one.
        raise ConfigError(f"--state-dir {state_dir} does not exist and {launcher.key} has no trial change to undo",
                          hint="pass the folder the run wrote its state file to, or leave --state-dir out for the default")
    if source == "nothing":
        console.print(f"{launcher.key}: nothing to restore (no state file, no trial drop-in); the service is "
                      f"{state.phase.value}",
                      highlight=False, soft_wrap=True)  # fmt: skip
        return
    if source == "already original":
        console.print(f"{launcher.key} already runs its own command ({state.phase.value}): removed the state file, "
                      f"restarted nothing; command: {shown}", highlight=False, soft_wrap=True)  # fmt: skip
        return
    console.print(f"restored {launcher.key} from the {source}: {state.phase.value}, command: {shown}",
                  highlight=False, soft_wrap=True)  # fmt: skip


@app.command("launch", short_help="Preview a trial's drop-in or command for --set flags.")
def launch_cmd(
    config: Annotated[Path, typer.Option("--config", parser=non_empty_path, help="The run's TOML config (its service section).")],
    set_flags: Annotated[list[str] | None, typer.Option("--set", metavar="FLAG=VALUE", help="A flag to change, e.g. mem-fraction-static=0.8; repeat --set for several (--set A=1 --set B=2); checked against the service's SGLang flags.")] = None,
) -> None:
    """Preview a trial: the drop-in (or command) the tuner would write for --set flags. Changes nothing.

    Starting a trial for real is `tuner run`'s job: it holds the lock and restores the service.
    After the preview the service checks a run makes first are made (exit 1 with the reason when one fails).
    """
    from tuner.config import check_url_matches_port, load_config
    from tuner.entrypoints import resolve_flag_table, resolve_launcher
    from tuner.launch.preview import parse_settings, preview
    from tuner.preflight import check_service

    cfg = load_config(config)
    launcher = resolve_launcher(cfg)
    table = resolve_flag_table(cfg, launcher.current_argv())
    port = parse_settings(set_flags or [], table).get("port")
    if port is not None:  # a trial on another port than [service] url would wait its whole start timeout
        check_url_matches_port(cfg.service.url, ["--port", str(port)])
    text = preview(launcher, set_flags or [], table)
    console.print(text, highlight=False, soft_wrap=True, markup=False)
    check_service(launcher)  # after the preview: what `tuner run` would refuse this service for (exit 1)
