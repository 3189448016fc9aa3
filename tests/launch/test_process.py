"""The process launcher against the simulator as a real child process group."""

from __future__ import annotations

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
