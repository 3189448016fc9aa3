"""The structural-levers ladder (tuner/sglang/ladder.py): on the reference deployment's log through the
installed CLI, and against the handed real pairs of shared/cases/ladder (ladder-01, ladder-06, ladder-09)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import run_tuner
from tuner.knobs import LEVERS
from tuner.sglang.explain import explain_from
from tuner.sglang.ladder import LadderBase, Rung, evaluate, ladder
from tuner.sglang.logs import parse_log
from tuner.sglang.memory import GIB, KVCapacityModel, cell_size_bytes
from tuner.sglang.modelconfig import model_arch_from_dict

HERE = Path(__file__).resolve().parent
REFERENCE = HERE.parents[0] / "fixtures" / "logs" / "reference-0.5.5-tp8.log"
KIMI = HERE.parents[1] / "tuner" / "data" / "models" / "kimi-k2.5-int4"
LADDER = HERE.parents[0] / "fixtures" / "ladder"  # copies of shared/cases/ladder
FIELDS = {"lever", "tokens_per_rank", "logical_tokens", "per_request_max_tokens", "free_after_graphs_gib", "starts", "available",
          "changes_numerics", "why"}


def _rung(rungs: list[Rung], **lever: Any) -> Rung:
    found = [r for r in rungs if all(r.lever.get(k) == v for k, v in lever.items()) and set(lever) <= set(r.lever)
             and ("mem_fraction_static" in lever or "mem_fraction_static" not in r.lever)]
    assert found, f"no rung {lever} in {[r.lever for r in rungs]}"
    return min(found, key=lambda r: len(r.lever))


@pytest.fixture(scope="module")
def reference() -> list[Rung]:
    return explain_from(structural=LEVERS, log=str(REFERENCE), model_config=str(KIMI), gpu="NVIDIA RTX PRO 6000 Blackwell Server Edition").ladder


def test_reference_as_observed_and_the_fraction_ceiling(reference):
    now = reference[0]
    assert now.lever == {} and now.tokens_per_rank == 159277 and now.logical_tokens == 159277 and now.starts is True
    top = next(r for r in reference if set(r.lever) == {"mem_fraction_static"})
    ceil = top.lever["mem_fraction_static"]
    assert 0.95 <= ceil < 0.96 and top.starts is True and 0 <= top.free_after_graphs_gib < 0.2
    assert 1.6 < top.tokens_per_rank / 159277 < 1.75  # the issue: the fraction alone gives at most ~1.6-1.7x
    base = explain_from(structural=LEVERS, log=str(REFERENCE), model_config=str(KIMI)).ladder
    assert base[0].tokens_per_rank == 159277


def test_reference_fp8_doubles_the_pool_with_the_sm120_backend_condition(reference):
    fp8 = _rung(reference, kv_cache_dtype="fp8_e4m3")
    # 0.5.5 adds 2048 × 3 × 1 + 2048 × 4 + 100 = 14,436 speculative headroom rows to the profiled pool
    # (§1.5); the profiled part doubles, the headroom does not
    headroom = 14436
    assert (fp8.tokens_per_rank - headroom) / (159277 - headroom) == pytest.approx(2.0, rel=0.001)
    assert "14,436 speculative headroom" in fp8.why
    assert fp8.lever.get("attention_backend") == "triton" and fp8.changes_numerics is True
    assert fp8.available is False and "20479" in fp8.why  # the Triton MLA fp8 path is not in 0.5.5
    unknown_gpu = _rung(explain_from(structural=LEVERS, log=str(REFERENCE), model_config=str(KIMI)).ladder, kv_cache_dtype="fp8_e4m3")
    assert unknown_gpu.available is None  # no GPU given: unknown, never guessed yes


def test_reference_dp_attention_does_not_start_at_088_and_names_the_fraction_it_needs(reference):
    dp = _rung(reference, enable_dp_attention=True, dp_size=8)
    assert dp.starts is False and dp.tokens_per_rank is not None and dp.tokens_per_rank <= 0
    assert "+8.55 GiB" in dp.why and "+1.91 GiB" in dp.why and "0.88 × baseline 94.03" in dp.why
    assert "needs mem_fraction_static ≥ 0.890" in dp.why  # 0.5.5 headroom per DP rank is 1/8 of 14,436
    higher = _rung(reference, enable_dp_attention=True, dp_size=8, mem_fraction_static=next(
        r.lever["mem_fraction_static"] for r in reference if r.lever.get("dp_size") == 8 and "mem_fraction_static" in r.lever))
    assert higher.starts is True and higher.logical_tokens == 8 * higher.tokens_per_rank
    assert higher.per_request_max_tokens == higher.tokens_per_rank - 1  # one request fits one DP rank's pool


def test_reference_dcp_is_unavailable_on_055_and_priced_on_0523(reference):
    dcp = _rung(reference, dcp_size=8)
    assert dcp.available is False and "has no --dcp-size" in dcp.why and "0.5.23" in dcp.why
    assert dcp.logical_tokens == 8 * dcp.tokens_per_rank and dcp.per_request_max_tokens == 163839
    # 0.5.23 counts the EAGLE head in the cell (×62/61) and the draft weights (0.78 GiB) before profiling
    # (0.5.23 has no headroom rows: the budget is the profiled one, 159,277 − 14,436 tokens' worth)
    budget = (159277 - 14436) * 70272 / GIB
    assert dcp.tokens_per_rank == pytest.approx((budget - 0.78) * GIB / (70272 * 62 / 61), rel=0.01)


def test_explain_json_has_the_ladder_with_exactly_its_fields():
    proc = run_tuner("explain", "--log", str(REFERENCE), "--model-config", str(KIMI), "--gpu", "sm120", "--json")
    assert proc.returncode == 0, proc.stderr
    rungs = json.loads(proc.stdout)["ladder"]
    assert len(rungs) >= 8 and all(set(r) == FIELDS for r in rungs)
    assert all(r["starts"] in (True, False, None) and r["available"] in (True, False, None) for r in rungs)
    text = run_tuner("explain", "--log", str(REFERENCE), "--model-config", str(KIMI), "--gpu", "sm120")
    assert "Structural levers" in text.stdout and "--dcp-size 8" in text.stdout


def _case(name: str) -> dict[str, Any]:
    path = LADDER / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path} not present")
    return json.loads(path.read_text())


def test_ladder_01_dsa_per_rank_pool_under_dp_attention():
    """ladder-01 (8x B200, DeepSeek-V3.2, tp 8 dp 8): the logged KV size prices the DSA cell exactly, and
    the ladder's as-observed rung counts 8 DP pools; the unpriced indexer is the ×1.20 error the
    derived check names."""
    case = _case("ladder-01")
    arch = case["model"]
    model = model_arch_from_dict({"num_hidden_layers": arch["num_hidden_layers"], "kv_lora_rank": arch["kv_lora_rank"],
                                  "qk_rope_head_dim": arch["qk_rope_head_dim"], "index_head_dim": arch["index_head_dim"]}, name="v32")
    cell = cell_size_bytes(model, tp=8, kv_cache_dtype="fp8_e4m3", dp_attention_size=8)
    observed = case["lever"]["observed"]
    kv_gib, tokens = observed["kv_size_gb"], observed["max_total_num_tokens"]
    page = 64
    # the budget the logged KV size implies (rows = tokens + one page, §1.3), at the PR's fraction
    baseline = 180.0
    mem = KVCapacityModel(baseline_gib=baseline, static_gib=0.8 * baseline - kv_gib, cell_bytes=cell, observed_mem_fraction_static=0.8,
                          observed_tokens=tokens)
    base = LadderBase(levers=LEVERS, memory=mem, model=model, version="0.5.5", tp=8, dp=8, mem_fraction_static=0.8, kv_cache_dtype="fp8_e4m3",
                      page_size=page, context_len=163840, gpu="B200", flags={"enable_dp_attention": True, "kv_cache_dtype": "fp8_e4m3"})
    now = ladder(base)[0]
    assert now.tokens_per_rank == pytest.approx(case["expected"]["tokens_per_rank"], rel=0.01)
    assert now.logical_tokens == 8 * now.tokens_per_rank
    assert now.logical_tokens == pytest.approx(case["expected"]["logical_tokens"], rel=0.01)
    without_indexer = (arch["kv_lora_rank"] + arch["kv_lora_rank"] / 128 * 4 + arch["qk_rope_head_dim"] * 2) * arch["num_hidden_layers"]
    assert cell / without_indexer == pytest.approx(48068 / 40016, rel=1e-4)
    # DCP 8 on 0.5.23 with the indexer replicated: not 8x. 0.5.23 defaults both DSA backends to trtllm
    # under DCP (_dsa_dcp_overrides), whose latent row is raw 576 B (calculate_mla_kv_cache_dim; SGLang's
    # CPU test asserts (576 + 132 x 8) x L), so from this 656 + 132 B start: 8 x 788 / 1632 = 3.86x
    dcp = evaluate(LadderBase(**{**base.model_dump(), "dp": 1, "flags": {"kv_cache_dtype": "fp8_e4m3"}}), {"dcp_size": 8}, version="0.5.23")
    assert dcp.logical_tokens / now.tokens_per_rank == pytest.approx(8 * 788 / (576 + 8 * 132), rel=0.01)
    # with a scaled-row backend named (flashmla_kv), the latent keeps 656 B: the 3.68x of the README's formula
    scaled = evaluate(LadderBase(**{**base.model_dump(), "dp": 1, "flags": {"kv_cache_dtype": "fp8_e4m3"}}),
                      {"dcp_size": 8, "dsa_prefill_backend": "flashmla_kv", "dsa_decode_backend": "flashmla_kv"}, version="0.5.23")
    assert scaled.logical_tokens / now.tokens_per_rank == pytest.approx(3.68, rel=0.01)


def test_ladder_06_hybrid_gdn_cell_and_no_guessed_speculative_rung():
    """ladder-06 (hybrid GDN, 16 of 64 layers full attention, fp8 KV from the checkpoint, DFLASH on vs off):
    the hybrid cell prices both logged K sizes (same budget rule: 1 %); the spec-on rung is NOT
    reproducible from the facts held (the case's derived check: draft weights, draft KV and verify
    scratch split with the GDN state pool, no weights line), so the ladder neither offers a spec-on
    rung nor prices spec off without the draft's weight line: it says so instead of guessing."""
    case = _case("ladder-06")
    arch = case["model"]
    config = {"num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": arch["num_key_value_heads"],
              "head_dim": arch["head_dim"], "full_attention_interval": 4, "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}}
    model = model_arch_from_dict(config, name="qwen-gdn")
    assert model.kv_layers == arch["full_attention_layers"] == 16
    cell = cell_size_bytes(model)  # auto -> fp8 (kv_cache_quant_algo FP8), K + V over the 16 full-attention layers
    assert cell == 2 * 16 * 4 * 256
    for arm in ("baseline", "lever"):
        obs = case[arm]["observed"]
        assert obs["max_total_num_tokens"] * cell / 2 / GIB == pytest.approx(obs["k_size_gb"], rel=0.01)
    parsed = parse_log(" ".join(case["lever"]["log_excerpt"].split()))  # the case wraps the quoted line
    one = next(iter(parsed.ranks.values()))
    assert (one.kv_tokens, one.k_size_gib, one.v_size_gib) == (117125, 1.79, 1.79)
    # the same model written as Qwen3.5's layer_types list
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]
    assert model_arch_from_dict({**config, "full_attention_interval": None, "layer_types": types}).kv_layers == 16
    base_mem = KVCapacityModel(baseline_gib=25.0, static_gib=25.0 * 0.8 - case["baseline"]["observed"]["max_total_num_tokens"] * cell / GIB,
                               cell_bytes=cell, observed_mem_fraction_static=0.8, observed_tokens=case["baseline"]["observed"]["max_total_num_tokens"])
    off = LadderBase(levers=LEVERS, memory=base_mem, model=model, version="0.5.23", mem_fraction_static=0.8, context_len=262144)
    assert not any(r.lever.get("speculative_algorithm") for r in ladder(off))  # no spec-on rung is offered
    lever_mem = base_mem.model_copy(update={"observed_tokens": case["lever"]["observed"]["max_total_num_tokens"]})
    on = LadderBase(**{**off.model_dump(), "memory": lever_mem, "speculative_algorithm": "DFLASH"})
    spec_off = evaluate(on, {"speculative_algorithm": None})
    assert spec_off.tokens_per_rank is None and "draft's weight line" in spec_off.why


def test_ladder_09_fraction_rungs_from_one_start_at_065():
    """ladder-09: one start at 0.65 with 0.00 GB free after graphs; 0.66/0.67/0.70 OOM, 0.55-0.65 start."""
    case = _case("ladder-09")
    arch = case["model"]
    model = model_arch_from_dict({"num_hidden_layers": arch["num_hidden_layers"], "num_attention_heads": 8, "num_key_value_heads": arch["num_key_value_heads"],
                                  "head_dim": arch["head_dim"], "hidden_size": 2560}, name="gemma3")
    cell = cell_size_bytes(model)
    assert cell == 139264
    obs = case["baseline"]["observed"]
    baseline = 22.4  # derived in the case (weights ~8.6 GiB + KV 5.98 GiB) / 0.65
    mem = KVCapacityModel(baseline_gib=baseline, static_gib=0.65 * baseline - (obs["max_total_num_tokens"] + 0.5) * cell / GIB, cell_bytes=cell,
                          observed_mem_fraction_static=0.65, observed_tokens=obs["max_total_num_tokens"],
                          observed_free_after_graphs_gib=obs["avail_after_graphs_gb"])
    base = LadderBase(levers=LEVERS, memory=mem, model=model, mem_fraction_static=0.65, context_len=131072)
    rungs = ladder(base)
    assert rungs[0].tokens_per_rank == obs["max_total_num_tokens"]
    ceiling = next(r for r in rungs if set(r.lever) == {"mem_fraction_static"})
    assert ceiling.lever["mem_fraction_static"] == 0.65
    for fraction, feasible in case["expected"]["feasible"].items():
        assert evaluate(base, {"mem_fraction_static": float(fraction)}).starts is feasible, fraction
    fp8 = _rung(rungs, kv_cache_dtype="fp8_e4m3")
    assert fp8.tokens_per_rank == pytest.approx(2 * obs["max_total_num_tokens"], rel=0.01) and fp8.available is None
