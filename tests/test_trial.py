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
