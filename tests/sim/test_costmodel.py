"""The simulator's cost model: calibration against aiconfigurator, and the shape of step times."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from importlib import resources

import pytest

from tuner.sim import costmodel
from tuner.sim.costmodel import CostFactors, CostInputs, StepShape, activation_bytes, decode_step_s, step_time_s
from tuner.sim.gpus import get_gpu
from tuner.sim.models import load_model, weight_bytes_per_gpu


def inputs(model: str = "llama-3.1-8b", gpu: str = "H100-80GB", tp: int = 1, **kw) -> CostInputs:
    m = load_model(model)
    if m.is_mla:
        cell = (m.kv_lora_rank + m.qk_rope_head_dim) * m.num_layers * 2
    else:
        cell = 2 * max(1, m.num_kv_heads // tp) * m.head_dim * m.num_layers * 2
    return CostInputs.from_specs(m, get_gpu(gpu), tp_size=tp, kv_cell_bytes=cell,
                                 weight_bytes_per_gpu=weight_bytes_per_gpu(m, tp), **kw)


def calibration() -> dict:
    return json.loads((resources.files("tuner.sim") / "data" / "calibration.json").read_text())


def test_code_constants_are_the_calibrated_factors():
    assert calibration()["fitted_factors"] == asdict(CostFactors())


def test_reproduces_aiconfigurator_sglang_estimates():
    points = calibration()["points"]
    assert len(points) >= 100
    errors, prefill_errors, moe_errors = [], [], []
    for p in points:
        c = inputs(p["model"], p["gpu"], p["tp"])
        if p["kind"] == "decode_tpot_ms":
            ms = 1e3 * decode_step_s(c, p["batch_size"], p["batch_size"] * (p["isl"] + p["osl"] // 2), eager=False)
        else:
            isl = p["isl"]
            ms = 1e3 * step_time_s(c, StepShape(isl, 1, isl * (isl + 1) / 2, isl, eager=False))
        assert ms == pytest.approx(p["costmodel_ms"], rel=1e-3)
        e = math.log(ms / p["aiconfigurator_ms"])
        if p["model"] == "deepseek-v3":
            moe_errors.append(e)
        else:
            (errors if p["kind"] == "decode_tpot_ms" else prefill_errors).append(e)
    # dense Llama decode points (memory-bound): RMS 5.8 %, every point within 25 %
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) < 0.08
    assert max(abs(e) for e in errors) < math.log(1.25)
    # dense prefill on H100/H200 (compute-bound) runs at GPU_COMPUTE_EFF 0.72 of the fitted factors:
    # real SGLang prefill there is slower than aiconfigurator's estimates (issue 37; sglang#1060), so
    # these 24 sit above aiconfigurator by design (+32 % on average), kept as a record.
    assert len(prefill_errors) == 24 and all(e > 0 for e in prefill_errors)
    # DeepSeek-V3 (MoE + MLA): its factors are fitted to real SGLang measurements now (issue 37;
    # held to them by tests/sim/test_fidelity_alarm.py), no longer to aiconfigurator's low-fidelity
    # MLA estimates, so those 14 points are kept as a record (the predictions above), not a target.
    assert len(moe_errors) == 14


def test_decode_time_grows_with_batch_and_context():
    c = inputs()
    by_batch = [decode_step_s(c, b, b * 2000, eager=False) for b in (1, 8, 64, 256)]
    assert by_batch == sorted(by_batch) and by_batch[-1] > 2 * by_batch[0]
    by_kv = [decode_step_s(c, 64, 64 * ctx, eager=False) for ctx in (512, 4096, 32768)]
    assert by_kv == sorted(by_kv) and by_kv[-1] > 2 * by_kv[0]


def test_eager_decode_is_slower_than_graph_decode():
    small = inputs()
    for bs in (16, 64):
        assert decode_step_s(small, bs, bs * 1000, eager=True) > 1.5 * decode_step_s(small, bs, bs * 1000, eager=False)


def test_tensor_parallel_splits_work_but_pays_all_reduce():
    tp1, tp8 = inputs("llama-3.1-70b", "H100-80GB", 1), inputs("llama-3.1-70b", "H100-80GB", 8)
    shape = StepShape(8192, 1, 8192 * 8193 / 2, 8192, eager=False)
    assert step_time_s(tp8, shape) < step_time_s(tp1, shape) / 4
    assert costmodel._comm_s(tp8, 8192) > 0 and costmodel._comm_s(tp1, 8192) == 0
    pcie = inputs("llama-3.1-70b", "L40S-48GB", 8)
    assert pcie.interconnect_gb_s == get_gpu("L40S-48GB").pcie_gb_s < tp8.interconnect_gb_s


def test_moe_decode_reads_more_experts_as_the_batch_grows():
    c = inputs("deepseek-v3", "H200-141GB", 8)
    t1, t64 = decode_step_s(c, 1, 1000, eager=False), decode_step_s(c, 64, 64 * 1000, eager=False)
    dense_share = costmodel._moe_split(c)[0] / c.weight_bytes_per_gpu
    assert 0 < dense_share < 0.2
    assert t64 > 1.5 * t1


def test_activation_memory_is_monotone_and_larger_for_moe():
    dense = inputs()
    sizes = [activation_bytes(dense, n) for n in (1024, 4096, 8192, 16384)]
    assert sizes == sorted(sizes) and sizes[-1] > 3.9 * sizes[1]
    # Llama-3.1-8B: 2 B × (4×4096 + 48×128 + 3×14336) = 128 KiB per token, 1 GiB for an 8k chunk
    assert activation_bytes(dense, 8192) / 2**30 == pytest.approx(1.0, abs=0.01)
    kimi = inputs("kimi-k2.5-int4", "RTX-PRO-6000-96GB", 8)
    assert activation_bytes(kimi, 8192) > activation_bytes(inputs("llama-3.1-70b", "RTX-PRO-6000-96GB", 8), 8192)


def test_speculative_decoding_costs_more_per_step_and_yields_more_tokens():
    plain = inputs()
    spec = inputs(spec_num_steps=3, spec_num_draft_tokens=4)
    assert spec.speculative and spec.spec_accept_length == pytest.approx(3.1)
    assert decode_step_s(spec, 8, 8000, eager=False) > decode_step_s(plain, 8, 8000, eager=False)
    assert decode_step_s(spec, 8, 8000, eager=False) < spec.spec_accept_length * decode_step_s(plain, 8, 8000, eager=False)


def test_load_back_time_is_kv_bytes_over_pcie():
    c = inputs()
    assert costmodel.load_back_s(c, 10_000) == pytest.approx(10_000 * c.kv_cell_bytes / (64e9))
    assert step_time_s(c, StepShape(0, 0, 0, 0, eager=True)) == 0.0


def _attention_ms(c: CostInputs, seqs: int, context: int) -> float:
    """Attention's part of a decode step (the step minus the same step with no KV to read)."""
    full = step_time_s(c, StepShape(seqs, seqs, float(seqs * context), seqs * context, eager=False))
    empty = step_time_s(c, StepShape(seqs, seqs, 0.0, 0, eager=False))
    return 1e3 * (full - empty)


def test_dp_attention_step_lasts_as_long_as_its_busiest_rank():
    """Each request lives on one DP rank (data_parallel_controller.py): one request is not split over
    the 8 ranks, 8 requests are (one each), 9 put two on one rank."""
    assert costmodel.dp_rank_share(8, 1) == 1.0 and costmodel.dp_rank_share(8, 8) == 1 / 8
    assert costmodel.dp_rank_share(8, 9) == pytest.approx(2 / 9) and costmodel.dp_rank_share(1, 5) == 1.0
    tp = inputs("deepseek-v3", "H200-141GB", tp=8)
    dp = tp.with_parallel(dp_size=8)
    assert _attention_ms(dp, 1, 131072) >= _attention_ms(tp, 1, 131072)  # one long request: no DP help
    assert _attention_ms(dp, 8, 16384) < _attention_ms(dp, 9, 16384)  # the 9th request doubles one rank's reads
    assert _attention_ms(dp, 8, 16384) == pytest.approx(_attention_ms(dp, 1, 16384), rel=0.05)


def test_dcp_pays_a_gather_per_layer_and_splits_long_reads():
    """sglang#14194: each rank reads 1/dcp of a request's KV, then gathers the partial outputs per layer."""
    base = inputs("deepseek-v3", "H200-141GB", tp=8)
    dcp = base.with_parallel(dcp_size=8)
    short = StepShape(1, 1, 256.0, 256, eager=False)
    assert step_time_s(dcp, short) > step_time_s(base, short)  # the gather's latency dominates a short step
    assert _attention_ms(dcp, 1, 131072) < _attention_ms(base, 1, 131072) / 4


def test_dsa_reads_the_latent_of_top_k_keys_and_every_indexer_row_on_each_dcp_rank():
    """DeepSeek-V3.2: sparse attention over index_topk keys, the indexer over all keys; the indexer K
    is replicated under DCP (sglang#31821), so DCP does not divide its part."""
    m = load_model("deepseek-v3.2")
    latent, index = 576 * m.num_layers, 132 * m.num_layers
    dense = CostInputs.from_specs(m, get_gpu("B200-180GB"), tp_size=8, kv_cell_bytes=latent + index,
                                  weight_bytes_per_gpu=weight_bytes_per_gpu(m, 8))
    dsa = dense.with_dsa(index_cell_bytes=index, index_topk=m.index_topk or 0, index_n_heads=m.index_n_heads or 0,
                         index_head_dim=m.index_head_dim or 0)
    assert m.is_dsa and m.index_topk == 2048
    assert _attention_ms(dsa, 1, 131072) < _attention_ms(dense, 1, 131072) / 3  # 2,048 of 131,072 latents read
    assert _attention_ms(dsa, 1, 131072) > _attention_ms(dsa, 1, 2048)  # the indexer still scans every key
    dcp = replace(dsa, kv_cell_bytes=latent + 8 * index).with_parallel(dcp_size=8)
    plain_dcp = dense.with_parallel(dcp_size=8)
    gain_dsa = _attention_ms(dsa, 1, 131072) / _attention_ms(dcp, 1, 131072)
    gain_mla = _attention_ms(dense, 1, 131072) / _attention_ms(plain_dcp, 1, 131072)
    assert gain_dsa < gain_mla  # the replicated indexer keeps DSA's decode from splitting 8 ways
