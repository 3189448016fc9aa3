"""GPU monitor: NVML's one-line error without a driver; the simulator's ledger as a real backend."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.conformance import START_TIMEOUT_S
from tests.support.net import free_port
from tests.support.sim import set_flag, sim_command
from tuner.errors import GPUError
from tuner.gpu import GPUMonitor, NvmlBackend, SimBackend
from tuner.launch.base import LaunchPhase
from tuner.launch.process import ProcessLauncher


def test_nvml_without_driver_is_one_line_else_reads_memory() -> None:
    try:
        backend = NvmlBackend()
    except GPUError as err:  # the usual case on CI: no NVIDIA driver
        assert "\n" not in str(err) and "NVML" in str(err) and "sim" in str(err)
        with pytest.raises(GPUError):
            GPUMonitor.for_target("nvml")
        return
    try:  # a machine with a driver: the real figures
        mem = backend.memory()
        assert mem and all(g.total_mib > 0 and 0 <= g.used_mib <= g.total_mib for g in mem)
        assert backend.driver_version()
    finally:
        backend.close()


def test_sim_ledger_window_release_and_launcher_wait(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    monitor = GPUMonitor(SimBackend(url), poll_s=0.1)
    assert monitor.snapshot() == [] and monitor.wait_released(timeout_s=1.0) == []  # nothing runs yet
    launcher = ProcessLauncher(sim_command(port), url=url, state_dir=tmp_path, gpu=monitor)
    with launcher.session():
        launcher.start(set_flag(launcher.current_argv(), "--mem-fraction-static", "0.8"))
        assert launcher.wait(START_TIMEOUT_S).phase is LaunchPhase.READY
        (gpu,) = monitor.snapshot()
        assert gpu.total_mib == pytest.approx(80 * 1024, rel=0.02) and gpu.used_mib > 0.7 * gpu.total_mib
        with monitor.window() as window:
            time.sleep(0.35)
        (peak,) = window.peaks
        assert peak.samples >= 2 and peak.peak_used_mib >= peak.min_used_mib >= 0.7 * gpu.total_mib
        with pytest.raises(GPUError) as err:  # the running server holds its memory
            monitor.wait_released(timeout_s=0.3)
        assert "GPU0" in str(err.value) and "\n" not in str(err.value)
        assert monitor.wait_released(timeout_s=5.0, allow_foreign=True)  # usage is stable
        # a second start stops the first and waits for its memory before starting (§1.2)
        launcher.start(set_flag(launcher.current_argv(), "--mem-fraction-static", "0.7"))
        assert launcher.wait(START_TIMEOUT_S).phase is LaunchPhase.READY
        assert monitor.snapshot()[0].used_mib < gpu.used_mib
    assert monitor.wait_released(timeout_s=10.0) == []
