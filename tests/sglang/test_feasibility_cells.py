"""Feasibility cells settled from SGLang's released source (issue 44): fp8 KV and DCP on the
common architecture × backend × attention cells of 0.5.5 (flag table 0.5.5.post3), 0.5.10 and
0.5.23, each read back with its source; Kimi-K2.5 and DeepSeek-V3 at tp 8 on H200 (SM90, SGLang's
default MLA backend fa3) now get an fp8 rung, and a cell that says unsupported still refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.config import SpaceSection
from tuner.sglang.levers import feasibility
from tuner.sglang.modelconfig import load_model_config
from tuner.study.lever_space import derive_levers

MODELS = Path(__file__).resolve().parents[2] / "tuner" / "data" / "models"
H200 = "H200-141GB"
READ = ("0.5.5", "0.5.10", "0.5.23")


def _derive(model: str, version: str, **flags):
    return derive_levers(SpaceSection(), {"tp_size": 8, **flags}, version=version, gpu=H200,
                         model=load_model_config(MODELS / model))


@pytest.mark.parametrize("model", ["kimi-k2.5-int4", "deepseek-v3"])
@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
def test_mla_on_h200_derives_fp8_kv_on_sglangs_default_fa3(model: str, version: str):
    choice = _derive(model, version)
    assert choice.of("kv_cache_dtype") == ("auto", "fp8_e4m3")
    fp8, dcp, _ = choice.reasons
    assert "derived: auto, fp8_e4m3" in fp8 and "default backend here is fa3" in fp8
    assert "get_key_buffer(layer.layer_id).to(q.dtype)" in fp8  # the deciding line, quoted
    if version == "0.5.5":
        assert choice.of("dcp_size") is None and "has no --dcp-size" in dcp
    else:  # fa3 has no DCP path in 0.5.23 and nothing refuses it: unknown, not guessed
        assert choice.of("dcp_size") is None and "not derived" in dcp and "unknown" in dcp


@pytest.mark.parametrize("model", ["kimi-k2.5-int4", "deepseek-v3"])
@pytest.mark.parametrize("backend", ["flashinfer", "flashmla"])
def test_mla_on_h200_derives_dcp_where_the_backend_has_it_on_0523(model: str, backend: str):
    choice = _derive(model, "0.5.23", attention_backend=backend)
    assert choice.of("kv_cache_dtype") == ("auto", "fp8_e4m3")
    assert choice.of("dcp_size") == (1, 8, 4)
    assert ("31514" if backend == "flashinfer" else "flashmla_backend.py") in choice.reasons[1]
    assert _derive(model, "0.5.5", attention_backend=backend).of("dcp_size") is None  # no flag on 0.5.5


# (lever, arch, backend, attention, value, version) -> verdict, a fragment of its source
CELLS = [
    ("fp8_kv", "sm90", "fa3", "mla", None, True, "flashattention_backend.py"),
    ("fp8_kv", "sm90", "fa3", "mla", "fp8_e5m2", False, "Setting attention backend to triton"),
    ("fp8_kv", "sm100", "fa3", "mla", None, False, "requires SM>=80 and SM<=90"),
    ("fp8_kv", "sm80", "fa3", "mla", None, False, "requires SM>=80 and SM<=90"),
    ("fp8_kv", "sm90", "flashinfer", "mla", None, True, "flashinfer_mla_backend.py"),
    ("fp8_kv", "sm80", "flashinfer", "mla", None, True, "flashinfer_mla_backend.py"),
    ("fp8_kv", "sm90", "flashmla", "mla", None, True, "float8_e4m3fn"),
    ("fp8_kv", "sm90", "flashmla", "mla", "fp8_e5m2", None, "kernel build"),
    ("fp8_kv", "sm90", "trtllm_mla", "mla", None, False, "only supported on Blackwell"),
    ("fp8_kv", "sm100", "trtllm_mla", "mla", "fp8_e5m2", False, "only supports kv-cache-dtype of fp8_e4m3"),
    ("fp8_kv", "sm90", None, "dsa", None, True, "flashmla_kv"),
]


@pytest.mark.parametrize("lever, arch, backend, attention, value, ok, source", CELLS)
@pytest.mark.parametrize("version", READ)
def test_each_settled_cell_reads_back_with_its_source(lever, arch, backend, attention, value, ok, source, version):
    verdict = feasibility(lever, gpu=arch, version=version, backend=backend, attention=attention, value=value)
    assert verdict.ok is ok and source in verdict.why, verdict.why


def test_0523_only_cells_and_dcp_refusals():
    def cell(lever: str, arch: str, backend: str, value: str | None = None, version: str = "0.5.23"):
        return feasibility(lever, gpu=arch, version=version, backend=backend, attention="mla", value=value)

    assert cell("fp8_kv", "sm90", "triton").ok is True and "20479" in cell("fp8_kv", "sm90", "triton").why
    assert cell("fp8_kv", "sm90", "triton", version="0.5.10").ok is None  # read at 0.5.23 only
    assert cell("fp8_kv", "sm100", "cutedsl_mla").ok is True and cell("fp8_kv", "sm90", "cutedsl_mla").ok is False
    assert cell("dcp", "sm90", "flashmla").ok is True
    refused = cell("dcp", "sm90", "flashmla", "fp8_e4m3")  # a DCP rung with an fp8 cache on FlashMLA
    assert refused.ok is False and "FlashMLA does not support DCP for FP8 kv cache" in refused.why
    assert cell("dcp", "sm120", "triton").ok is True and cell("dcp", "sm120", "triton", "fp8_e4m3").ok is None
    assert cell("dcp", "sm90", "fa3").ok is None  # no DCP path in fa3 and no refusal: unknown


def test_a_release_between_the_ones_read_stays_unknown():
    assert feasibility("fp8_kv", gpu="sm90", version="0.5.16", backend="fa3", attention="mla").ok is None
    assert feasibility("fp8_kv", gpu="sm90", version="0.5.5.post3", backend="fa3", attention="mla").ok is True


def test_an_unsupported_cell_still_refuses_the_rung():
    # trtllm_mla on Hopper: the table says no, so no fp8 rung is derived on it
    choice = _derive("deepseek-v3", "0.5.23", attention_backend="trtllm_mla")
    assert choice.of("kv_cache_dtype") is None and "not supported" in choice.reasons[0]
    assert "only supported on Blackwell" in choice.reasons[0]
