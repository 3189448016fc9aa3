"""The KV-capacity model: cell sizes from config.json, calibration on the reference deployment (§1.8),
predictions, fractions, headroom, and the monotone bounds the study uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.errors import ModelConfigError
from tuner.sglang.failures import FailureClass
from tuner.sglang.logs import read_log
from tuner.sglang.memory import GIB, KVCapacityModel, cell_size_bytes, must_fail, req_to_token_gib
from tuner.sglang.modelconfig import load_model_config, model_arch_from_dict

MODELS = Path(__file__).resolve().parent / "models"
REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "logs" / "reference-0.5.5-tp8.log"


@pytest.mark.parametrize(
    ("model", "tp", "dtype", "version", "spec", "expected"),
    [
        ("llama-3.1-8b", 1, "auto", "0.5.5", None, 128 * 1024),
        ("llama-3.1-70b", 1, "auto", "0.5.5", None, 320 * 1024),
        ("qwen3-32b", 1, "auto", "0.5.5", None, 256 * 1024),
        ("llama-3.1-8b", 8, "auto", "0.5.5", None, 16384),  # one KV head per rank
        ("llama-3.1-8b", 16, "auto", "0.5.5", None, 16384),  # replicated below one head per rank
        ("llama-3.1-8b", 1, "fp8_e4m3", "0.5.5", None, 64 * 1024),
        ("deepseek-v3", 1, "auto", "0.5.5", None, 70272),
        ("deepseek-v3", 8, "auto", "0.5.5", None, 70272),  # MLA is not divided by tp
        ("kimi-k2.5-int4", 8, "auto", "0.5.5", None, 70272),
        ("deepseek-v3", 8, "auto", "0.5.10", "EAGLE", 70272),  # draft KV outside the cell before 0.5.16
        ("deepseek-v3", 8, "auto", "0.5.23", "EAGLE", 70272 + 70272 // 61),  # × (1 + 1 MTP layer / 61)
    ],
)
def test_cell_size(model: str, tp: int, dtype: str, version: str, spec: str | None, expected: int) -> None:
    arch = load_model_config(MODELS / model)
    assert cell_size_bytes(arch, tp=tp, kv_cache_dtype=dtype, version=version, speculative_algorithm=spec) == pytest.approx(expected, abs=1)


def test_model_config_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 32}))
    with pytest.raises(ModelConfigError, match="lacks num_hidden_layers"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not JSON"):
        load_model_config(tmp_path / "config.json")
    with pytest.raises(ModelConfigError, match="does not exist"):
        load_model_config(tmp_path / "nope")
    wrapped = {"architectures": ["X"], "text_config": json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())}
    assert model_arch_from_dict(wrapped).num_layers == 32
    fp8kv = {**json.loads((MODELS / "qwen3-32b" / "config.json").read_text()), "quantization_config": {"kv_cache_quant_algo": "FP8"}}
    assert cell_size_bytes(model_arch_from_dict(fp8kv)) == 128 * 1024


@pytest.fixture(scope="module")
def reference() -> KVCapacityModel:
    report = read_log(REFERENCE)
    cell = cell_size_bytes(load_model_config(MODELS / "kimi-k2.5-int4"), tp=8)
    return KVCapacityModel.from_report(report, cell, 0.88)


def test_reference_calibration_reproduces_section_1_8(reference: KVCapacityModel) -> None:
    m = reference
    assert m.baseline_gib == pytest.approx(94.03) and m.static_gib == pytest.approx(72.33, abs=0.02)
    assert m.tokens(0.88) == 159277
    assert m.tokens_per_hundredth() == pytest.approx(14_400, rel=0.01)
    # §1.8 sensitivity table: mfs → (KV GiB, ≈tokens, free after graphs)
    for mfs, kv, tokens, free in ((0.90, 12.30, 188_000, 5.55), (0.92, 14.18, 217_000, 3.67), (0.93, 15.12, 231_000, 2.73)):
        assert m.kv_budget_gib(mfs) == pytest.approx(kv, abs=0.02)
        assert m.tokens(mfs) == pytest.approx(tokens, rel=0.005)
        assert m.headroom_gib(mfs, max_running_requests=2048, context_len=163840) == pytest.approx(free, abs=0.02)
    assert m.reserve_gib(0.88) == pytest.approx(11.28, abs=0.01)
    assert m.observed_req_to_token_gib == pytest.approx(1.25, abs=0.01)


def test_fractions(reference: KVCapacityModel) -> None:
    m = reference
    low = m.min_fraction()
    assert m.tokens(low + 1e-6) >= 1 and m.tokens(low - 0.001) <= 0
    assert m.tokens(0.7) < 0  # weights alone exceed 0.7 × B: startup KV OOM
    f = m.fraction_for_tokens(200_000, page_size=64)
    assert m.tokens(f + 1e-9, page_size=64) >= 200_000 > m.tokens(f - 0.0005, page_size=64)
    assert m.tokens(0.9, page_size=64) % 64 == 0
    assert m.tokens(0.9, max_total_tokens=100_000) == 100_000


def test_first_principles_matches_the_reference_start() -> None:
    m = KVCapacityModel.from_first_principles(gpu_total_gib=97887 / 1024, weight_gib=72.33, cell_bytes=70272)
    assert m.tokens(0.88) == pytest.approx(159277, rel=0.01)
    assert m.headroom_gib(0.88, max_running_requests=2048, context_len=163840, cuda_graph_max_bs=256, chunked_prefill_size=8192) < m.reserve_gib(0.88)


def test_calibration_with_a_cap_uses_the_memory_lines() -> None:
    report = read_log(REFERENCE)
    capped = KVCapacityModel.from_report(report, 70272, 0.88, max_total_tokens=159277)
    assert capped.static_gib == pytest.approx(94.03 - 21.70)
    assert capped.tokens(0.95) == 159277  # the cap holds at every fraction
    assert req_to_token_gib(2048, 163840) == pytest.approx(2048 * 163844 * 4 / GIB)


def test_must_fail() -> None:
    base = {"tp_size": 8, "max_running_requests": 256, "cuda_graph_max_bs": 128, "chunked_prefill_size": 8192}
    graph_oom = ({**base, "mem_fraction_static": 0.92}, FailureClass.CUDA_GRAPH_OOM)
    kv_oom = ({**base, "mem_fraction_static": 0.80}, FailureClass.STARTUP_KV_OOM)
    runtime = ({**base, "mem_fraction_static": 0.85}, FailureClass.RUNTIME_OOM)
    failures = [runtime, kv_oom, graph_oom]
    assert must_fail({**base, "mem_fraction_static": 0.94}, failures) == (True, 2)
    assert must_fail({**base, "mem_fraction_static": 0.94, "cuda_graph_max_bs": 256}, failures) == (True, 2)
    assert must_fail({**base, "mem_fraction_static": 0.94, "cuda_graph_max_bs": 64}, failures) == (False, None)  # less reserve use
    assert must_fail({**base, "mem_fraction_static": 0.94, "chunked_prefill_size": -1}, failures) == (True, 2)  # no chunking = larger
    assert must_fail({**base, "mem_fraction_static": 0.90}, failures) == (False, None)
    assert must_fail({**base, "mem_fraction_static": 0.78, "max_running_requests": 64}, failures) == (True, 1)
    assert must_fail({**base, "mem_fraction_static": 0.94, "tp_size": 4}, failures) == (False, None)  # another knob differs
    assert must_fail({**base, "mem_fraction_static": 0.5}, [({**base, "mem_fraction_static": 0.9}, FailureClass.WEIGHT_LOAD_OOM)]) == (True, 0)


def test_effective_max_running_requests() -> None:
    from tuner.sglang.memory import effective_max_running_requests as eff

    assert eff(159277, 163840) == 2048  # §2.3's reference example
    assert eff(159277, 163840, requested=3000, version="0.5.5") == 3000
    assert eff(159277, 163840, requested=3000, version="0.5.10") == 2048  # capped by the estimate
    assert eff(1000, 4096, requested=3000, version="0.5.23") == 500  # tokens // 2
    assert eff(2980168, 32768) == 4096  # case-21
    assert eff(500000, 131072, speculative_algorithm="EAGLE") == 48


def test_must_fail_host_memory() -> None:
    base = {"enable_hierarchical_cache": True, "tp_size": 4, "max_running_requests": 128}
    failed = [({**base, "hicache_ratio": 3.0, "mem_fraction_static": 0.85}, FailureClass.HOST_MEMORY)]
    assert must_fail({**base, "hicache_ratio": 3.5, "mem_fraction_static": 0.88, "max_running_requests": 64}, failed) == (True, 0)
    assert must_fail({**base, "hicache_ratio": 3.5, "mem_fraction_static": 0.80}, failed) == (False, None)  # smaller device pool
    assert must_fail({**base, "hicache_ratio": 2.0, "mem_fraction_static": 0.88}, failed) == (False, None)
    assert must_fail({**base, "enable_hierarchical_cache": False, "hicache_ratio": 3.5, "mem_fraction_static": 0.9}, failed) == (False, None)
    by_size = [({**base, "hicache_size": 40, "mem_fraction_static": 0.9}, FailureClass.HOST_MEMORY)]
    assert must_fail({**base, "hicache_size": 40, "mem_fraction_static": 0.5}, by_size) == (True, 0)  # size overrides the ratio
    assert must_fail({**base, "hicache_size": 30, "mem_fraction_static": 0.95}, by_size) == (False, None)
