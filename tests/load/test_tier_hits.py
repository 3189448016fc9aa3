"""Hit rates by tier (device, host) from the server's own counters, against the simulator.

A small device pool (``--max-total-tokens``) and a multi-turn workload whose history outgrows it:
with the hierarchical cache the evicted turns come back from host memory, so the host tier must
serve part of the hits; 0.5.10 reports it per request (``cached_tokens_details``), 0.5.5 only
through ``/metrics`` (load-back counter), and both ways must agree with the total hit rate.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tuner.load import MultiTurnSpec, build_workload, run_load_sync
from tuner.load.metrics import tier_hits_from_metrics
from tuner.sglang.client import SGLangClient


class _Sim:
    def __init__(self, tmp: Path, *args: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp / f"sim-{self.port}.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB",
             "--host", "127.0.0.1", "--port", str(self.port), "--enable-metrics", "--sim-time-scale", "0",
             "--max-total-tokens", "6144", *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the simulator exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the simulator was not ready within 90 s; see {self.log.name}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator:
    started: list[_Sim] = []

    def start(*args: str) -> _Sim:
        started.append(_Sim(tmp_path, *args))
        return started[-1]

    yield start
    for sim in started:
        sim.kill()


SPEC = MultiTurnSpec(num_sessions=12, turns=3, first_input_len=1024, turn_input_len=64, output_len=8)


@pytest.mark.parametrize("version", ["0.5.10", "0.5.5"])
def test_host_tier_serves_evicted_turns(start_sim, version: str) -> None:
    sim = start_sim("--sim-version", version, "--enable-hierarchical-cache", "--hicache-ratio", "4")
    client = SGLangClient(sim.url)
    before = client.metrics()
    result = run_load_sync(sim.url, build_workload(SPEC, seed=3), concurrency=4)
    after = client.metrics()
    s = result.summary
    assert s.completed == 36 and s.cache_hit_rate is not None and s.cache_hit_rate > 0.3
    counters = tier_hits_from_metrics(before, after)
    assert counters is not None
    assert counters["cache_hit_rate"] == pytest.approx(s.cache_hit_rate, abs=0.01)
    assert counters["host_hit_rate"] > 0.05  # 12 sessions x ~1.1k tokens do not stay in 6k device tokens
    assert counters["device_hit_rate"] + counters["host_hit_rate"] == pytest.approx(counters["cache_hit_rate"])
    if version == "0.5.10":
        assert s.host_hit_rate == pytest.approx(counters["host_hit_rate"], abs=0.01)
        assert s.device_hit_rate + s.host_hit_rate == pytest.approx(s.cache_hit_rate, abs=1e-9)
        assert s.storage_hit_rate is None  # no storage backend configured
    else:
        assert s.host_hit_rate is None  # 0.5.5 sends no cached_tokens_details: /metrics is the source


def test_no_hierarchical_cache_means_no_host_tier(start_sim) -> None:
    sim = start_sim("--sim-version", "0.5.10")
    client = SGLangClient(sim.url)
    before = client.metrics()
    result = run_load_sync(sim.url, build_workload(SPEC, seed=3), concurrency=4)
    counters = tier_hits_from_metrics(before, client.metrics())
    assert result.summary.host_hit_rate is None
    assert counters is not None and counters["host_hit_rate"] == 0.0
    assert counters["device_hit_rate"] == pytest.approx(result.summary.cache_hit_rate, abs=0.01)
