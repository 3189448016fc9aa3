"""The memory ledger: defaults (§2), KV-pool sizing by version (§1.1-1.6) and the reference case (§1.8)."""

from __future__ import annotations

import pytest

from tuner.sim.args import parse_args
from tuner.sim.gpus import GPUS, get_gpu
from tuner.sim.memory import (
    MemoryPlan,
    capture_batch_sizes,
    cell_size_bytes,
    resolve_server_config,
)
from tuner.sim.models import GIB, load_model, weight_bytes_per_gpu
from tuner.sim.startup import plan_from_argv

REFERENCE = ["--model-path", "kimi-k2.5-int4", "--tp-size", "8", "--sim-gpu", "RTX-PRO-6000-96GB",
             "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/models/kimi-eagle3"]


def plan_for(argv: list[str]) -> MemoryPlan:
    return plan_from_argv(argv)[1]


def test_reference_deployment_at_0_88() -> None:
    plan = plan_for([*REFERENCE, "--mem-fraction-static", "0.88"])
    assert plan.failure is None
    assert plan.weight_bytes / GIB == pytest.approx(72.33, abs=0.005)
    assert plan.max_total_num_tokens == pytest.approx(159_277, rel=0.01)
    assert plan.kv_bytes / GIB == pytest.approx(10.42, abs=0.05)
    assert plan.target_cell_bytes == 70_272
    assert plan.baseline_bytes / GIB == pytest.approx(94.03, abs=0.1)
    assert plan.available_bytes / GIB == pytest.approx(7.43, abs=0.5)
    assert plan.max_running_requests == 48  # speculative decoding default (§1.5)
    assert len(plan.ranks) == 8


@pytest.mark.parametrize(("mfs", "tokens", "kv_gib"), [(0.90, 188_000, 12.30), (0.92, 217_000, 14.18),
                                                        (0.93, 231_000, 15.12)])
def test_reference_sensitivity_table(mfs: float, tokens: int, kv_gib: float) -> None:
    plan = plan_for([*REFERENCE, "--mem-fraction-static", str(mfs)])
    assert plan.max_total_num_tokens == pytest.approx(tokens, rel=0.01)
    assert plan.kv_bytes / GIB == pytest.approx(kv_gib, abs=0.05)


@pytest.mark.parametrize(
    ("version", "extra", "expected"),
    [
        ("0.5.5", [], [0.863, 0.861, 0.854, 0.848]),
        ("0.5.5", ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "d"],
         [0.842, 0.840, 0.833, 0.827]),
        ("0.5.10", [], [0.858, 0.857, 0.849, 0.844]),
    ],
)
def test_default_mem_fraction_static_table(version: str, extra: list[str], expected: list[float]) -> None:
    got = []
    for tp in (1, 2, 4, 8):
        parsed = parse_args(["--model-path", "llama-3.1-70b", "--sim-version", version, "--tp-size", str(tp),
                             "--sim-gpu", "RTX-PRO-6000-96GB", *extra])
        got.append(resolve_server_config(parsed, get_gpu("RTX-PRO-6000-96GB"),
                                         load_model("llama-3.1-70b")).mem_fraction_static)
    assert got == expected


@pytest.mark.parametrize(
    ("gpu", "tp", "version", "chunk", "max_bs"),
    [("L4-24GB", 1, "0.5.5", 2048, 24), ("L4-24GB", 4, "0.5.23", 4096, 160), ("L40S-48GB", 1, "0.5.5", 4096, 32),
     ("H100-80GB", 1, "0.5.5", 8192, 256), ("H100-80GB", 8, "0.5.10", 8192, 512),
     ("H200-141GB", 2, "0.5.5", 8192, 256)],
)
def test_chunk_and_graph_defaults_by_gpu(gpu: str, tp: int, version: str, chunk: int, max_bs: int) -> None:
    parsed = parse_args(["--model-path", "llama-3.1-8b", "--sim-gpu", gpu, "--tp-size", str(tp),
                         "--sim-version", version])
    cfg = resolve_server_config(parsed, get_gpu(gpu), load_model("llama-3.1-8b"))
    assert (cfg.chunked_prefill_size, cfg.cuda_graph_max_bs) == (chunk, max_bs)


def test_cell_sizes_follow_section_1_3() -> None:
    llama8, llama70, qwen, ds = (load_model(m) for m in ("llama-3.1-8b", "llama-3.1-70b", "qwen3-32b", "deepseek-v3"))
    assert cell_size_bytes(llama8, 1, 2) == 128 * 1024
    assert cell_size_bytes(llama70, 1, 2) == 320 * 1024
    assert cell_size_bytes(qwen, 1, 2) == 256 * 1024
    assert cell_size_bytes(llama8, 8, 2) == 128 * 1024 / 8
    assert cell_size_bytes(llama8, 16, 2) == cell_size_bytes(llama8, 8, 2)  # heads replicated past 8
    assert cell_size_bytes(ds, 1, 2) == cell_size_bytes(ds, 8, 2) == 70_272  # MLA: not divided by tp
    assert cell_size_bytes(llama8, 1, 1) == 64 * 1024  # fp8 KV


def test_parameter_counts_and_weights() -> None:
    assert load_model("llama-3.1-8b").params_total / 1e9 == pytest.approx(8.03, abs=0.01)
    assert load_model("llama-3.1-70b").params_total / 1e9 == pytest.approx(70.55, abs=0.01)
    assert load_model("qwen3-32b").params_total / 1e9 == pytest.approx(32.76, abs=0.01)
    ds = load_model("deepseek-v3")
    assert ds.params_total / 1e9 == pytest.approx(671, rel=0.005)
    assert ds.params_active / 1e9 == pytest.approx(37.5, rel=0.02)
    assert 7.9 < ds.weight_bits < 8.2 and ds.is_mla
    kimi = load_model("kimi-k2.5-int4")
    assert 4.5 < kimi.weight_bits < 5.0
    assert weight_bytes_per_gpu(kimi, 8) / GIB == pytest.approx(72.33, abs=0.005)
    assert weight_bytes_per_gpu(kimi, 4) > 1.9 * weight_bytes_per_gpu(kimi, 8)


def test_formula_page_rounding_and_dummy_rows() -> None:
    plan = plan_for(["--model-path", "llama-3.1-8b", "--mem-fraction-static", "0.8", "--page-size", "64"])
    base, post = plan.baseline_bytes, plan.post_load_bytes
    profiled = int((post - base * (1 - 0.8)) // (128 * 1024))
    assert plan.profiled_tokens == profiled
    assert plan.max_total_num_tokens == profiled // 64 * 64
    assert plan.kv_bytes == (plan.max_total_num_tokens + 64) * 128 * 1024
    assert plan.k_bytes == plan.v_bytes == plan.kv_bytes // 2
    r0 = plan.ranks[0]
    assert r0.after_pool == r0.after_weights - plan.kv_bytes - plan.req_to_token_bytes
    assert plan.req_to_token_bytes == plan.max_num_reqs * (131072 + 4) * 4


def test_max_total_tokens_cap_and_warning() -> None:
    capped = plan_for(["--model-path", "llama-3.1-8b", "--max-total-tokens", "10000"])
    assert capped.max_total_num_tokens == 10000 and not capped.warnings
    free = plan_for(["--model-path", "llama-3.1-8b"])
    assert capped.available_bytes > free.available_bytes  # memory freed by the cap stays free
    over = plan_for(["--model-path", "llama-3.1-8b", "--max-total-tokens", "9000000"])
    assert over.max_total_num_tokens == free.max_total_num_tokens
    assert over.warnings == (f"max_total_tokens=9000000 is larger than the profiled value "
                             f"{free.max_total_num_tokens}. Use the profiled value instead.",)


def test_max_running_requests_by_version() -> None:
    p = plan_for(["--model-path", "llama-3.1-8b"])
    assert p.max_num_reqs == 2048 and p.max_running_requests == 2048  # clamp(tokens/ctx*512, 2048, 4096)
    assert plan_for(["--model-path", "llama-3.1-8b", "--max-running-requests", "6000"]).max_running_requests == 6000
    assert plan_for(["--model-path", "llama-3.1-8b", "--max-running-requests", "6000",
                     "--sim-version", "0.5.10"]).max_running_requests == 2048
    small = plan_for(["--model-path", "llama-3.1-8b", "--max-running-requests", "6000", "--max-total-tokens",
                      "8000", "--sim-version", "0.5.23"])
    assert small.max_running_requests == 4000
    assert any("reduced from the requested 6000 to 4000" in w for w in small.warnings)


def test_capture_list_and_cut_at_max_running_requests() -> None:
    assert capture_batch_sizes(32, False) == (1, 2, 4, 8, 12, 16, 24, 32)
    assert len(capture_batch_sizes(512, False)) == 52
    assert capture_batch_sizes(48, True)[-4:] == (32, 40, 44, 48)
    # get_batch_sizes_to_capture: the pool size (max_running_requests) is added, then the sizes
    # above it dropped, so every batch the server can run has a graph (§2.1).
    plan = plan_for(["--model-path", "llama-3.1-8b", "--max-running-requests", "20"])
    assert plan.capture_bs == (1, 2, 4, 8, 12, 16, 20)
    exact = plan_for(["--model-path", "llama-3.1-8b", "--max-running-requests", "24"])
    assert exact.capture_bs == (1, 2, 4, 8, 12, 16, 24)
    # Below the pool the list stops at cuda_graph_max_bs: batches above it run eagerly.
    above = plan_for(["--model-path", "llama-3.1-8b", "--cuda-graph-max-bs", "32", "--max-running-requests", "48"])
    assert above.capture_bs == (1, 2, 4, 8, 12, 16, 24, 32)
    unpadded = plan_for(["--model-path", "llama-3.1-8b", "--cuda-graph-max-bs", "12", "--disable-cuda-graph-padding"])
    assert unpadded.capture_bs == tuple(range(1, 13))
    more = plan_for(["--model-path", "llama-3.1-8b", "--cuda-graph-max-bs", "512", "--max-running-requests", "4096"])
    assert more.graph_bytes > plan_for(["--model-path", "llama-3.1-8b"]).graph_bytes


def test_speculative_pool_rules_by_version() -> None:
    common = ["--model-path", "deepseek-v3", "--tp-size", "8", "--sim-gpu", "H200-141GB", "--mem-fraction-static",
              "0.85", "--speculative-algorithm", "NEXTN"]
    v55 = plan_for([*common, "--sim-version", "0.5.5"])
    v10 = plan_for([*common, "--sim-version", "0.5.10"])
    v23 = plan_for([*common, "--sim-version", "0.5.23"])
    # 0.5.5 adds the draft headroom: 48 × (3 × 1) + 48 × 4 + 100 = 436 tokens (§1.5).
    assert v55.max_total_num_tokens - v10.max_total_num_tokens == 436
    # 0.5.23 counts the draft's layers in the cell (1 MTP layer over 61) and its weights before profiling.
    assert v23.cell_bytes == pytest.approx(70_272 * (1 + 1 / 61))
    assert v23.max_total_num_tokens < v10.max_total_num_tokens / (1 + 1 / 61)
    assert v55.config.speculative.num_steps == 3 and v55.config.speculative.num_draft_tokens == 4


def test_foreign_memory_lowers_every_rank_or_trips_the_balance_check() -> None:
    alone = plan_for(["--model-path", "llama-3.1-70b", "--tp-size", "4", "--mem-fraction-static", "0.85"])
    shared = plan_for(["--model-path", "llama-3.1-70b", "--tp-size", "4", "--mem-fraction-static", "0.85",
                       "--sim-foreign-gib", "4"])
    assert shared.baseline_bytes == alone.baseline_bytes - 4 * GIB
    assert shared.max_total_num_tokens < alone.max_total_num_tokens
    unbalanced = plan_for(["--model-path", "llama-3.1-70b", "--tp-size", "4", "--sim-foreign-gib", "10"])
    assert unbalanced.failure is not None and unbalanced.failure.kind == "unbalanced"
    single = plan_for(["--model-path", "llama-3.1-8b", "--sim-foreign-gib", "10"])
    assert single.failure is None


def test_hicache_host_pool_per_rank() -> None:
    plan = plan_for(["--model-path", "llama-3.1-8b", "--tp-size", "4", "--sim-gpu", "L4-24GB",
                     "--enable-hierarchical-cache", "--hicache-size", "40", "--sim-host-memory-gib", "238"])
    assert plan.failure is None
    assert plan.hicache_host_bytes / 1e9 == pytest.approx(40, abs=0.01)
    ratio = plan_for(["--model-path", "llama-3.1-8b", "--enable-hierarchical-cache", "--hicache-ratio", "3"])
    assert ratio.hicache_host_tokens == ratio.max_total_num_tokens * 3 + 1
    tight = plan_for(["--model-path", "llama-3.1-8b", "--tp-size", "4", "--sim-gpu", "L4-24GB",
                      "--enable-hierarchical-cache", "--hicache-size", "60", "--sim-host-memory-gib", "200"])
    assert tight.failure is not None and tight.failure.kind == "host_memory" and tight.failure.rank == 3


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpu_presets_are_consistent(name: str) -> None:
    gpu = GPUS[name]
    assert gpu.memory_mib > 20000 and gpu.hbm_gb_s > 100 and gpu.bf16_tflops > 50
    assert get_gpu(name.lower()) is gpu


def test_0_5_23_hicache_ratio_shrinks_to_host_memory() -> None:
    roomy = plan_for(["--model-path", "llama-3.1-8b", "--sim-version", "0.5.23", "--enable-hicache", "--tp", "2"])
    assert roomy.hicache_host_tokens == 2 * roomy.max_total_num_tokens + 1
    tight = plan_for(["--model-path", "llama-3.1-8b", "--sim-version", "0.5.23", "--enable-hicache", "--tp", "2",
                      "--sim-host-memory-gib", "64"])
    assert tight.failure is None
    assert 2 * tight.hicache_host_bytes == pytest.approx(0.8 * 64 * GIB, rel=0.001)
    # an explicit ratio is kept (and then fails on host memory, per rank)
    fixed = plan_for(["--model-path", "llama-3.1-8b", "--sim-version", "0.5.23", "--enable-hicache", "--tp", "2",
                      "--sim-host-memory-gib", "64", "--hicache-ratio", "2"])
    assert fixed.failure is not None and fixed.failure.kind == "host_memory"
