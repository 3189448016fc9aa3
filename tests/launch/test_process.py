"""The process launcher against the simulator as a real child process group."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch.conformance import START_TIMEOUT_S, Harness, LauncherConformance, free_port, sim_command
from tuner.launch.base import LaunchPhase
from tuner.launch.factory import build_launcher


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    port = free_port()
    settings = {"launcher": "process", "command": sim_command(port), "url": f"http://127.0.0.1:{port}",
                "state_dir": str(tmp_path / "state"), "log_dir": str(tmp_path / "logs"), "stop_timeout_s": 30}
    service = build_launcher(settings)
    service.start(settings["command"])  # the "service" the operator runs before tuning
    assert service.wait(START_TIMEOUT_S).phase is LaunchPhase.READY, service.logs()[-20:]
    h = Harness(settings=settings, base_argv=list(settings["command"]), url=settings["url"])
    try:
        yield h
    finally:
        build_launcher(settings).stop()  # by its recorded process group


class TestProcessLauncher(LauncherConformance):
    """The launcher contract, process launcher."""


def test_cli_launch_preview_and_restore_with_nothing_to_do(tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "state"
    config = tmp_path / "tuner.toml"
    demo = (Path(__file__).parents[2] / "configs" / "demo-sim.toml").read_text()
    config.write_text(demo.replace("30000", str(port)).replace("[service]\n", f'[service]\nstate_dir = "{state}"\n'))
    tuner = str(Path(sys.executable).parent / "tuner")
    done = subprocess.run([tuner, "launch", "--config", str(config), "--set", "mem-fraction-static=0.7"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "-0.80\n+0.7" in done.stdout and "no server running" in done.stdout
    done = subprocess.run([tuner, "restore", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "nothing to restore" in done.stdout, (done.stdout, done.stderr)
    assert not any(p.suffix == ".log" for p in state.rglob("*")), "a preview or a no-op restore started something"
    bad = subprocess.run([tuner, "launch", "--config", str(config), "--set", "oops"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "FLAG=VALUE" in bad.stderr
