"""The simulator's DeepSeek DSA model (DeepSeek-V3.2) follows SGLang 0.5.23's rules: the KV dtype and
backends picked by the GPU, the latent row each backend stores, the indexer replicated under DCP, the
forced page size, and SGLang's own refusals."""

from __future__ import annotations

import pytest

from tuner.sim.errors import SimError
from tuner.sim.memory import GIB
from tuner.sim.startup import plan_from_argv

LAYERS = 61


def _plan(gpu: str, *extra: str, version: str = "0.5.23"):
    argv = ["--model-path", "deepseek-v3.2", "--tp-size", "8", "--mem-fraction-static", "0.85", "--sim-gpu", gpu,
            "--sim-version", version, *extra]
    return plan_from_argv(argv)[1]


@pytest.mark.parametrize(("gpu", "extra", "dtype", "backends", "latent"), [
    ("B200-180GB", (), "fp8_e4m3", ("trtllm", "trtllm"), 576),  # SM100: auto -> fp8, trtllm's raw row
    ("H200-141GB", (), "bfloat16", ("flashmla_sparse", "fa3"), 1152),  # SM90: auto -> bf16
    ("H200-141GB", ("--kv-cache-dtype", "fp8_e4m3"), "fp8_e4m3", ("flashmla_kv", "flashmla_kv"), 656),  # scaled fp8 row
    ("B200-180GB", ("--kv-cache-dtype", "bf16"), "bfloat16", ("flashmla_sparse", "trtllm"), 1152),
    ("H200-141GB", ("--dcp-size", "8"), "bfloat16", ("trtllm", "trtllm"), 1152),  # _dsa_dcp_overrides
    ("B200-180GB", ("--dsa-prefill-backend", "tilelang", "--dsa-decode-backend", "tilelang"), "fp8_e4m3",
     ("tilelang", "tilelang"), 576),
])
def test_dtype_backends_and_row_by_gpu(gpu, extra, dtype, backends, latent):
    plan = _plan(gpu, *extra)
    cfg = plan.config
    assert plan.failure is None and cfg.dsa is not None
    assert (cfg.kv_cache_dtype, (cfg.dsa.prefill_backend, cfg.dsa.decode_backend)) == (dtype, backends)
    assert cfg.dsa.latent_row_bytes == latent and cfg.page_size == 64
    dcp = cfg.dcp_size
    assert plan.cell_bytes == (latent + 132 * dcp) * LAYERS  # the indexer row x dcp (sglang#31821)
    assert plan.max_total_num_tokens % 64 == 0
    assert cfg.server_args["attention_backend"] == "dsa" and cfg.server_args["kv_cache_dtype"] == dtype


def test_dcp_gain_is_below_dcp_because_the_indexer_is_replicated():
    plain, dcp = _plan("B200-180GB"), _plan("B200-180GB", "--dcp-size", "8")
    assert dcp.max_total_num_tokens < plain.max_total_num_tokens  # per rank: the indexer costs 8x
    gain = dcp.logical_tokens / plain.logical_tokens
    assert gain == pytest.approx(8 * 708 / (576 + 8 * 132), rel=0.002)  # 3.47x on the trtllm raw row, not 8x


def test_logged_kv_size_is_the_dsa_pool_with_its_indexer():
    """ladder-01's rule: KV size = (tokens + page) x (latent + indexer) x layers (656 + 132 = 788 B)."""
    plan = _plan("H200-141GB", "--kv-cache-dtype", "fp8_e4m3")
    assert plan.kv_bytes == (plan.max_total_num_tokens + 64) * 788 * LAYERS
    dcp = _plan("B200-180GB", "--dcp-size", "4")
    rows = dcp.max_total_num_tokens + 64
    assert dcp.kv_bytes == rows * 576 * LAYERS + rows * 4 * 132 * LAYERS  # index_key_cache.py: (size + page) x dcp rows
    assert dcp.kv_bytes / GIB < dcp.post_load_bytes / GIB


@pytest.mark.parametrize(("extra", "message"), [
    (("--kv-cache-dtype", "fp8_e5m2"), "DeepSeek DSA only supports bf16/bfloat16 or fp8_e4m3 kv_cache_dtype"),
    (("--dsa-decode-backend", "triton"), "triton DSA backend is only supported on ROCm/HIP"),
    (("--kv-cache-dtype", "fp8_e4m3", "--dsa-prefill-backend", "tilelang", "--dsa-decode-backend", "flashmla_kv"),
     "raw and scaled FP8 KV layouts cannot be mixed"),
    (("--kv-cache-dtype", "fp8_e4m3", "--dsa-prefill-backend", "tilelang", "--dsa-decode-backend", "tilelang", "--dcp-size", "2"),
     "CUDA TileLang FP8 KV does not support --dcp-size > 1"),
    (("--dcp-size", "8", "--enable-hierarchical-cache"), "DSA DCP does not support HiSparse or HiCache"),
    (("--dcp-size", "8", "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "2",
      "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"), "DSA DCP requires --speculative-eagle-topk 1"),
])
def test_refusals_are_sglangs(extra, message):
    with pytest.raises(SimError, match=message):
        _plan("B200-180GB", *extra)


def test_tilelang_fp8_needs_sm89():
    with pytest.raises(SimError, match="requires SM89 or newer"):
        plan_from_argv(["--model-path", "deepseek-v3.2", "--tp-size", "8", "--sim-gpu", "A100-80GB", "--sim-version", "0.5.23",
                        "--kv-cache-dtype", "fp8_e4m3", "--dsa-prefill-backend", "tilelang", "--dsa-decode-backend", "tilelang"])


def test_older_versions_are_a_stated_simulator_limit():
    with pytest.raises(SimError, match="0.5.23's rules only"):
        _plan("B200-180GB", version="0.5.10")


def test_dp_attention_keeps_the_dsa_cell_and_adds_replicated_weights():
    plain, dp = _plan("B200-180GB"), _plan("B200-180GB", "--enable-dp-attention", "--dp-size", "8")
    assert dp.cell_bytes == plain.cell_bytes  # MLA + indexer: one latent head, not split by attention TP
    assert dp.weight_bytes > plain.weight_bytes and dp.logical_tokens == 8 * dp.max_total_num_tokens
