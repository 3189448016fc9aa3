"""``tuner init``: a starter config, for the simulator or read from a running systemd unit.

The templates are data files (``tuner/data/starter-sim.toml``, ``tuner/data/starter-unit.toml``),
filled in with :meth:`str.format`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

from tuner.launch.unit import SystemdUnit
from tuner.sglang.flags import flag_value

__all__ = ["starter_config"]


def _template(name: str) -> str:
    return resources.files("tuner.data").joinpath(name).read_text(encoding="utf-8")


def starter_config(*, unit: str | None, sim: bool) -> str:
    """A starter config: for the simulator, or read from a running systemd unit.

    From a unit it reads ``ExecStart`` (the interpreter, ``--model-path``, ``--port``) and names the
    Python that runs SGLang, so flags and version are introspected from the installed SGLang.

    Raises:
        LaunchError: The unit is unknown or its ExecStart unreadable.
    """
    if sim or not unit:
        # "{python}" stays a placeholder ([service] command): the file must not pin this venv.
        return _template("starter-sim.toml").format()
    systemd_unit = SystemdUnit(unit)
    systemd_unit.check_exists()
    argv = list(systemd_unit.exec_command().argv)

    python = argv[0] if argv and "python" in Path(argv[0]).name else None
    model = flag_value(argv, "--model-path", "--model")
    config_json = Path(model) / "config.json" if model else None
    port = flag_value(argv, "--port") or "30000"
    name = unit.removesuffix(".service").replace("@", "-")
    return _template("starter-unit.toml").format(
        unit=unit, when=datetime.now(UTC).date().isoformat(), name=name,
        url=f"http://127.0.0.1:{port}",
        python_line=f'python = "{python}"\n' if python else "",
        model_line=(f'config_json = "{config_json}"\n' if config_json and config_json.exists() else "")
        + (f'name = "{model}"\n' if model else ""),
    )
