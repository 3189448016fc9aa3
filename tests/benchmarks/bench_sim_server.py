"""Benchmark: the simulator's HTTP server on one core sustains 256 concurrent streaming requests
with realised step times within 10% of the cost model.

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_sim_server.py --run-benchmarks -s``.
The server process is pinned to CPU 0 (``os.sched_setaffinity``), the load client to the other
CPUs. Figures are printed and go into docs/simulator.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
import requests

from tests.support.sim import spawn, wait_ready

CONCURRENCY = 256
INPUT_TOKENS = 256
OUTPUT_TOKENS = 256


async def _stream(session: aiohttp.ClientSession, url: str, i: int) -> tuple[float, int]:
    body = {"input_ids": [(i * 7919 + k) % 30000 + 100 for k in range(INPUT_TOKENS)],
            "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}, "stream": True}
    start = time.monotonic()
    first = None
    completion = 0
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if first is None:
                first = time.monotonic() - start
            completion = json.loads(line[6:])["meta_info"]["completion_tokens"]
    return first or 0.0, completion


async def _load(url: str) -> list[tuple[float, int]]:
    conn = aiohttp.TCPConnector(limit=CONCURRENCY + 8)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(_stream(session, url, i) for i in range(CONCURRENCY)))


@pytest.mark.benchmark
def test_256_concurrent_streams_on_one_core(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one for the server, one for the load client")
    sim = spawn(["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", "--mem-fraction-static", "0.85",
                 "--max-running-requests", str(CONCURRENCY)], tmp_path)
    try:
        os.sched_setaffinity(sim.proc.pid, {cpus[0]})
        os.sched_setaffinity(0, set(cpus[1:]))
        wait_ready(sim)
        server = psutil.Process(sim.proc.pid)
        cpu0 = sum(server.cpu_times()[:2])
        start = time.monotonic()
        results = asyncio.run(_load(sim.url))
        wall_s = time.monotonic() - start
        server_cpu_s = sum(server.cpu_times()[:2]) - cpu0
        steps = requests.get(f"{sim.url}/sim/step_times", timeout=30).json()
    finally:
        os.sched_setaffinity(0, set(cpus))
        sim.stop()
    assert len(results) == CONCURRENCY and all(n == OUTPUT_TOKENS for _, n in results)
    decode = [(m, r) for m, r in steps if m > 0]
    model_s = sum(m for m, _ in decode)
    real_s = sum(r for _, r in decode)
    ratios = sorted(r / m for m, r in decode)
    p50, p90 = ratios[len(ratios) // 2], ratios[int(len(ratios) * 0.9)]
    tokens = CONCURRENCY * OUTPUT_TOKENS
    print(f"\n{CONCURRENCY} streams × {OUTPUT_TOKENS} tokens: wall {wall_s:.2f} s, {tokens / wall_s:.0f} tok/s; "
          f"{len(decode)} steps, model {model_s:.2f} s, realised {real_s:.2f} s (×{real_s / model_s:.3f}); "
          f"per-step ratio p50 {p50:.3f} p90 {p90:.3f}; mean TTFT "
          f"{sum(t for t, _ in results) / len(results) * 1000:.0f} ms; server CPU {server_cpu_s:.2f} s "
          f"({server_cpu_s / wall_s:.0%} of its core)")
    assert real_s / model_s <= 1.10
