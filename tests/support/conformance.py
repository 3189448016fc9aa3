"""One contract test class every launcher passes (Optuna's ``StorageTestCase`` pattern).

A test module subclasses :class:`LauncherConformance` and provides a function-scoped ``harness``
fixture returning a :class:`Harness`: factory settings for a service whose original command runs
the simulator, already running and healthy on its original command. Each test then drives a real
server (the simulator) through :func:`tuner.launch.factory.build_launcher`, and checks what the
server itself reports over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.cli import TUNER
from tests.support.sim import set_flag
from tuner.errors import LaunchError, LockHeldError
from tuner.launch.base import GuardedLauncher, LaunchPhase
from tuner.launch.factory import build_launcher
from tuner.sglang.client import SGLangClient
from tuner.sglang.failures import FailureClass

START_TIMEOUT_S = 120.0
"""Generous: seven engineers share two cores. A fail-fast check must beat a quarter of it."""

_CHILD = """
import json, sys, time
from tuner.launch.factory import build_launcher
launcher = build_launcher(json.loads(sys.argv[1]))
with launcher.session():
    launcher.start(json.loads(sys.argv[2]))
    print("STARTED", flush=True)
    time.sleep(300)
"""


@dataclass
class Harness:
    """A service under test.

    Attributes:
        settings: :func:`build_launcher` settings (``state_dir`` is a fresh tmp folder).
        base_argv: The service's original command (the simulator, healthy).
        url: Its URL.
        snapshot: Returns what must be identical after a restore (e.g. the drop-in folder).
    """

    settings: dict[str, Any]
    base_argv: list[str]
    url: str
    snapshot: Callable[[], Any] = field(default=lambda: None)

    def launcher(self) -> GuardedLauncher:
        return build_launcher(self.settings)

    def server_args(self) -> dict[str, Any]:
        """The running server's ``/get_server_info`` body."""
        with SGLangClient(self.url, timeout_s=10.0) as client:
            return client.server_info().raw

    def healthy(self) -> bool:
        with SGLangClient(self.url, timeout_s=5.0) as client:
            return client.health()

    def spawn_tuner(self, argv: list[str]) -> subprocess.Popen[str]:
        """A second tuner process that enters a session, starts ``argv``, says STARTED, sleeps."""
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(self.settings), json.dumps(argv)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the child's start() returned, or it died
        if line.strip() != "STARTED":
            proc.kill()
            _, err = proc.communicate(timeout=30)
            raise AssertionError(f"tuner child failed: {line!r} {err[-2000:]}")
        return proc


def _mfs(args: dict[str, Any]) -> float:
    return float(args["mem_fraction_static"])


class LauncherConformance:
    """The launcher contract. Subclasses provide the ``harness`` fixture."""

    def test_trial_changes_flags_and_restore_puts_back_original(self, harness: Harness) -> None:
        before = harness.snapshot()
        launcher = harness.launcher()
        with launcher.session():
            assert launcher.current_argv() == harness.base_argv
            trial = set_flag(harness.base_argv, "--mem-fraction-static", "0.7")
            assert "0.7" in launcher.dry_run(trial)
            launcher.start(trial)
            st = launcher.wait(START_TIMEOUT_S)
            assert st.phase is LaunchPhase.READY, st
            assert _mfs(harness.server_args()) == pytest.approx(0.7)
            assert any("fired up and ready" in line for line in launcher.logs())
            assert launcher.state().phase is LaunchPhase.READY
        assert harness.healthy()
        assert _mfs(harness.server_args()) == pytest.approx(0.85)
        assert harness.snapshot() == before
        assert launcher.current_argv() == harness.base_argv
        assert not launcher.store.path.exists()

    def test_startup_oom_is_classified_fast_with_evidence(self, harness: Harness) -> None:
        launcher = harness.launcher()
        with launcher.session():
            launcher.start(set_flag(harness.base_argv, "--mem-fraction-static", "0.1"))
            st = launcher.wait(START_TIMEOUT_S)
            assert st.phase is LaunchPhase.FAILED, st
            assert st.failure is not None and st.failure.failure_class is FailureClass.STARTUP_KV_OOM
            assert "Not enough memory" in st.failure.evidence
            assert st.elapsed_s < START_TIMEOUT_S / 4, "classified at the timeout, not at the failure line"
        assert harness.healthy()

    def test_invalid_flag_is_classified_fast(self, harness: Harness) -> None:
        launcher = harness.launcher()
        with launcher.session():
            launcher.start([*harness.base_argv, "--no-such-flag", "1"])
            st = launcher.wait(START_TIMEOUT_S)
            assert st.phase is LaunchPhase.FAILED, st
            assert st.failure is not None and st.failure.failure_class is FailureClass.INVALID_ARGUMENTS
            assert "--no-such-flag" in st.failure.evidence
            assert st.elapsed_s < START_TIMEOUT_S / 4
        assert harness.healthy()

    def test_value_with_spaces_quotes_semicolon_reaches_server_intact(self, harness: Harness, tmp_path: Path) -> None:
        marker = tmp_path / "injected"
        value = f'a b"c;touch {marker}'
        launcher = harness.launcher()
        with launcher.session():
            launcher.start([*harness.base_argv, "--served-model-name", value])
            st = launcher.wait(START_TIMEOUT_S)
            assert st.phase is LaunchPhase.READY, st
            assert harness.server_args()["served_model_name"] == value
            assert requests.get(f"{harness.url}/v1/models", timeout=10).json()["data"][0]["id"] == value
        assert not marker.exists()
        assert harness.server_args().get("served_model_name") in (None, harness.server_args().get("model_path"))

    def test_second_tuner_is_refused_naming_the_holder(self, harness: Harness) -> None:
        child = harness.spawn_tuner(set_flag(harness.base_argv, "--mem-fraction-static", "0.7"))
        try:
            with pytest.raises(LockHeldError) as err:
                with harness.launcher().session():
                    pytest.fail("a second session was allowed")
            assert f"PID {child.pid}" in str(err.value)
            assert "-c" in str(err.value)  # the holder's command line
        finally:
            child.send_signal(signal.SIGTERM)  # the holder restores on SIGTERM
            child.communicate(timeout=START_TIMEOUT_S + 30)
        assert harness.healthy()
        assert _mfs(harness.server_args()) == pytest.approx(0.85)

    def test_sigkill_mid_start_then_tuner_restore(self, harness: Harness) -> None:
        before = harness.snapshot()
        child = harness.spawn_tuner(set_flag(harness.base_argv, "--mem-fraction-static", "0.7"))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        key = build_launcher(harness.settings).key
        state_dir = harness.settings["state_dir"]
        assert (Path(state_dir) / f"{key}.state.json").exists()
        cli = [TUNER, "restore", "--unit", key, "--state-dir", state_dir,
               "--timeout-s", str(START_TIMEOUT_S)]
        done = subprocess.run(cli, capture_output=True, text=True, timeout=START_TIMEOUT_S + 60)
        assert done.returncode == 0, done.stderr
        assert "from the state file" in done.stdout, done.stdout
        assert harness.healthy()
        assert _mfs(harness.server_args()) == pytest.approx(0.85)
        assert harness.snapshot() == before
        assert not (Path(state_dir) / f"{key}.state.json").exists()

    def test_sigterm_restores_original(self, harness: Harness) -> None:
        child = harness.spawn_tuner(set_flag(harness.base_argv, "--mem-fraction-static", "0.7"))
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=START_TIMEOUT_S + 30)
        assert child.returncode != 0
        assert "Traceback" not in err or "KeyboardInterrupt" in err
        assert harness.healthy()
        assert _mfs(harness.server_args()) == pytest.approx(0.85)

    def test_missing_server_executable_fails_cleanly(self, harness: Harness) -> None:
        launcher = harness.launcher()
        with launcher.session():
            try:  # refused at once (process) or FAILED once the manager tried (systemd: 203/EXEC)
                launcher.start(["/nonexistent/python", "-m", "sglang.launch_server"])
                st = launcher.wait(START_TIMEOUT_S)
                assert st.phase is LaunchPhase.FAILED and st.failure is not None, st
                assert st.elapsed_s < START_TIMEOUT_S / 4
            except LaunchError as err:
                assert "\n" not in str(err) and "/nonexistent/python" in str(err)
        assert harness.healthy()
