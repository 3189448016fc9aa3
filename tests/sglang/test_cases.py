"""Every real case in tests/fixtures/cases (copied from shared/cases): numbers extracted, failure class, token counts.

For each case, every number under ``observed`` that SGLang printed in the log excerpt is read back
by the parser (the getter table below names where); numbers the excerpt does not contain, or that
only a person or another program (vLLM, a benchmark) wrote, are listed in ``NOT_IN_SGLANG_LINES``
with the reason, and a test checks that list against the excerpt text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tuner.sglang.logs import LogReport, outcome_of, parse_log
from tuner.sglang.memory import GIB, cell_size_bytes, max_req_input_len, tokens_from_pool_drop
from tuner.sglang.modelconfig import model_arch_from_dict

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "cases"
CASE_IDS = sorted(p.stem for p in CASES.glob("case-*.json"))


def _case(case_id: str) -> dict[str, Any]:
    return json.loads((CASES / f"{case_id}.json").read_text())


def _rank(r: LogReport, key: str = "TP0") -> Any:
    return r.ranks[key]


Getter = Callable[[LogReport], Any]
EXTRACTED: dict[str, dict[str, Getter]] = {
    "case-01": {"kv_cache_tokens": lambda r: _rank(r, "").kv_tokens, "k_size_gb": lambda r: _rank(r, "").k_size_gib,
                "v_size_gb": lambda r: _rank(r, "").v_size_gib},
    "case-02": {"avail_after_weights_gb": lambda r: _rank(r).weight_end_avail_gib,
                "avail_after_memory_pool_gb": lambda r: _rank(r).memory_pool_end_avail_gib,
                "kv_pool_consumed_gb": lambda r: _rank(r).kv_pool_consumed_gib,
                "max_total_num_tokens": lambda r: r.scheduler.max_total_num_tokens,
                "chunked_prefill_size": lambda r: r.scheduler.chunked_prefill_size,
                "max_prefill_tokens": lambda r: r.scheduler.max_prefill_tokens,
                "max_running_requests": lambda r: r.scheduler.max_running_requests,
                "context_len": lambda r: r.scheduler.context_len,
                "cuda_graph_capture_seconds": lambda r: round(_rank(r).graph_capture_s, 1)},
    "case-03": {"weights_mem_usage_gb": lambda r: _rank(r, "DP0 TP0").weight_gib,
                "avail_after_weights_gb": lambda r: _rank(r, "DP0 TP0").weight_end_avail_gib,
                "requested_max_total_tokens": lambda r: r.max_total_tokens_requested,
                "profiled_max_total_tokens": lambda r: r.max_total_tokens_profiled},
    "case-05": {"failed_allocation_mib": lambda r: r.oom.tried_to_allocate_mib, "gpu_total_gib": lambda r: r.oom.total_capacity_gib},
    "case-08": {},
    "case-11": {},
    "case-12": {"prefill_batch_new_seqs": lambda r: r.batches[0].new_seq, "prefill_batch_new_tokens": lambda r: r.batches[0].new_token,
                "cached_tokens": lambda r: r.batches[0].cached_token},
    "case-16": {"hicache_size_gb_per_rank": lambda r: r.host_pool_gb},
    "case-19": {"cuda_graph_mem_usage_gb": lambda r: _rank(r).graph_gib, "avail_after_cuda_graph_gb": lambda r: _rank(r).graph_end_avail_gib,
                "cuda_graph_capture_seconds": lambda r: _rank(r).graph_capture_s},
    "case-21": {"avail_before_cuda_graph_gb": lambda r: _rank(r, "").graph_begin_avail_gib,
                "cuda_graph_mem_usage_gb": lambda r: _rank(r, "").graph_gib,
                "avail_after_cuda_graph_gb": lambda r: _rank(r, "").graph_end_avail_gib,
                "max_total_num_tokens": lambda r: r.scheduler.max_total_num_tokens,
                "chunked_prefill_size": lambda r: r.scheduler.chunked_prefill_size,
                "max_prefill_tokens": lambda r: r.scheduler.max_prefill_tokens,
                "max_running_requests": lambda r: r.scheduler.max_running_requests,
                "context_len": lambda r: r.scheduler.context_len,
                "cuda_graph_max_bs": lambda r: _rank(r, "").cuda_graph_max_bs},
    "case-24": {"requested_max_total_tokens": lambda r: int(r.server_args["max_total_tokens"])},
    "case-26": {"max_allowed_input_tokens": lambda r: r.input_rejections[0].max_allowed_tokens,
                "request_tokens": lambda r: r.input_rejections[0].input_tokens},
    "case-27": {"running_requests": lambda r: r.batches[-1].running_req, "full_kv_tokens_in_use": lambda r: r.batches[-1].num_token,
                "full_token_usage": lambda r: r.batches[-1].full_token_usage, "swa_token_usage": lambda r: r.batches[-1].swa_token_usage},
    "case-29": {"running_requests": lambda r: r.batches[0].running_req, "kv_tokens_in_use": lambda r: r.batches[0].num_token,
                "token_usage": lambda r: r.batches[0].token_usage, "req_to_token_pool_available": lambda r: r.req_slots_available,
                "num_reqs_requested": lambda r: r.req_slots_requested},
}

NOT_IN_SGLANG_LINES: dict[str, dict[str, str]] = {
    "case-01": {"mem_fraction_static": "server_args only", "comparison_vllm_kv_tokens": "vLLM's own log line",
                "comparison_vllm_kv_gib": "vLLM's own log line"},
    "case-02": {},
    "case-03": {"mem_fraction_static": "server_args only"},
    "case-05": {},
    "case-08": {},
    "case-11": {"peak_batch_without_cuda_graph": "maintainer's prose", "throughput_disable_cuda_graph_req_s": "maintainer's prose",
                "throughput_max_running_requests_2560_req_s": "maintainer's prose", "max_running_requests_fix": "maintainer's prose"},
    "case-12": {"concurrent_requests": "report prose", "prompt_tokens_each": "report prose", "max_tokens": "report prose"},
    "case-16": {"ranks": "server_args (--tp 4)", "total_host_pinned_gb": "derived 4 x 40", "host_ram_gb": "report prose"},
    "case-19": {"comparison_vllm_v0_9_2_cuda_graph_gib": "vLLM figure"},
    "case-21": {"running_batch_median_default": "benchmark figure", "running_batch_median_cg128": "benchmark figure",
                "followup_rtx4090": "follow-up comment figures"},
    "case-24": {"idle_vram_gb_approx": "report prose", "rtx5090_comment": "a markdown table in a comment, not SGLang output"},
    "case-26": {"context_length": "server_args only", "mem_fraction_static": "server_args only", "chunked_prefill_size": "server_args only"},
    "case-27": {},
    "case-29": {},
}

# Cases whose excerpt lacks the failure line: the report's own description of the error (observed.error)
# or the exit the report describes is fed too, and the class must follow from it.
EXTRA_EVIDENCE: dict[str, tuple[bool, int | None]] = {
    "case-02": (False, 1),   # "server crashed later ... crash text not in the excerpt": an exit, nothing more
    "case-12": (True, None),  # "CUDA OOM right after a 17-sequence ... prefill batch"
    "case-16": (False, 1),   # "init fails (no Python traceback in the excerpt)": exit right after the host-pool allocation
}


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case_numbers_are_extracted(case_id: str) -> None:
    case = _case(case_id)
    report = parse_log(case["log_excerpt"])
    getters = EXTRACTED[case_id]
    skipped = NOT_IN_SGLANG_LINES[case_id]
    numeric = {k: v for k, v in case["observed"].items() if (isinstance(v, (int, float)) and not isinstance(v, bool)) or isinstance(v, dict)}
    assert set(numeric) <= set(getters) | set(skipped), f"unaccounted observed numbers: {set(numeric) - set(getters) - set(skipped)}"
    for key, getter in getters.items():
        assert getter(report) == pytest.approx(case["observed"][key]), key


def _spellings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _spellings(v)]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return []
    out = {str(value), f"{value:,}", f"{value:.2f}"}
    return [t for t in out if len(t) >= 2]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case_skipped_numbers_are_really_not_sglang_output(case_id: str) -> None:
    """A skipped number is absent from the excerpt, or only on lines the parser does not take as SGLang output."""
    case = _case(case_id)
    lines = case["log_excerpt"].splitlines()
    for key in NOT_IN_SGLANG_LINES[case_id]:
        assert key in case["observed"], key
        for text in _spellings(case["observed"][key]):
            for line in (ln for ln in lines if text in ln):
                report = parse_log([line])
                assert report.sglang_lines == 0 or text not in report.model_dump_json(), (key, line)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case_failure_class_matches_outcome(case_id: str) -> None:
    case = _case(case_id)
    lines = case["log_excerpt"].splitlines()
    use_error, exit_status = EXTRA_EVIDENCE.get(case_id, (False, None))
    if case_id in EXTRA_EVIDENCE:
        assert outcome_of(parse_log(lines).failure) == "started"  # the excerpt alone shows no failure
    if use_error:
        lines.append(case["observed"]["error"])
    report = parse_log(lines, exit_status=exit_status)
    expected = case["outcome"]
    if case_id == "case-27":
        # A throughput collapse after retraction, not a process failure: no failure class, but a
        # warning that the pool is nearly full.
        assert report.failure is None and any("nearly full" in w for w in report.warnings)
        return
    assert outcome_of(report.failure) == expected, report.failure
    if report.failure is not None:
        assert report.failure.evidence


EXPECTED_CLASS = {"case-03": "startup_kv_oom", "case-05": "cuda_graph_oom", "case-08": "startup_kv_oom", "case-11": "runtime_oom",
                  "case-26": "crash", "case-29": "request_slot_exhaustion"}


@pytest.mark.parametrize("case_id", sorted(EXPECTED_CLASS))
def test_case_failure_class(case_id: str) -> None:
    failure = parse_log(_case(case_id)["log_excerpt"]).failure
    assert failure is not None and failure.failure_class.value == EXPECTED_CLASS[case_id]


def test_case_16_host_memory_and_case_02_crash_from_exit() -> None:
    f16 = parse_log(_case("case-16")["log_excerpt"], exit_status=1).failure
    assert f16 is not None and f16.failure_class.value == "host_memory" and "host pool" in f16.evidence
    f02 = parse_log(_case("case-02")["log_excerpt"], exit_status=1).failure
    assert f02 is not None and f02.failure_class.value == "crash" and f02.exit_status == 1


def _arch(case_id: str) -> Any:
    m = _case(case_id)["model"]
    cfg = {"num_hidden_layers": m["num_hidden_layers"], "model_type": m["name"]}
    if "kv_lora_rank" in m:
        cfg |= {"kv_lora_rank": m["kv_lora_rank"], "qk_rope_head_dim": m["qk_rope_head_dim"]}
    else:
        cfg |= {"num_attention_heads": 64, "num_key_value_heads": m["num_key_value_heads"], "head_dim": m["head_dim"]}
    return model_arch_from_dict(cfg)


# Model facts and a logged token count together: case-01 (K size), case-02 (memory lines), case-26
# (allowed input length). case-03 logs weights and free memory but not the baseline, and its negative
# profiled count (-561,981) cannot be rebuilt from the excerpt's numbers (ROCm 0.4.8, DP attention);
# case-12, 16, 19 log no token count.


def test_case_01_tokens_from_model_facts() -> None:
    """Qwen3-235B, tp 4, 4 KV heads → 1 per rank: the logged K size gives the logged token count within 1%."""
    case = _case("case-01")
    cell = cell_size_bytes(_arch("case-01"), tp=case["tp"])
    assert cell == 94 * 1 * 128 * 2 * 2
    report = parse_log(case["log_excerpt"])
    kv = report.ranks[""].kv_pool_gib
    predicted = kv * GIB / cell - 1
    assert predicted == pytest.approx(case["observed"]["kv_cache_tokens"], rel=0.01)


def test_case_02_tokens_from_memory_lines() -> None:
    """DeepSeek-R1 MLA at tp16: the drop from 'Load weight end' to 'Memory pool end' minus the
    req_to_token table gives the logged token count within 1%."""
    case = _case("case-02")
    cell = cell_size_bytes(_arch("case-02"), tp=16)
    assert cell == 70272
    r = parse_log(case["log_excerpt"])
    predicted = tokens_from_pool_drop(r.ranks["TP0"].kv_pool_consumed_gib, cell, max_running_requests=r.scheduler.max_running_requests,
                                      context_len=r.scheduler.context_len)
    assert predicted == pytest.approx(r.scheduler.max_total_num_tokens, rel=0.01)


def test_case_26_allowed_input_follows_the_pool() -> None:
    """max_req_input_len = min(context_len − 1, tokens − 1) − 5: 59,862 allowed ⇔ a pool of 59,868 tokens."""
    assert max_req_input_len(59868, 163840) == _case("case-26")["observed"]["max_allowed_input_tokens"]
