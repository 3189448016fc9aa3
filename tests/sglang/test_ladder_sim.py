"""The ladder's max_total_num_tokens per lever agrees exactly with the simulator's startup path, over a
grid of deployments (MLA tp 8, GQA tp 2/4, fp8-quantized MLA) and levers (fp8 KV, DP attention, DCP,
speculative decoding off, other fractions); and the simulator refuses what SGLang refuses."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tuner.knobs import LEVERS
from tuner.sglang.ladder import LadderBase, evaluate
from tuner.sglang.memory import GIB, KVCapacityModel
from tuner.sglang.modelconfig import load_model_config
from tuner.sim.errors import SimError
from tuner.sim.memory import MemoryPlan
from tuner.sim.startup import plan_from_argv

MODELS = __import__("pathlib").Path(__file__).resolve().parents[2] / "tuner" / "data" / "models"

DEPLOYMENTS = [
    # (model, tp, gpu, version, mfs, spec)
    ("kimi-k2.5-int4", 8, "RTX-PRO-6000-96GB", "0.5.5", 0.88, True),
    ("kimi-k2.5-int4", 8, "RTX-PRO-6000-96GB", "0.5.23", 0.88, False),
    ("deepseek-v3", 8, "H200-141GB", "0.5.10", 0.85, False),
    ("deepseek-v3", 8, "H200-141GB", "0.5.23", 0.85, False),
    ("llama-3.1-8b", 2, "L40S-48GB", "0.5.5", 0.85, False),
    ("llama-3.1-70b", 4, "H100-80GB", "0.5.23", 0.9, False),
    ("qwen3-32b", 2, "H100-80GB", "0.5.10", 0.88, False),
    # DSA (DeepSeek-V3.2): auto KV is fp8 with the raw trtllm row on B200, bf16 on H200 (0.5.23 overrides.py)
    ("deepseek-v3.2", 8, "B200-180GB", "0.5.23", 0.85, False),
    ("deepseek-v3.2", 8, "H200-141GB", "0.5.23", 0.85, False),
    ("deepseek-v3.2", 8, "B200-180GB", "0.5.23", 0.85, True),  # + its MTP draft: the draft rows x dcp too (0.5.23)
]
GPU_ARCH = {"B200-180GB": "sm100", "H200-141GB": "sm90", "RTX-PRO-6000-96GB": "sm120", "H100-80GB": "sm90", "L40S-48GB": "sm89"}


def _argv(model: str, tp: int, gpu: str, version: str, mfs: float, spec: bool) -> list[str]:
    argv = ["--model-path", model, "--tp-size", str(tp), "--mem-fraction-static", str(mfs), "--sim-gpu", gpu, "--sim-version", version]
    return argv + (["--speculative-algorithm", "EAGLE3"] if spec else [])


def _base(plan: MemoryPlan, model: str, tp: int, version: str, mfs: float) -> LadderBase:
    """The ladder's view of a start, from the simulator's exact ledger (no 2-decimal log rounding)."""
    cfg = plan.config
    spec = cfg.speculative if cfg.draft is not None else None
    headroom = 0
    if spec is not None and version == "0.5.5":
        headroom = plan.max_num_reqs * spec.num_steps * spec.eagle_topk + plan.max_num_reqs * spec.num_draft_tokens + 100
    mem = KVCapacityModel(baseline_gib=plan.baseline_bytes / GIB, static_gib=(plan.baseline_bytes - plan.post_load_bytes) / GIB,
                          cell_bytes=int(plan.cell_bytes), observed_mem_fraction_static=mfs, observed_tokens=plan.max_total_num_tokens)
    return LadderBase(levers=LEVERS, memory=mem, model=load_model_config(MODELS / model), version=version, tp=tp, mem_fraction_static=mfs,
                      speculative_algorithm=spec.algorithm if spec else None, context_len=cfg.context_len, spec_headroom_tokens=headroom,
                      page_size=cfg.page_size, gpu=GPU_ARCH[cfg.gpu.name],
                      draft_weight_gib=cfg.draft.weight_bytes / GIB if cfg.draft is not None else None)


def _levers(model: str, tp: int, version: str, spec: bool) -> list[tuple[dict[str, Any], list[str]]]:
    out: list[tuple[dict[str, Any], list[str]]] = [
        ({"kv_cache_dtype": "fp8_e4m3"}, ["--kv-cache-dtype", "fp8_e4m3"]),
        ({"mem_fraction_static": 0.8}, ["--mem-fraction-static", "0.8"]),
        ({"mem_fraction_static": 0.93}, ["--mem-fraction-static", "0.93"]),
    ]
    for dp in sorted({tp, tp // 2} - {0, 1}):
        out.append(({"enable_dp_attention": True, "dp_size": dp}, ["--enable-dp-attention", "--dp-size", str(dp)]))
        out.append(({"enable_dp_attention": True, "dp_size": dp, "mem_fraction_static": 0.95},
                    ["--enable-dp-attention", "--dp-size", str(dp), "--mem-fraction-static", "0.95"]))
    if version == "0.5.23" and model in ("kimi-k2.5-int4", "deepseek-v3", "deepseek-v3.2"):
        out.append(({"dcp_size": tp}, ["--dcp-size", str(tp)]))
        out.append(({"dcp_size": tp // 2, "kv_cache_dtype": "fp8_e4m3"}, ["--dcp-size", str(tp // 2), "--kv-cache-dtype", "fp8_e4m3"]))
    if model == "deepseek-v3.2":  # the other DSA rows: bf16, and fp8 with a scaled-row backend named
        out.append(({"kv_cache_dtype": "bfloat16"}, ["--kv-cache-dtype", "bfloat16"]))
        out.append(({"kv_cache_dtype": "fp8_e4m3", "dsa_prefill_backend": "flashmla_kv", "dsa_decode_backend": "flashmla_kv"},
                    ["--kv-cache-dtype", "fp8_e4m3", "--dsa-prefill-backend", "flashmla_kv", "--dsa-decode-backend", "flashmla_kv"]))
        out.append(({"dcp_size": tp, "dsa_prefill_backend": "flashmla_kv", "dsa_decode_backend": "flashmla_kv", "kv_cache_dtype": "fp8_e4m3"},
                    ["--dcp-size", str(tp), "--dsa-prefill-backend", "flashmla_kv", "--dsa-decode-backend", "flashmla_kv",
                     "--kv-cache-dtype", "fp8_e4m3"]))
    return out


CASES = [(d, lever, extra) for d in DEPLOYMENTS for lever, extra in _levers(d[0], d[1], d[3], d[5])]
CASES += [(d, {"speculative_algorithm": None}, None) for d in DEPLOYMENTS if d[5]]


@pytest.mark.parametrize(("deployment", "lever", "extra"), CASES,
                         ids=[f"{d[0]}-tp{d[1]}-{d[3]}-{'+'.join(f'{k}={v}' for k, v in lever.items())}" for d, lever, _ in CASES])
def test_ladder_tokens_equal_the_simulators_startup(deployment, lever, extra):
    model, tp, gpu, version, mfs, spec = deployment
    argv = _argv(*deployment)
    _, plan = plan_from_argv(argv)
    assert plan.failure is None
    base = _base(plan, model, tp, version, mfs)
    assert evaluate(base, {}).tokens_per_rank == plan.max_total_num_tokens
    if extra is None:  # speculative decoding off: the command without it
        _, other = plan_from_argv(_argv(model, tp, gpu, version, mfs, False))
    else:
        _, other = plan_from_argv(argv + extra)
    rung = evaluate(base, lever)
    if other.max_total_num_tokens <= 0 or (other.failure is not None and other.failure.kind == "not_enough_memory"):
        assert rung.starts is False and rung.tokens_per_rank is not None and rung.tokens_per_rank <= 0
        return
    assert rung.tokens_per_rank == other.max_total_num_tokens, rung.why
    assert rung.logical_tokens == other.logical_tokens


def test_the_grid_has_each_lever_and_a_refusal():
    kinds = {next(iter(lever)) for _, lever, _ in CASES}
    assert {"kv_cache_dtype", "enable_dp_attention", "dcp_size", "speculative_algorithm", "mem_fraction_static"} <= kinds
    _, plan = plan_from_argv(_argv("kimi-k2.5-int4", 8, "RTX-PRO-6000-96GB", "0.5.5", 0.88, True) + ["--enable-dp-attention", "--dp-size", "8"])
    assert plan.failure is not None and plan.failure.kind == "not_enough_memory"  # +10.46 GiB replicated (issue 23)


def test_simulator_refuses_what_sglang_refuses():
    with pytest.raises(SimError, match="must divide --tp-size 8"):
        plan_from_argv(_argv("kimi-k2.5-int4", 8, "RTX-PRO-6000-96GB", "0.5.23", 0.88, False) + ["--dcp-size", "3"])
    with pytest.raises(SimError, match=r"self.tp_size % self.dp_size == 0"):
        plan_from_argv(_argv("kimi-k2.5-int4", 8, "RTX-PRO-6000-96GB", "0.5.5", 0.88, False) + ["--enable-dp-attention", "--dp-size", "3"])
    with pytest.raises(SimError, match="MLA models only"):
        plan_from_argv(_argv("llama-3.1-8b", 2, "L40S-48GB", "0.5.23", 0.85, False) + ["--dcp-size", "2"])
    with pytest.raises(SystemExit):  # 0.5.5's parser has no --dcp-size (flag table), as SGLang's argparse
        plan_from_argv(_argv("kimi-k2.5-int4", 8, "RTX-PRO-6000-96GB", "0.5.5", 0.88, False) + ["--dcp-size", "8"])


@pytest.mark.parametrize(("model", "tp", "gpu", "dtype", "message"), [
    ("llama-3.1-8b", 2, "H100-80GB", "mxfp8", "mxfp8 requires an SM100\\+ \\(Blackwell\\) GPU"),
    ("deepseek-v3.2", 8, "B200-180GB", "fp8_e5m2", "DeepSeek DSA only supports bf16/bfloat16 or fp8_e4m3"),
])
def test_dtype_refusals_agree_with_the_feasibility_table(model, tp, gpu, dtype, message):
    """A KV dtype SGLang refuses on this GPU / attention type: the simulator exits with SGLang's message
    and the ladder's feasibility cell says no, citing the same source."""
    from tuner.sglang.levers import attention_type, feasibility

    with pytest.raises(SimError, match=message):
        plan_from_argv(_argv(model, tp, gpu, "0.5.23", 0.85, False) + ["--kv-cache-dtype", dtype])
    cell = feasibility("fp8_kv", gpu=GPU_ARCH[gpu], version="0.5.23", backend=None,
                       attention=attention_type(load_model_config(MODELS / model)), value=dtype)
    assert cell.ok is False and message.replace("\\", "")[:30] in cell.why.replace("'", "")


def test_simulated_server_with_dp_attention_that_does_not_fit_prints_not_enough_memory():
    """A real simulator process: DP attention dp 8 on the reference twin at 0.88 exits with SGLang's line."""
    argv = [sys.executable, "-m", "tuner.sim", *_argv("kimi-k2.5-int4", 8, "RTX-PRO-6000-96GB", "0.5.5", 0.88, True),
            "--enable-dp-attention", "--dp-size", "8", "--sim-time-scale", "0", "--port", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Not enough memory" in out, out[-2000:]


def test_a_trial_counts_capacity_across_the_deployment():
    """The product's facts of a simulated start (its startup log): DCP's per-rank pool × dcp, DP
    attention's pools × dp (one request still fits one DP rank's pool)."""
    from tests.support.study_factory import simulated_start
    from tuner.sglang.flags import FlagTable

    base = _argv("kimi-k2.5-int4", 8, "RTX-PRO-6000-96GB", "0.5.23", 0.88, False) + ["--max-running-requests", "64"]
    _, plain, _ = simulated_start(base, 32768, FlagTable.for_version("0.5.23"))
    _, dcp, _ = simulated_start(base + ["--dcp-size", "8"], 32768, FlagTable.for_version("0.5.23"))
    assert dcp["max_total_num_tokens"] == plain["max_total_num_tokens"]  # the log's count is one rank's
    assert dcp["context_capacity"] == min(64, 8 * dcp["max_total_num_tokens"] // 32768) > plain["context_capacity"]
    dp_argv = base + ["--enable-dp-attention", "--dp-size", "8", "--mem-fraction-static", "0.95"]
    _, dp, _ = simulated_start(dp_argv, 32768, FlagTable.for_version("0.5.23"))
    per_rank = min(dp["effective_max_running_requests"], dp["max_total_num_tokens"] // 32768)
    assert dp["context_capacity"] == 8 * per_rank


def _explained_live_and_logged(args: list[str], model: str, gpu: str, tmp_path: Any) -> tuple[Any, Any]:
    """`tuner explain` of a real simulator process started with ``args``: from its URL, then its log."""
    from tests.support.sim import start_healthy
    from tuner.sglang.explain import explain_from

    sim = start_healthy(args, tmp_path)
    try:
        live = explain_from(structural=LEVERS, url=sim.url, model_config=str(MODELS / model), gpu=gpu)
        logged = explain_from(structural=LEVERS, log=str(sim.log_path), model_config=str(MODELS / model), gpu=gpu)
    finally:
        sim.stop()
    return live, logged


def test_explain_of_a_running_simulated_server_prices_the_ladder_as_its_startup_does(tmp_path):
    """`tuner explain --url` on a real simulator process (0.5.23, where /get_server_info reports the
    free memory at startup) and its log: both inputs price fp8 KV as the simulator's startup would."""
    args = _argv("kimi-k2.5-int4", 8, "RTX-PRO-6000-96GB", "0.5.23", 0.88, False)
    _, fp8 = plan_from_argv(args + ["--kv-cache-dtype", "fp8_e4m3"])
    for explained in _explained_live_and_logged(args, "kimi-k2.5-int4", "sm120", tmp_path):
        rung = next(r for r in explained.ladder if r.lever.get("kv_cache_dtype") == "fp8_e4m3" and "mem_fraction_static" not in r.lever)
        assert rung.tokens_per_rank == pytest.approx(fp8.max_total_num_tokens, rel=1e-4)  # calibrated on 2-decimal GB lines
        assert rung.available is True  # 0.5.23 has the Triton MLA fp8 path on SM120 (sglang#20479)
        dcp = next(r for r in explained.ladder if r.lever == {"dcp_size": 8})
        assert dcp.available is None and dcp.logical_tokens == 8 * dcp.tokens_per_rank  # the DCP backend on SM120: unknown


def test_explain_of_a_running_simulated_dsa_server_prices_dcp_and_dp_attention_as_its_startup_does(tmp_path):
    """DeepSeek-V3.2 on 8x B200 (0.5.23; fp8 KV by default on SM100, trtllm's raw row): `tuner explain`
    on the running simulator and on its log prices DCP 8 (indexer replicated x8) and DP attention
    exactly as the simulator's own startup with those flags, and finds DCP available (sglang#31821)."""
    args = _argv("deepseek-v3.2", 8, "B200-180GB", "0.5.23", 0.85, False)
    _, dcp = plan_from_argv(args + ["--dcp-size", "8"])
    _, dp = plan_from_argv(args + ["--enable-dp-attention", "--dp-size", "8"])
    for explained in _explained_live_and_logged(args, "deepseek-v3.2", "B200", tmp_path):
        assert not any(r.lever.get("kv_cache_dtype") for r in explained.ladder)  # already fp8: no fp8 rung
        rung = next(r for r in explained.ladder if r.lever == {"dcp_size": 8})
        assert (rung.tokens_per_rank, rung.logical_tokens, rung.available) == (dcp.max_total_num_tokens, dcp.logical_tokens, True)
        rung = next(r for r in explained.ladder if r.lever == {"enable_dp_attention": True, "dp_size": 8})
        assert (rung.tokens_per_rank, rung.logical_tokens) == (dp.max_total_num_tokens, dp.logical_tokens)
