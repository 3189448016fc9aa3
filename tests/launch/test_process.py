"""The process launcher against the simulator as a real child process group."""

from __future__ import annotations

import shlex
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import TUNER, one_error_line, run_tuner
from tests.support.configs import config_copy
from tests.support.conformance import START_TIMEOUT_S, Harness, LauncherConformance
from tests.support.net import free_port
from tests.support.sim import set_flag, sim_command
from tuner.errors import LaunchError
from tuner.launch.base import LaunchPhase
from tuner.launch.factory import build_launcher
from tuner.sglang.client import SGLangClient


def sim_demo_argv(config: Path, mem_fraction_static: str) -> list[str]:
    """The demo config's server command as the tuner runs it, with another mem_fraction_static."""
    from tuner.config import load_config

    argv = list(load_config(config).service.command)
    return [mem_fraction_static if word == "0.80" else word for word in argv]


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


def test_a_lasting_session_commits_keeps_its_state_when_cut_short_and_refuses_leftovers(harness: Harness) -> None:
    """``session(restore_on_exit=False)`` (what ``tuner apply`` uses): commit keeps the change; a
    session cut short after a start keeps its state file, which a lasting session refuses and
    ``restore`` puts back; one left before any start removes its state file."""
    launcher = build_launcher(harness.settings)
    state = launcher.store.path

    def mem_fraction_static() -> float:
        with SGLangClient(harness.url) as client:
            return client.server_info().mem_fraction_static

    with launcher.session(restore_on_exit=False):
        assert state.is_file()  # written before any change
    assert not state.exists() and mem_fraction_static() == 0.85  # nothing started, nothing to put back
    with launcher.session(restore_on_exit=False):
        launcher.start(set_flag(harness.base_argv, "--mem-fraction-static", "0.7"))
        assert launcher.wait(START_TIMEOUT_S).phase is LaunchPhase.READY, launcher.logs()[-20:]
        launcher.commit()
    assert not state.exists() and mem_fraction_static() == 0.7  # the change stays
    with pytest.raises(RuntimeError, match="cut short"), launcher.session(restore_on_exit=False):
        launcher.start(set_flag(harness.base_argv, "--mem-fraction-static", "0.75"))
        raise RuntimeError("cut short")
    assert state.is_file()
    with pytest.raises(LaunchError, match="left its state"), launcher.session(restore_on_exit=False):
        pass
    assert state.is_file()
    assert launcher.restore(timeout_s=START_TIMEOUT_S).phase is LaunchPhase.READY
    assert not state.exists() and mem_fraction_static() == 0.85  # the recorded original: the service's command
    with pytest.raises(LaunchError, match="no session is open"):
        launcher.commit()


def test_cli_launch_preview_and_restore_with_nothing_to_do(tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "state"
    config = config_copy("demo-sim.toml", tmp_path, port=port)
    done = run_tuner("launch", "--config", str(config), "--set", "mem-fraction-static=0.7", timeout_s=120)
    assert done.returncode == 0, done.stderr
    first, second, command, *change = done.stdout.split("\n")
    assert first == "No server of this launcher is running, so there is nothing to stop."
    assert second == f"Would start this command in a new process group, logging to {state / 'logs' / f'process-{port}.log'}:"
    python, *args = shlex.split(command)  # {python} is the tuner's own interpreter
    assert command.startswith("  ") and Path(python).parent == Path(TUNER).parent and args == sim_demo_argv(config, "0.7")[1:]
    assert change == ["Command change:", "--- current argv", "+++ trial argv", "@@ -8,3 +8,3 @@",
                      " --mem-fraction-static", "-0.80", "+0.7", " --host", "", ""]
    done = run_tuner("restore", "--config", str(config), timeout_s=120)
    assert done.returncode == 0 and "nothing to restore" in done.stdout, (done.stdout, done.stderr)
    assert not any(p.suffix == ".log" for p in state.rglob("*")), "a preview or a no-op restore started something"


@pytest.mark.parametrize(("setting", "needles"), [
    ("oops", ("FLAG=VALUE",)),
    ("mem-fraction-static=1.7", ("mem_fraction_static=1.7", "outside (0, 1)")),
    ("mem-fraction-static=abc", ("--mem-fraction-static", "'abc'", "not a number")),
    ("bogus-flag=3", ("SGLang 0.5.5 has no flag --bogus-flag",)),
    ("max-running-requests=0", ("max_running_requests=0", "at least 1")),
    ("chunked-prefill-size=big", ("--chunked-prefill-size", "not an integer")),
    ("enable-hierarchical-cache=maybe", ("is a switch",)),
    ("port=99999", ("port=99999", "outside 1-65535")),  # review N12: was accepted
])
def test_cli_launch_checks_each_set_against_the_flag_table(tmp_path: Path, setting: str, needles: tuple[str, ...]) -> None:
    config = config_copy("demo-sim.toml", tmp_path, port=free_port())
    done = run_tuner("launch", "--config", str(config), "--set", setting, timeout_s=120)
    one_error_line(done, *needles)
    assert done.stdout == ""


def test_cli_launch_refuses_a_flag_set_twice(tmp_path: Path) -> None:
    """``--set A=0.9 --set A=0.8`` took the last without a word (review N12)."""
    config = config_copy("demo-sim.toml", tmp_path, port=free_port())
    done = run_tuner("launch", "--config", str(config), "--set", "mem-fraction-static=0.9", "--set",
                     "mem_fraction_static=0.8", timeout_s=120)
    one_error_line(done, "--mem-fraction-static twice", "give each flag once")


def test_cli_launch_offers_no_real_launch(tmp_path: Path) -> None:
    done = run_tuner("launch", "--config", str(config_copy("demo-sim.toml", tmp_path, port=free_port())), "--no-dry-run", timeout_s=120)
    one_error_line(done, "--no-dry-run", code=2)


def test_a_foreign_server_on_the_port_is_refused_before_any_start(tmp_path: Path) -> None:
    """Another program accepting connections on the URL's port: one line naming the port, no start."""
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        port = foreign.getsockname()[1]
        settings = {"launcher": "process", "command": sim_command(port), "url": f"http://127.0.0.1:{port}",
                    "state_dir": str(tmp_path / "state"), "log_dir": str(tmp_path / "logs")}
        launcher = build_launcher(settings)
        with pytest.raises(LaunchError, match=f"port {port} of http://127.0.0.1:{port} is already in use"):
            with launcher.session():
                pytest.fail("a session began although it could not start its server")
        with pytest.raises(LaunchError, match=f"port {port} .* in use"):
            launcher.start(settings["command"])
        assert not (tmp_path / "logs").exists() and not launcher.record_path.exists()
        done = run_tuner("run", "--config", str(config_copy("demo-sim.toml", tmp_path, port=port)), "--budget", "3m", timeout_s=180, cwd=tmp_path)
        one_error_line(done, f"port {port}", "free port")
