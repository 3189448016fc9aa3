"""The hierarchical cache's host pool: per rank x ranks, version defaults, the fit check's arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.launch.hostmem import cgroup_limit, meminfo, read_host_memory
from tuner.sglang.hicache import (
    GIB,
    HostMemory,
    check_host_fit,
    host_pool,
    preferred_size_knob,
)

CELL_8B_TP4 = 32 * 2 * 2 * 128 * 2  # 32 layers x 2 kv heads/rank x (k+v) x 128 x bf16 = 32 KiB


def test_pool_is_per_rank_page_rounded_and_version_aware() -> None:
    assert host_pool({}, device_tokens=1000, cell_bytes=CELL_8B_TP4, ranks=4, version="0.5.5") is None
    by_size = host_pool({"enable_hierarchical_cache": True, "hicache_size": 40}, device_tokens=10**6,
                        cell_bytes=CELL_8B_TP4, ranks=4, version="0.5.5")
    assert by_size is not None and by_size.tokens_per_rank == 40 * 10**9 // CELL_8B_TP4 + 1
    assert by_size.total_bytes == 4 * by_size.bytes_per_rank and by_size.total_bytes / 1e9 == pytest.approx(160, abs=0.01)
    by_ratio = host_pool({"enable_hierarchical_cache": True}, device_tokens=100_000, cell_bytes=1000, ranks=8,
                         version="0.5.5", page_size=64)
    assert by_ratio is not None and by_ratio.tokens_per_rank == (200_000 // 64 + 1) * 64  # default ratio 2
    auto = host_pool({"enable_hierarchical_cache": True}, device_tokens=5 * 10**7, cell_bytes=1000, ranks=2,
                     version="0.5.23", host_total_bytes=64 * GIB)
    assert auto is not None and auto.total_bytes == pytest.approx(0.8 * 64 * GIB, rel=1e-4)
    assert preferred_size_knob("0.5.5") == "hicache_ratio" and preferred_size_knob("0.5.23") == "hicache_size"


def test_fit_names_the_arithmetic_and_the_tighter_limit() -> None:
    pool = host_pool({"enable_hierarchical_cache": True, "hicache_size": 40}, device_tokens=1, cell_bytes=CELL_8B_TP4,
                     ranks=4, version="0.5.5")
    assert pool is not None
    roomy = HostMemory(mem_total_bytes=256 * GIB, mem_available_bytes=240 * GIB)
    fit = check_host_fit(pool, roomy)
    assert fit.fits and fit.limit == "host" and "160.00 GB" in fit.reason and "fits" in fit.reason
    # case-16: tp 4 x 40 GB on a 256 GB host whose page cache left 150 GiB available.
    busy = HostMemory(mem_total_bytes=256 * GIB, mem_available_bytes=150 * GIB)
    miss = check_host_fit(pool, busy)
    assert not miss.fits and miss.limit == "host"
    assert "40.00 GB per rank × 4 ranks = 160.00 GB" in miss.reason and "MemAvailable 150.0 GiB" in miss.reason
    assert "10.0 GiB SGLang reserve" in miss.reason and "12.8 GiB margin" in miss.reason  # 5 % of 256 GiB
    # The pools the running server pins now come back at its restart.
    assert check_host_fit(pool, busy.model_copy(update={"pinned_now_bytes": 40 * GIB})).fits
    # A unit limit is tighter than the host: the reason names MemoryMax.
    capped = roomy.model_copy(update={"cgroup_max_bytes": 100 * GIB, "cgroup_current_bytes": 3 * GIB})
    cg = check_host_fit(pool, capped)
    assert not cg.fits and cg.limit == "cgroup" and "MemoryMax: 100.0 GiB − 3.0 GiB other use − 5.0 GiB margin" in cg.reason


def test_host_readers(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:       65536000 kB\nMemFree: 100 kB\nMemAvailable:   32768000 kB\n")
    assert meminfo(str(tmp_path / "meminfo")) == {"MemTotal": 65536000 * 1024, "MemFree": 102400,
                                                  "MemAvailable": 32768000 * 1024}
    cg = tmp_path / "cg" / "system.slice" / "x.service"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text("8589934592\n")
    (cg / "memory.current").write_text("1048576\n")
    assert cgroup_limit(root=str(tmp_path / "cg"), group="/system.slice/x.service") == (8 * GIB, 1048576)
    real = read_host_memory(["python", "-m", "sglang.launch_server"], meminfo_path=str(tmp_path / "meminfo"),
                            cgroup_root=str(tmp_path / "none"), pinned_now_bytes=5)
    assert real.mem_available_bytes == 32768000 * 1024 and real.pinned_now_bytes == 5 and real.cgroup_max_bytes is None
    sim = read_host_memory(["python", "-m", "tuner.sim", "--sim-host-memory-gib", "48", "--sim-memory-max", "20"],
                           url="http://127.0.0.1:9")  # nothing listens: the command line decides
    assert sim.mem_total_bytes == 48 * GIB and sim.mem_available_bytes == 48 * GIB and sim.cgroup_max_bytes == 20 * GIB
    assert "--sim-host-memory-gib 48" in sim.source


def test_explain_says_a_prefix_tier_not_capacity(tmp_path: Path) -> None:
    from tuner.sglang.explain import explain_from
    from tuner.sim.evaluate import size_server

    sized = size_server(["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--tp", "2", "--max-total-tokens",
                         "60000", "--enable-hierarchical-cache", "--hicache-ratio", "2"])
    log = tmp_path / "hicache.log"
    log.write_text("\n".join(sized.log_lines) + "\n")
    trap = next(t for t in explain_from(log=str(log)).traps if t.id == "hicache_per_rank")
    assert "7.86 GB × 2 ranks" in trap.title
    # 7.86 GB / 64 KiB per token = ~120k host tokens per rank, twice the 60,000-token device pool.
    assert "adds a host prefix tier of 1" in trap.detail and "not active capacity" in trap.detail
    assert "device pool of 60,000 tokens" in trap.detail


def test_a_start_oom_killed_while_pinning_is_a_host_memory_failure() -> None:
    import subprocess
    import sys

    from tuner.sglang.failures import Failure, FailureClass
    from tuner.trial import host_pool_kill

    argv = [sys.executable, "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--tp", "4", "--max-total-tokens",
            "200000", "--enable-hierarchical-cache", "--hicache-size", "20", "--sim-memory-max", "50",
            "--sim-time-scale", "0", "--port", "9"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (-9, 137)
    lines = (done.stdout + done.stderr).splitlines()
    crash = Failure(failure_class=FailureClass.CRASH, evidence="exited with status 9/KILL", exit_status=137)
    host = host_pool_kill(crash, lines)
    assert host is not None and host.failure_class is FailureClass.HOST_MEMORY and host.exit_status == 137
    assert "Allocating 20.00 GB host memory" in host.evidence
    # SGLang's own host check fails with a traceback: that stays the log classifier's verdict.
    argv[argv.index("--sim-memory-max") + 1] = "none"
    own = subprocess.run([*argv, "--sim-host-memory-gib", "70"], capture_output=True, text=True, timeout=120, check=False)
    assert host_pool_kill(crash, (own.stdout + own.stderr).splitlines()) is None
