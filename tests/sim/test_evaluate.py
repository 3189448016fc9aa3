"""Offline evaluation: the simulated server's startup sizing plus a whole workload on virtual time."""

from __future__ import annotations

import random
import re
from dataclasses import replace

import pytest

from tests.support.net import free_port
from tests.support.sim import spawn, wait_ready
from tuner.sim.engine import SimRequest
from tuner.sim.errors import SimError
from tuner.sim.evaluate import _run, evaluate, size_server

LLAMA_H100 = ["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB"]
REFERENCE = [  # §1.8: Kimi-K2.5-style MLA on 8× RTX PRO 6000, EAGLE-3, mimicking 0.5.5
    "--model-path", "kimi-k2.5-int4", "--sim-gpu", "RTX-PRO-6000-96GB", "--tp-size", "8",
    "--speculative-algorithm", "EAGLE3",
]


def ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 120_000) for _ in range(n)]


def test_shared_prefixes_hit_the_cache_as_designed_and_random_prompts_do_not():
    rng = random.Random(1)
    prompts = []
    for _ in range(8):  # generated-shared-prefix style: 8 groups × 8 questions on a 1,024-token system prompt
        system = ids(1024, rng)
        prompts += [system + ids(64, rng) for _ in range(8)]
    rng.shuffle(prompts)
    # a warm-up request first: a fresh server's first prefill batch is slow (cold_prefill_s), and the
    # prompts arriving meanwhile would share one batch, where no prompt can hit another's prefix
    warm = SimRequest("warm", list(range(100, 132)), 1)
    shared = evaluate(LLAMA_H100, [warm] + [SimRequest(f"g{i}", p, 32, arrival_s=1 + 0.05 * i) for i, p in enumerate(prompts)])
    assert shared.started and shared.completed == 65
    assert shared.cache_hit_rate == pytest.approx(8 * 7 * 1024 / (64 * 1088 + 32), abs=0.03)
    rand = evaluate(LLAMA_H100, [warm] + [SimRequest(f"r{i}", ids(1088, rng), 32, arrival_s=1 + 0.05 * i) for i in range(64)])
    assert rand.cache_hit_rate < 0.01
    assert shared.mean_ttft_ms < rand.mean_ttft_ms


def test_startup_failure_is_reported_with_its_log_lines():
    r = evaluate(LLAMA_H100 + ["--mem-fraction-static", "0.15"], [SimRequest("a", [1, 2, 3], 4)])
    assert not r.started and r.startup_failure == "not_enough_memory"
    assert r.completed == 0 and r.output_throughput == 0.0
    assert any("Not enough memory. Please try to increase --mem-fraction-static" in line for line in r.log_lines)


def test_bad_arguments_raise_like_the_server(tmp_path):
    for bad in (["--no-such-flag"], ["--sim-gpu", "TPU-v9"]):
        with pytest.raises(SystemExit) as exit_info:
            evaluate(LLAMA_H100 + bad, [])
        assert exit_info.value.code == 2
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(SimError, match="config.json"):
        evaluate(["--model-path", str(tmp_path)], [])
    with pytest.raises(ValueError, match="concurrency"):
        evaluate(LLAMA_H100, [], concurrency=0)


def test_size_server_matches_the_evaluated_server():
    sized = size_server(LLAMA_H100 + ["--mem-fraction-static", "0.85"])
    assert sized.failure is None and sized.engine_spec is not None
    assert sized.engine_spec.max_total_num_tokens == sized.max_total_num_tokens > 0
    assert any(line.endswith(f"available_gpu_mem={sized.free_gib_after_graphs:.2f} GB") for line in sized.log_lines)


def test_size_server_prints_what_the_server_prints(tmp_path):
    """One startup path: offline sizing logs the server's own lines, up to its scheduler line."""
    args = LLAMA_H100 + ["--mem-fraction-static", "0.85", "--tp", "2", "--log-level", "debug"]
    port = free_port()
    sim = spawn(args, tmp_path, port=port)
    try:
        wait_ready(sim)
        logged = sim.log().splitlines()
    finally:
        sim.stop()
    sized = size_server(args + ["--host", "127.0.0.1", "--port", str(port), "--sim-time-scale", "0.0"])

    def startup(lines: list[str]) -> list[str]:
        bare = [re.sub(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "[", line) for line in lines]  # no timestamps
        end = next(i for i, line in enumerate(bare) if "] max_total_num_tokens=" in line)
        return bare[: end + 1]

    lines = startup(logged)
    assert startup(sized.log_lines) == lines
    assert lines[0].startswith("[] server_args=ServerArgs(") and "[ TP1] Load weight begin." in "\n".join(lines)
    assert "[] Flag --log-level is accepted but not simulated; ignoring it." in lines


def test_runtime_oom_at_high_fraction_with_a_large_chunk():
    """§1.8's trade-off: 0.93 leaves ~2.7 GiB; a 16k chunk's activations do not fit it, an 8k one does."""
    rng = random.Random(2)
    long_prompts = [SimRequest(f"l{i}", ids(20_000, rng), 8) for i in range(2)]
    ok = evaluate(REFERENCE + ["--mem-fraction-static", "0.93", "--chunked-prefill-size", "8192"], long_prompts)
    assert ok.started and not ok.runtime_oom and ok.completed == 2
    assert ok.max_total_num_tokens == pytest.approx(231_000, rel=0.01)
    oom = evaluate(REFERENCE + ["--mem-fraction-static", "0.93", "--chunked-prefill-size", "16384"], long_prompts)
    assert oom.started and oom.runtime_oom and oom.completed == 0
    assert any("torch.OutOfMemoryError: CUDA out of memory." in line for line in oom.log_lines)
    safe = evaluate(REFERENCE + ["--mem-fraction-static", "0.88", "--chunked-prefill-size", "16384"], long_prompts)
    assert not safe.runtime_oom and safe.completed == 2


def test_closed_loop_keeps_concurrency_and_open_loop_honours_the_window():
    rng = random.Random(3)
    reqs = [SimRequest(f"r{i}", ids(300, rng), 50) for i in range(40)]
    closed = evaluate(LLAMA_H100, reqs, concurrency=4)
    running = [int(m.group(1)) for line in closed.log_lines if (m := re.search(r"Decode batch, #running-req: (\d+)", line))]
    assert closed.completed == 40 and running and max(running) <= 4
    assert closed.total_output_tokens == 40 * 50
    assert closed.p99_itl_ms is not None and closed.p99_tpot_ms is not None and closed.p50_ttft_ms <= closed.p99_ttft_ms
    spaced = [SimRequest(f"s{i}", ids(300, rng), 200, arrival_s=0.1 * i) for i in range(100)]
    window = evaluate(LLAMA_H100, spaced, duration_s=3.0)
    assert window.duration_s == pytest.approx(3.0, abs=0.05)
    assert 0 < window.completed < 30
    assert window.output_throughput == pytest.approx(window.total_output_tokens / window.duration_s)


def test_decode_beyond_the_captured_graphs_is_slower():
    """case-21: a small cuda_graph_max_bs makes a 64-request decode batch run eagerly."""
    rng = random.Random(4)
    reqs = [SimRequest(f"r{i}", ids(500, rng), 200) for i in range(128)]
    small = evaluate(LLAMA_H100 + ["--cuda-graph-max-bs", "8"], reqs, concurrency=64)
    large = evaluate(LLAMA_H100 + ["--cuda-graph-max-bs", "128"], reqs, concurrency=64)
    assert small.p99_tpot_ms > 1.3 * large.p99_tpot_ms
    assert small.output_throughput < large.output_throughput
    assert any("cuda graph: False" in line for line in small.log_lines)
    assert not any("cuda graph: False" in line for line in large.log_lines if line.startswith("Decode"))


def test_too_long_inputs_are_rejected_not_run():
    rng = random.Random(5)
    reqs = [SimRequest("ok", ids(100, rng), 4), SimRequest("long", ids(5000, rng), 4)]
    r = evaluate(LLAMA_H100 + ["--context-length", "4096"], reqs)
    assert r.completed == 1 and r.rejected == 1 and r.total_output_tokens == 4


def test_requests_the_engine_aborts_count_as_rejected_and_the_run_ends():
    """The engine's stall rule (no chunk holds a page: unreachable from argv) seen by the offline loop."""
    sized = size_server(LLAMA_H100 + ["--page-size", "64"])
    spec = replace(sized.engine_spec, chunked_prefill_size=32)
    rng = random.Random(6)
    reqs = [SimRequest(f"r{i}", ids(100, rng), 4) for i in range(3)]
    r = _run(spec, reqs, [], {"max_total_num_tokens": 0, "max_running_requests": 0, "free_gib_after_graphs": 0.0},
             concurrency=2, duration_s=None, max_steps=100)
    # no GPU time: only the request path of the first two, then of the third (sent when they ended)
    path_s = spec.cost.factors.request_path_s
    assert r.rejected == 3 and r.completed == 0 and r.error is None and r.duration_s == pytest.approx(2 * path_s)


def test_the_pre_04_scheduler_generation_adds_its_cpu_cost_to_every_step():
    """``--sim-scheduler pre-0.4`` (SGLang 0.2-0.3, replayed for their published runs): every decode
    step costs 2 ms + 25 µs per running request more CPU than the default's 0.3 ms + 2 µs
    (costmodel.SCHEDULER_CPU), visible as TPOT; the memory side and TTFT's request path stay."""
    rng = random.Random(3)
    base = LLAMA_H100 + ["--disable-overlap-schedule"]

    def run(argv: list[str], n: int) -> tuple:
        reqs = [SimRequest(f"r{i}", ids(64, rng), 200, ignore_eos=True) for i in range(n)]
        return evaluate(argv, reqs, concurrency=n), size_server(argv)

    for n in (1, 64):
        (new, new_size), (old, old_size) = run(base, n), run(base + ["--sim-scheduler", "pre-0.4"], n)
        assert new_size.max_total_num_tokens == old_size.max_total_num_tokens
        extra_ms = (old.p50_tpot_ms or 0) - (new.p50_tpot_ms or 0)
        assert extra_ms == pytest.approx(1.7 + 0.023 * n, rel=0.05), (n, old.p50_tpot_ms, new.p50_tpot_ms)
    assert size_server(base).engine_spec.cost.factors.step_overhead_s == pytest.approx(0.3e-3)


def test_an_unknown_scheduler_generation_is_refused_as_sglang_refuses_a_bad_choice():
    with pytest.raises(SystemExit) as err:
        size_server(LLAMA_H100 + ["--sim-scheduler", "0.3"])
    assert err.value.code == 2
