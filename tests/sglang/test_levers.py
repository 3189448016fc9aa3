"""The structural levers' facts (tuner/sglang/levers.py, tuner/data/levers.json): flags per version
from the bundled tables, pool-sizing rules, the feasibility table with unknown kept unknown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.sglang.levers import (
    attention_type,
    dcp_gain,
    dcp_per_rank_cell_bytes,
    dp_attention_extra_weight_gib,
    draft_budget,
    feasibility,
    flag_available,
    gpu_arch,
    supporting_backend,
)
from tuner.sglang.memory import GIB, cell_size_bytes
from tuner.sglang.modelconfig import load_model_config, model_arch_from_dict

SHARED = Path(__file__).resolve().parents[3] / "shared"
KIMI = Path(__file__).resolve().parents[2] / "tuner" / "data" / "models"


def _kimi():
    for base in (KIMI / "kimi-k2.5-int4", SHARED / "models" / "kimi-k2.5-int4"):
        if base.exists():
            return load_model_config(base)
    pytest.skip("Kimi-K2.5 config not found")


V32 = model_arch_from_dict({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}, name="dsv32")


def test_dcp_exists_only_in_the_0523_table_and_between_tables_is_unknown():
    assert flag_available("0.5.5.post3", "dcp_size").ok is False
    assert flag_available("0.5.10", "dcp_size").ok is False
    assert flag_available("0.5.23", "dcp_size").ok is True
    between = flag_available("0.5.16", "dcp_size")
    assert between.ok is None and "unknown" in between.why


def test_kv_dtype_choices_are_read_from_the_table():
    assert flag_available("0.5.5", "kv_cache_dtype", "fp8_e4m3").ok is True
    assert flag_available("0.5.5", "kv_cache_dtype", "mxfp8").ok is False  # 0.5.23 only (§1.3)
    assert flag_available("0.5.23", "kv_cache_dtype", "mxfp8").ok is True


def test_dp_attention_weights_of_kimi_k25_at_dp8():
    """shared/cases/ladder/README.md: +8.55 GiB attention + 1.91 GiB embedding per GPU at tp 8, dp 8."""
    attn, emb = dp_attention_extra_weight_gib(_kimi(), tp=8, dp=8)
    assert attn == pytest.approx(8.55, abs=0.01)
    assert emb == pytest.approx(1.91, abs=0.01)
    half = dp_attention_extra_weight_gib(_kimi(), tp=8, dp=4)
    assert half[0] == pytest.approx(attn * (1 / 2 - 1 / 8) / (1 - 1 / 8), rel=1e-9)  # attn_tp 2
    assert dp_attention_extra_weight_gib(_kimi(), tp=8, dp=3) is None  # dp must divide tp


def test_dsa_cells_and_dcp_gain_of_ladder_01():
    """ladder-01: (656 + 132) × 61 = 48,068 B; (975,424 + 64) rows = 43.67 GiB logged."""
    cell = cell_size_bytes(V32, tp=8, kv_cache_dtype="fp8_e4m3", dp_attention_size=8)
    assert cell == 48068
    assert (975424 + 64) * cell / GIB == pytest.approx(43.67, abs=0.005)
    assert attention_type(V32) == "dsa"
    assert dcp_per_rank_cell_bytes(cell, V32, 8) == (656 + 132 * 8) * 61
    assert dcp_gain(cell, V32, 8) == pytest.approx(3.68, abs=0.005)
    kimi = _kimi()
    plain = cell_size_bytes(kimi, tp=8)
    assert plain == 70272 and dcp_gain(plain, kimi, 8) == 8.0


def test_fp8_kv_on_sm120_mla_needs_the_triton_path_of_sglang_20479():
    assert gpu_arch("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "sm120"
    assert gpu_arch("RTX-PRO-6000-96GB") == "sm120"
    old = feasibility("fp8_kv", gpu="RTX PRO 6000", version="0.5.5", backend="triton", attention="mla")
    new = feasibility("fp8_kv", gpu="RTX PRO 6000", version="0.5.23", backend="triton", attention="mla")
    assert old.ok is False and new.ok is True and "20479" in new.why
    assert supporting_backend("fp8_kv", gpu="sm120", version="0.5.23", attention="mla") == "triton"


def test_unknown_cells_are_unknown_never_yes():
    assert feasibility("fp8_kv", gpu=None, version="0.5.23", backend=None, attention="mla").ok is None
    assert feasibility("dcp", gpu="H100", version="0.5.23", backend="fa3", attention="mha").ok is None
    assert feasibility("fp8_kv", gpu="Some GPU", version="0.5.23", backend="triton", attention="mla").ok is None


def test_every_feasibility_cell_names_its_source():
    data = json.loads((Path(__file__).resolve().parents[2] / "tuner" / "data" / "levers.json").read_text())
    for cell in data["feasibility"]:
        assert cell["source"] and cell["supported"] in (True, False, None)


def test_draft_budget_per_version():
    assert draft_budget("0.5.5.post3").draft_kv == "reserve" and draft_budget("0.5.5").headroom
    assert draft_budget("0.5.16").draft_kv == "cell" and draft_budget("0.5.16").draft_weights == "reserve"
    assert draft_budget("0.5.23").draft_weights == "budget"
