"""Benchmark: the simulator's offline evaluation of 1,000 requests must take under 5 s of CPU.

Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_sim_offline.py --run-benchmarks -s``
(or ``.venv/bin/python tests/benchmarks/bench_sim_offline.py``). The figure goes in docs/simulator.md,
"Engine and cost model".
"""

from __future__ import annotations

import random
import time

from tuner.sim.engine import SimRequest
from tuner.sim.evaluate import EvalResult, evaluate

CPU_BUDGET_S = 5.0
ARGV = ["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", "--mem-fraction-static", "0.85"]


def workload(n: int = 1000, seed: int = 0) -> list[SimRequest]:
    """ShareGPT-like lengths (input 64-2,048, output 32-512) at 20 req/s, a third on shared system prompts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 120_000) for _ in range(1024)] for _ in range(16)]
    reqs = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(20.0)
        body = [rng.randrange(100, 120_000) for _ in range(rng.randint(64, 2048))]
        prompt = (rng.choice(systems) + body[:256]) if i % 3 == 0 else body
        reqs.append(SimRequest(f"b{i}", prompt, rng.randint(32, 512), arrival_s=t))
    return reqs


def measure() -> tuple[float, EvalResult]:
    """CPU seconds of one evaluate() over the 1,000-request workload, and its result."""
    reqs = workload()
    start = time.process_time()
    result = evaluate(ARGV, reqs)
    return time.process_time() - start, result


def test_offline_evaluation_of_1000_requests_is_fast():
    cpu_s, result = measure()
    print(f"\noffline evaluate: 1,000 requests, {result.total_output_tokens} output tokens, "
          f"{result.duration_s:.1f} s simulated, {cpu_s:.2f} s CPU")
    assert result.completed == 1000
    assert cpu_s < CPU_BUDGET_S


if __name__ == "__main__":
    cpu, res = measure()
    print(f"1000 requests: {cpu:.2f} s CPU for {res.duration_s:.1f} s simulated, "
          f"{res.output_throughput:.0f} tok/s, p99 TTFT {res.p99_ttft_ms:.0f} ms, hit rate {res.cache_hit_rate:.2f}")
