"""The simulated host's RAM: pinned HiCache pools per rank x ranks, reported and enforced.

``--sim-host-memory-gib`` is one host for every rank; SGLang's own check (available - 10 GiB per
rank, in rank order) fails startup with its ValueError; a limit the pools are charged to
(``--sim-memory-max``, a unit's ``MemoryMax=``) is crossed silently by that check and ends in an
OOM kill (SIGKILL, no traceback). ``/sim/host_memory`` reports what is pinned.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.support.sim import run_to_exit, spawn, wait_ready
from tuner.sim.models import GIB
from tuner.sim.startup import cgroup_memory_max, plan_from_argv

TP4 = ["--model-path", "llama-3.1-8b", "--tp", "4", "--enable-hierarchical-cache", "--max-total-tokens", "200000"]


def test_pools_are_per_rank_and_the_host_is_one() -> None:
    # 20 GB per rank x 4 ranks = 80 GB; a 100 GiB host passes SGLang's check rank by rank ...
    _, ok = plan_from_argv([*TP4, "--hicache-size", "20", "--sim-host-memory-gib", "100"])
    assert ok.failure is None and ok.hicache_host_bytes / 1e9 == pytest.approx(20, abs=0.01)
    # ... a 70 GiB (75.2 GB) one fails at rank 3: 75.2 - 10.7 (10 GiB) - 3 x 20 = 4.4 GB free.
    _, tight = plan_from_argv([*TP4, "--hicache-size", "20", "--sim-host-memory-gib", "70"])
    assert tight.failure is not None and tight.failure.kind == "host_memory" and tight.failure.rank == 3
    # A 50 GiB limit on the service: SGLang's check passes (512 GiB host), the kernel kills at rank 2.
    _, killed = plan_from_argv([*TP4, "--hicache-size", "20", "--sim-memory-max", "50"])
    assert killed.failure is not None and killed.failure.kind == "host_oom_kill" and killed.failure.rank == 2
    assert killed.failure.requested_bytes == 3 * killed.hicache_host_bytes
    assert killed.failure.free_bytes == 50 * GIB


def test_cgroup_limit_is_read_from_v2_and_v1(tmp_path: Path) -> None:
    (tmp_path / "v2" / "system.slice" / "sim.service").mkdir(parents=True)
    (tmp_path / "v2" / "system.slice" / "sim.service" / "memory.max").write_text("8589934592\n")
    (tmp_path / "cg2").write_text("0::/system.slice/sim.service\n")
    assert cgroup_memory_max(str(tmp_path / "cg2"), str(tmp_path / "v2")) == 8 * GIB
    (tmp_path / "v2" / "system.slice" / "sim.service" / "memory.max").write_text("max\n")
    assert cgroup_memory_max(str(tmp_path / "cg2"), str(tmp_path / "v2")) is None
    (tmp_path / "v1" / "memory" / "system.slice" / "sim.service").mkdir(parents=True)
    limit = tmp_path / "v1" / "memory" / "system.slice" / "sim.service" / "memory.limit_in_bytes"
    limit.write_text("4294967296\n")
    (tmp_path / "cg1").write_text("4:memory:/system.slice/sim.service\n0::/\n")
    assert cgroup_memory_max(str(tmp_path / "cg1"), str(tmp_path / "v1")) == 4 * GIB
    limit.write_text("9223372036854771712\n")
    assert cgroup_memory_max(str(tmp_path / "cg1"), str(tmp_path / "v1")) is None


def test_host_memory_failures_as_the_server_and_the_host_fail(tmp_path: Path) -> None:
    status, log = run_to_exit([*TP4, "--hicache-size", "20", "--sim-host-memory-gib", "70"], tmp_path)
    assert status == -9 or status == 137
    assert "ValueError: Not enough host memory available. Requesting 20.00 GB but only have 4.42 GB free" in log
    status, log = run_to_exit([*TP4, "--hicache-size", "20", "--sim-memory-max", "50"], tmp_path)
    assert status in (-9, 137)
    assert log.count("Allocating 20.00 GB host memory for hierarchical KV cache.") == 2  # ranks 0, 1
    assert "Traceback" not in log and "ValueError" not in log


def test_host_memory_endpoint(tmp_path: Path) -> None:
    sim = spawn([*TP4, "--hicache-size", "20", "--sim-host-memory-gib", "100", "--sim-memory-max", "90"], tmp_path)
    try:
        wait_ready(sim)
        body = requests.get(sim.url + "/sim/host_memory", timeout=10).json()
    finally:
        sim.stop()
    per_rank = body["pinned_per_rank_bytes"]
    assert per_rank / 1e9 == pytest.approx(20, abs=0.01) and body["ranks"] == 4
    assert body["pinned_bytes"] == 4 * per_rank
    assert body["total_bytes"] == 100 * GIB and body["available_bytes"] == 100 * GIB - 4 * per_rank
    assert body["cgroup_max_bytes"] == 90 * GIB and body["hicache_host_tokens"] > 0
