"""The load generator against the simulated SGLang server (a real subprocess on 127.0.0.1).

Prefix reuse: a shared-prefix workload must show a cache hit rate near its designed reuse, a
random one near zero. The CLI: a JSON result, one-line errors, partial results on a crash.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.support.cli import one_error_line, run_tuner
from tests.support.sim import SimProcess, start_healthy
from tuner.load import (
    LiveStats,
    MultiTurnSpec,
    RandomSpec,
    SharedPrefixSpec,
    build_workload,
    designed_hit_rate,
    run_load_sync,
)

SIM_ARGS = ["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", "--enable-metrics"]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    server = start_healthy(SIM_ARGS, tmp_path_factory.mktemp("sim"), time_scale=0.01)
    yield server
    server.stop()


def _flush(url: str) -> None:
    assert requests.post(url + "/flush_cache", timeout=30).status_code == 200


def test_shared_prefix_hit_rate_near_design_random_near_zero(sim: SimProcess) -> None:
    _flush(sim.url)
    spec = SharedPrefixSpec(num_groups=8, prompts_per_group=16, system_prompt_len=2048, question_len=128, output_len=4)
    result = run_load_sync(sim.url, build_workload(spec, seed=1), concurrency=8)
    assert result.summary.completed == 128 and result.summary.errored == 0
    designed = designed_hit_rate(spec)  # (15/16) * 2048/2176 = 0.882
    assert result.summary.cache_hit_rate == pytest.approx(designed, abs=0.06)
    assert all(r.prompt_tokens == 2176 and r.completion_tokens == 4 for r in result.records)

    random = run_load_sync(sim.url, build_workload(RandomSpec(input_len=2176, output_len=4, num_requests=48), seed=2),
                           concurrency=8)
    assert random.summary.completed == 48
    assert random.summary.cache_hit_rate is not None and random.summary.cache_hit_rate < 0.02


def test_multi_turn_hit_rate_matches_its_design(sim: SimProcess) -> None:
    _flush(sim.url)
    spec = MultiTurnSpec(num_sessions=8, turns=4, first_input_len=1024, turn_input_len=128, output_len=16)
    wl = build_workload(spec, seed=5)
    result = run_load_sync(sim.url, wl, concurrency=8)
    assert result.summary.completed == 32
    assert result.summary.cache_hit_rate == pytest.approx(wl.designed_hit_rate, abs=0.03)  # 3504/4960


@pytest.mark.parametrize("transport", ["raw", "aiohttp"])
def test_completions_api_against_the_sim(sim: SimProcess, transport: str) -> None:
    wl = build_workload(RandomSpec(input_len=300, output_len=12, num_requests=16), seed=3)
    result = run_load_sync(sim.url, wl, concurrency=4, api="completions", transport=transport)
    s = result.summary
    assert s.completed == 16 and s.total_output_tokens == 16 * 12
    assert all(r.prompt_tokens == 300 and sum(r.chunk_tokens) == 12 for r in result.records)
    assert s.p99_itl_ms is not None and s.mean_tpot_ms is not None


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_tuner("load", *args, timeout_s=180)


def test_cli_writes_json_and_csv_and_fails_in_one_line(sim: SimProcess, tmp_path: Path) -> None:
    out, rows = tmp_path / "load.json", tmp_path / "load.csv"
    done = _cli("--url", sim.url, "--input-len", "200", "--output-len", "8", "--concurrency", "4",
                "--max-requests", "20", "--slo", "p99_ttft_ms=60000", "--json", str(out), "--csv", str(rows))
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 20 and data["summary"]["slo_met"] is True
    assert data["settings"]["concurrency"] == 4 and "records" not in data
    assert len(rows.read_text().splitlines()) == 21
    assert "output throughput" in done.stdout
    down = _cli("--url", "http://127.0.0.1:9", "--concurrency", "1", "--duration", "1")
    one_error_line(down, "cannot connect")
    bad = _cli("--url", sim.url, "--concurrency", "1", "--duration", "1", "--slo", "p99_ttft=5")
    assert bad.returncode == 1 and "--slo" in bad.stderr and "Traceback" not in bad.stderr


def test_sim_crash_mid_run_gives_partial_result_promptly(tmp_path: Path) -> None:
    victim = start_healthy(SIM_ARGS, tmp_path, time_scale=0.01)
    try:
        def crash(stats: LiveStats) -> None:
            if stats.elapsed_s >= 1.0 and victim.proc.poll() is None:
                os.killpg(victim.proc.pid, signal.SIGKILL)

        started = time.monotonic()
        result = run_load_sync(victim.url, build_workload(RandomSpec(input_len=512, output_len=4000), seed=0),
                               concurrency=16, duration_s=300, on_tick=crash, tick_s=0.25)
        assert time.monotonic() - started < 60  # a bound against hanging, not a speed target
        assert result.partial and result.stop_reason
        assert result.summary.errored + result.summary.incomplete >= 16
    finally:
        victim.stop()


def test_cli_refuses_prompts_over_the_servers_context_before_sending(sim: SimProcess, tmp_path: Path) -> None:
    """llama-3.1-8b's context is 131072 tokens: a 200000-token prompt would be rejected by the
    server (§4.4), so ``tuner load`` asks the server's context first and sends nothing (it sent five
    requests that all failed with HTTP 400 before). The summary of requests that all error is
    tested on its own in ``tests/load/test_metrics.py``."""
    out = tmp_path / "load.json"
    done = _cli("--url", sim.url, "--input-len", "200000", "--output-len", "4", "--concurrency", "1",
                "--max-requests", "5", "--json", str(out))
    assert done.returncode == 1, done.stdout
    one_error_line(done, "exceeds the server's longest input", "shorten the prompts")
    assert not out.exists()  # nothing was sent, nothing written
