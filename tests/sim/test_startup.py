"""Startup as a real process: §4.2 lines in each version's format, and every §4.3 failure class."""

from __future__ import annotations

import re
import signal

import pytest

from tests.support.sim import run_to_exit, spawn, wait_ready

KILLED = -signal.SIGKILL  # kill_process_tree: the unit dies with 9/KILL (status 137 in a shell)
SIGQUIT_LINE = "Received sigquit from a child process. It usually means the child failed."


def _lines(log: str, needle: str) -> list[str]:
    return [line for line in log.splitlines() if needle in line]


def _start_log(args: list[str], tmp_path) -> str:
    sim = spawn(args, tmp_path)
    try:
        wait_ready(sim)
        return sim.log()
    finally:
        sim.stop()


def test_tp2_start_prints_every_rank_in_order(tmp_path) -> None:
    log = _start_log(["--model-path", "llama-3.1-8b", "--tp", "2", "--mem-fraction-static", "0.85"], tmp_path)
    order = ["Init torch distributed begin.", "Init torch distributed ends. mem usage=", "Load weight begin. avail mem=",
             "Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=", "KV Cache is allocated. #tokens:",
             "Memory pool end. avail mem=", "Capture cuda graph begin. This can take up to several minutes.",
             "Capture cuda graph end. Time elapsed:", "max_total_num_tokens=", "Uvicorn running on",
             "The server is fired up and ready to roll!"]
    positions = [log.find(needle) for needle in order]
    assert -1 not in positions and positions == sorted(positions), positions
    for needle in order[:8]:
        ranks = sorted(re.search(r" (TP\d)\]", line).group(1) for line in _lines(log, needle))
        assert ranks == ["TP0", "TP1"], needle
    sched = _lines(log, "max_total_num_tokens=")
    assert len(sched) == 1 and " TP0] " in sched[0]
    assert re.search(r"chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=\d+, "
                     r"context_len=131072, available_gpu_mem=\d+\.\d\d GB$", sched[0])
    kv = re.search(r"#tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB", log)
    tokens = int(kv.group(1))
    assert f"max_total_num_tokens={tokens}," in sched[0]
    # tp 2 splits the 8 KV heads: 4 × 128 × 32 layers × 2 B = 32 KiB of K per token.
    assert float(kv.group(2)) == pytest.approx((tokens + 1) * 32768 / 2**30, abs=0.006)
    assert "Using KV cache dtype: torch.bfloat16" in log


def test_0_5_10_and_0_5_23_formats(tmp_path) -> None:
    log = _start_log(["--model-path", "llama-3.1-8b", "--sim-version", "0.5.10"], tmp_path)
    assert re.search(r"Init torch distributed ends\. elapsed=[\d.]+ s, mem usage=0\.00 GB", log)
    assert re.search(r"Load weight end\. elapsed=[\d.]+ s, type=LlamaForCausalLM, avail mem=[\d.]+ GB, mem usage=14\.96 GB\.", log)
    assert re.search(r"Capture piecewise CUDA graph end\. Time elapsed: [\d.]+ s\. mem usage=0\.45 GB\. avail mem=", log)
    log = _start_log(["--model-path", "deepseek-v3", "--tp", "8", "--sim-gpu", "H200-141GB", "--sim-version", "0.5.23"],
                     tmp_path)
    assert "Init parallel ends. elapsed=" in log and "Memory baseline taken. mem usage=" in log
    assert re.search(r"Load weight end\. elapsed=[\d.]+ s, type=DeepseekV3ForCausalLM, quant=fp8, fmt=e4m3, avail mem=", log)
    assert re.search(r"KV Cache is allocated\. dtype: torch\.bfloat16, #tokens: \d+, KV size: [\d.]+ GB", log)
    assert re.search(r"Capture target decode CUDA graph end\. bs=\[1, 2, .*\], elapsed=[\d.]+ s, mem usage=[\d.]+ GB, "
                     r"avail mem=[\d.]+ GB\.", log)
    assert re.search(r"Capture target prefill CUDA graph end\. elapsed=[\d.]+ s, mem usage=1\.50 GB, avail mem=", log)


def test_reference_deployment_log(tmp_path) -> None:
    log = _start_log(["--model-path", "kimi-k2.5-int4", "--tp", "8", "--sim-gpu", "RTX-PRO-6000-96GB",
                      "--mem-fraction-static", "0.88", "--speculative-algorithm", "EAGLE3",
                      "--speculative-draft-model-path", "/models/eagle3"], tmp_path)
    assert "Max running requests is reset to 48 for speculative decoding" in log
    kv = _lines(log, "KV Cache is allocated.")
    assert len(kv) == 16  # target and draft pools on 8 ranks
    m = re.search(r"#tokens: (\d+), KV size: ([\d.]+) GB", kv[0])
    assert int(m.group(1)) == pytest.approx(159_277, rel=0.01) and float(m.group(2)) == pytest.approx(10.42, abs=0.05)
    assert re.search(r"Load weight begin\. avail mem=94\.0\d GB", log)
    assert "mem usage=72.33 GB." in log and "type=LlamaForCausalLMEagle3" in log
    free = float(re.search(r"available_gpu_mem=([\d.]+) GB", log).group(1))
    assert free == pytest.approx(7.43, abs=0.5)
    assert len(_lines(log, "Capture cuda graph end.")) == 16


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model-path", "llama-3.1-8b", "--mem-fraction-static", "0.18"],
         "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
         "self.server_args.mem_fraction_static=0.18"),
        (["--model-path", "llama-3.1-8b", "--mem-fraction-static", "0.18", "--sim-version", "0.5.10"],
         "Not enough memory. Please try to increase --mem-fraction-static. Current value: mem_fraction_static=0.18"),
        (["--model-path", "llama-3.1-8b", "--mem-fraction-static", "0.18", "--sim-version", "0.5.23"],
         "ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.18."),
    ],
)
def test_kv_budget_not_positive(args: list[str], expected: str, tmp_path) -> None:
    status, log = run_to_exit(args, tmp_path)
    assert status == KILLED
    assert expected in log
    assert "Load weight end." in log and "KV Cache is allocated" not in log
    assert "Scheduler hit an exception: Traceback (most recent call last):" in log and SIGQUIT_LINE in log


def test_weight_load_oom(tmp_path) -> None:
    status, log = run_to_exit(["--model-path", "qwen3-32b", "--sim-gpu", "L4-24GB"], tmp_path)
    assert status == KILLED
    assert "Load weight begin." in log and "Load weight end." not in log
    assert re.search(r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate [\d.]+ GiB\. GPU 0 has a total "
                     r"capacity of 22\.49 GiB", log)
    assert SIGQUIT_LINE in log


def test_cuda_graph_capture_oom(tmp_path) -> None:
    status, log = run_to_exit(["--model-path", "llama-3.1-8b", "--mem-fraction-static", "0.98"], tmp_path)
    assert status == KILLED
    assert "Capture cuda graph begin." in log and "Capture cuda graph end." not in log
    assert "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate" in log
    assert "Possible solutions:" in log and "2. set --cuda-graph-max-bs to a smaller value (e.g., 16)" in log
    status, log = run_to_exit(["--model-path", "llama-3.1-8b", "--mem-fraction-static", "0.98",
                               "--sim-version", "0.5.23"], tmp_path)
    assert status == KILLED and "--cuda-graph-max-bs-decode to a smaller value" in log


def test_hicache_host_memory_per_rank(tmp_path) -> None:
    status, log = run_to_exit(["--model-path", "llama-3.1-8b", "--tp", "4", "--sim-gpu", "L4-24GB",
                               "--enable-hierarchical-cache", "--hicache-size", "60", "--sim-host-memory-gib", "200"],
                              tmp_path)
    assert status == KILLED
    assert len(_lines(log, "Allocating 60.00 GB host memory for hierarchical KV cache.")) == 3
    err = _lines(log, "Not enough host memory available.")
    assert len(err) == 1 and "Requesting 60.00 GB but only have 24.01 GB free." in err[0]
    assert "Please reduce the size of the hierarchical cache." in err[0]


def test_host_pool_must_exceed_device_pool_up_to_0_5_10(tmp_path) -> None:
    status, log = run_to_exit(["--model-path", "llama-3.1-8b", "--enable-hierarchical-cache", "--hicache-ratio", "0.5"],
                              tmp_path)
    assert status == KILLED
    assert "AssertionError: The host memory should be larger than the device memory with the current protocol" in log


def test_unbalanced_memory_with_a_foreign_process(tmp_path) -> None:
    status, log = run_to_exit(["--model-path", "llama-3.1-70b", "--tp", "4", "--sim-foreign-gib", "10"], tmp_path)
    assert status == KILLED
    m = re.search(r"ValueError: The memory capacity is unbalanced\. Some GPUs may be occupied by other processes\. "
                  r"min_per_gpu_memory=([\d.]+), local_gpu_memory=([\d.]+), local_gpu_memory \* 0\.9=([\d.]+)", log)
    assert m and float(m.group(1)) < float(m.group(3))
    assert "Load weight begin" not in log
    # 0.5.10+ raise a RuntimeError naming pre_model_load_memory (model_runner.py / distributed/bootstrap.py).
    status, log = run_to_exit(["--model-path", "llama-3.1-70b", "--tp", "4", "--sim-foreign-gib", "10", "--sim-version", "0.5.23"], tmp_path)
    assert status == KILLED and "RuntimeError: The memory capacity is unbalanced. Some GPUs may be occupied by other processes. " \
        "pre_model_load_memory=" in log


def test_mutually_exclusive_cache_flags_fail_before_start(tmp_path) -> None:
    status, log = run_to_exit(["--model-path", "llama-3.1-8b", "--enable-hierarchical-cache", "--disable-radix-cache"],
                              tmp_path)
    assert status == 2
    assert "mutually exclusive" in log and "Init torch distributed" not in log


def test_pool_too_small_for_any_request(tmp_path) -> None:
    status, log = run_to_exit(["--model-path", "llama-3.1-8b", "--max-total-tokens", "6"], tmp_path)
    assert status == KILLED
    assert "KV Cache is allocated. #tokens: 6," in log
    assert "AssertionError: Memory pool size is too small" in log and "max_total_num_tokens=" not in log
