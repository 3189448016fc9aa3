"""The sandbox's fallback: the systemd launcher on docker-systemctl-replacement (no NRestarts, no
journald cursors), forced here so that the fallback path is exercised even where real systemd boots."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.support.conformance import START_TIMEOUT_S
from tests.support.net import free_port
from tests.support.sandbox import boot_sandbox
from tests.support.sim import set_flag, sim_command
from tuner.launch.base import LaunchPhase
from tuner.launch.factory import build_launcher
from tuner.launch.unit import format_exec_command
from tuner.sglang.client import SGLangClient
from tuner.sglang.failures import FailureClass


def test_systemd_launcher_on_the_emulator() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = sim_command(port)
    with tempfile.TemporaryDirectory(prefix="tuner-emu-") as tmp, \
            pytest.warns(UserWarning, match="real systemd unavailable .forced by this test"), \
            boot_sandbox(Path(tmp), force_emulator="forced by this test") as box:
        assert box.kind == "emulator" and box.why_emulated == "forced by this test"
        box.add_unit("sim.service", f"[Service]\nEnvironment=PYTHONUNBUFFERED=1\nExecStart={format_exec_command(argv)}\n")
        box.systemctl_run("start", "sim.service")
        launcher = build_launcher({"launcher": "systemd", "unit": "sim", "url": url, "systemctl": box.systemctl,
                                   "journalctl": box.journalctl, "dropin_dir": str(box.unit_dir),
                                   "runtime_dropin_dir": str(box.runtime_dir),
                                   "state_dir": str(Path(tmp) / "state")})
        with launcher.session():
            launcher.start(set_flag(argv, "--mem-fraction-static", "0.1"))
            st = launcher.wait(START_TIMEOUT_S)
            assert st.phase is LaunchPhase.FAILED and st.failure is not None
            assert st.failure.failure_class is FailureClass.STARTUP_KV_OOM, st
            launcher.start(set_flag(argv, "--mem-fraction-static", "0.7"))
            assert launcher.wait(START_TIMEOUT_S).phase is LaunchPhase.READY
            with SGLangClient(url) as client:
                assert client.server_info().mem_fraction_static == 0.7
        with SGLangClient(url) as client:
            assert client.server_info().mem_fraction_static == 0.85
        assert not (box.unit_dir / "sim.service.d" / "90-tuner-trial.conf").exists()
