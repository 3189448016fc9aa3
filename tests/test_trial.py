"""A study's environment tag: the GPU size comes from the device's own reading, never its name."""

from __future__ import annotations

from pathlib import Path

from tests.support.sim import spawn, wait_ready
from tuner.config import parse_config
from tuner.entrypoints import resolve_environment as detect_environment
from tuner.gpu import GPUMonitor
from tuner.sglang.flags import FlagTable


def test_sim_gpu_size_is_read_from_the_ledger(tmp_path: Path) -> None:
    args = ["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--mem-fraction-static", "0.9"]
    sim = spawn(args, tmp_path)
    try:
        wait_ready(sim)
        config = parse_config({
            "study": {"name": "env"},
            "service": {"launcher": "process", "command": ["python", "-m", "tuner.sim", *args], "url": sim.url},
            "workload": {"kind": "random", "input_len": 512, "output_len": 64},
        })
        argv = ["python", "-m", "tuner.sim", *args]
        env = detect_environment(config, argv, FlagTable.for_version("0.5.5"), GPUMonitor.for_target("sim", sim.url))
    finally:
        sim.stop()
    assert env["gpu_name"] == "L4-24GB"
    assert env["gpu_total_mib"] == 23034  # nvidia-smi's L4 size, not 24 × 1024
    assert env["driver_version"] == "simulated"


def test_identity_does_not_depend_on_whether_the_unit_runs(tmp_path: Path) -> None:
    """A systemd unit running the simulator, read while it serves and after it stopped (a resume
    after a kill at daemon-reload): the same environment identity, so the resume is not refused."""
    from tuner.study.optuna_io import check_environment

    args = ["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--mem-fraction-static", "0.9"]
    sim = spawn(args, tmp_path)
    argv = ["python", "-m", "tuner.sim", *args]
    config = parse_config({
        "study": {"name": "env"},
        "service": {"launcher": "systemd", "unit": "sglang-sim.service", "url": sim.url, "gpu_monitor": "sim"},
        "workload": {"kind": "random", "input_len": 512, "output_len": 64},
    })
    table = FlagTable.for_version("0.5.5")
    monitor = GPUMonitor.for_target("sim", sim.url)
    try:
        wait_ready(sim)
        running = detect_environment(config, argv, table, monitor)
    finally:
        sim.stop()
    stopped = detect_environment(config, argv, table, monitor)
    keys = ("sglang_version", "gpu_name", "gpu_count", "driver_version", "model")
    assert {k: running.get(k) for k in keys} == {k: stopped.get(k) for k in keys}
    assert stopped["gpu_name"] == "L4-24GB"
    check_environment(running, stopped, allow_mixed=False)  # raises StudyError when they differ
