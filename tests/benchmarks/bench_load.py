"""Benchmark: the load generator is not the bottleneck (figures in docs/load-generator.md).

From one core (``os.sched_setaffinity``) the generator drives 1,000 concurrent streams against
``tests/support/sse_server.py`` (its own processes, on other cores; a 1 ms timing wheel sends each
stream one token every 18 ms: 55,600 tokens/s offered) and must:

* keep ≥ 1,000 streams in flight and receive ≥ 50,000 streamed tokens/s;
* add < 1 ms to median TTFT: per request, the client's TTFT minus the server's own
  (first-token send − request receive, both on the system-wide monotonic clock, written by the
  server to ``--stats-dir``).

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_load.py --run-benchmarks -s``.
Environment: ``BENCH_LOAD_STREAMS`` (1000), ``BENCH_LOAD_ITL_MS`` (18), ``BENCH_LOAD_DURATION_S`` (10),
``BENCH_LOAD_SERVER_WORKERS`` (one per spare core, at most 4), ``BENCH_LOAD_TRANSPORT`` (raw | aiohttp).
"""

from __future__ import annotations

import glob
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tuner.load import RandomSpec, build_workload, run_load_sync

SERVER = Path(__file__).parents[1] / "support" / "sse_server.py"
STREAMS = int(os.environ.get("BENCH_LOAD_STREAMS", "1000"))
ITL_MS = float(os.environ.get("BENCH_LOAD_ITL_MS", "18"))
DURATION_S = float(os.environ.get("BENCH_LOAD_DURATION_S", "10"))
TRANSPORT = os.environ.get("BENCH_LOAD_TRANSPORT", "raw")


def _runqueue_wait_s(pid: int | str = "self") -> float:
    """Seconds the process's main thread waited, runnable, for a CPU (``/proc/<pid>/schedstat``)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def _server_pids(root: int) -> list[int]:
    children = Path(f"/proc/{root}/task/{root}/children")
    return [root, *(int(p) for p in children.read_text().split())] if children.exists() else [root]


def _max_in_flight(records: list) -> int:
    events = sorted([(r.send_time_s, 1) for r in records] + [(r.end_time_s, -1) for r in records])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


@pytest.mark.benchmark
def test_one_core_drives_1000_streams_and_50k_tokens_per_s(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: one for the generator, the rest for the SSE server")
    client_cpu, server_cpus = cpus[0], cpus[1:]
    workers = int(os.environ.get("BENCH_LOAD_SERVER_WORKERS", str(min(4, len(server_cpus)))))
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    server = subprocess.Popen(
        [sys.executable, str(SERVER), "--port", "0", "--ttft-ms", "5", "--itl-ms", str(ITL_MS), "--no-cache",
         "--workers", str(workers), "--cpus", ",".join(map(str, server_cpus)), "--stats-dir", str(stats_dir)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    original = os.sched_getaffinity(0)
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{int(server.stdout.readline().split()[1])}"
        os.sched_setaffinity(0, {client_cpu})
        # Ranged output lengths (40-200 tokens) so the 1,000 streams do not finish and restart in
        # lockstep: the measured window then sees a steady mix of first tokens and decode tokens.
        wl = build_workload(RandomSpec(input_len=64, output_len=200, range_ratio=0.2), seed=0)
        pids = _server_pids(server.pid)
        waits0 = [_runqueue_wait_s(), *(_runqueue_wait_s(p) for p in pids)]
        usage0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        result = run_load_sync(url, wl, concurrency=STREAMS, warmup_s=5.0, duration_s=DURATION_S,
                               request_timeout_s=120, transport=TRANSPORT)
        usage1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        waits1 = [_runqueue_wait_s(), *(_runqueue_wait_s(p) for p in pids)]
        time.sleep(1.5)  # the server workers dump their timestamps every 0.5 s
    finally:
        os.sched_setaffinity(0, original)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
    stamps: dict[str, list[float]] = {}
    for path in glob.glob(str(stats_dir / "*.json")):
        stamps.update(json.loads(Path(path).read_text()))
    s = result.summary
    measured = result.measured()
    # Tokens/s streamed while the measured window was fully loaded (all phases' streams count).
    window = next(p for p in result.phases if p.name == "measure")
    tokens_in_window = sum(
        n for r in result.records for t, n in zip(r.chunk_times_s, r.chunk_tokens, strict=True) if window.start_s <= t < window.end_s
    )
    streamed_tok_s = tokens_in_window / (window.end_s - window.start_s)
    added_ms = np.array([
        (r.ttft_s - (stamps[r.server_rid][1] - stamps[r.server_rid][0])) * 1000
        for r in measured if r.ttft_s is not None and r.server_rid in stamps
    ])
    server_ttft_ms = np.array([(v[1] - v[0]) * 1000 for v in stamps.values()])
    # The two halves of the added TTFT, on the shared monotonic clock: request path (client send →
    # server receive) and delivery path (server first-token send → client read).
    t0 = result.settings["t0_monotonic_s"]
    matched = [r for r in measured if r.first_token_time_s is not None and r.server_rid in stamps]
    up_ms = np.array([(stamps[r.server_rid][0] - (t0 + r.send_time_s)) * 1000 for r in matched])
    down_ms = np.array([((t0 + r.first_token_time_s) - stamps[r.server_rid][1]) * 1000 for r in matched])
    cpu_s = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
    all_tokens = sum(sum(r.chunk_tokens) for r in result.records)
    in_flight = [t.in_flight for t in result.live if t.phase == "measure"]
    figures = {
        "streams": STREAMS,
        "transport": TRANSPORT,
        # bench_serving's Σ E2E / duration counts only requests sent in the window, so it ramps up
        # and down at the window's edges; the live in-flight count is the direct figure.
        "median_in_flight_measured": float(np.median(in_flight)) if in_flight else 0.0,
        "achieved_concurrency": round(s.concurrency, 1),
        "max_in_flight": _max_in_flight(result.records),
        "streamed_tok_s": round(streamed_tok_s),
        "summary_output_throughput_tok_s": round(s.output_throughput),
        "completed": s.completed,
        "errored": s.errored,
        "median_ttft_ms_client": round(s.median_ttft_ms or 0, 3),
        "median_ttft_ms_server": round(float(np.median(server_ttft_ms)), 3),
        "median_added_ttft_ms": round(float(np.median(added_ms)), 3),
        "p99_added_ttft_ms": round(float(np.percentile(added_ms, 99)), 3),
        "median_send_to_server_receive_ms": round(float(np.median(up_ms)), 3),
        "median_server_send_to_client_read_ms": round(float(np.median(down_ms)), 3),
        "matched_requests": int(added_ms.size),
        "client_cpu_share": round(cpu_s / (wall1 - wall0), 3),
        # The client's own CPU per streamed token, whole run (setup and summary included):
        # 1e6 / this = tokens/s one core sustains, whatever else the machine runs.
        "client_cpu_us_per_token": round(cpu_s / all_tokens * 1e6, 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
        # Share of the run each process spent runnable but waiting for a CPU (other work on the
        # machine): near 0 on an idle machine; the TTFT figures mean little when it is not.
        "client_runqueue_wait_share": round((waits1[0] - waits0[0]) / (wall1 - wall0), 3),
        "server_runqueue_wait_share": round(
            max(b - a for a, b in zip(waits0[1:], waits1[1:], strict=True)) / (wall1 - wall0), 3),
        "median_itl_ms": round(s.median_itl_ms or 0, 3),
    }
    print("\nBENCH_LOAD " + json.dumps(figures))
    assert s.errored == 0
    assert figures["max_in_flight"] >= STREAMS and figures["median_in_flight_measured"] >= 0.95 * STREAMS
    assert streamed_tok_s >= 0.9 * STREAMS * 1000 / ITL_MS
    assert streamed_tok_s >= 50_000 or STREAMS * 1000 / ITL_MS < 55_000
    assert added_ms.size >= 0.9 * len(measured)
    assert figures["median_added_ttft_ms"] < 1.0
