"""Every real case in tests/fixtures/cases (copied from shared/cases) through ``tuner explain --log F --json``.

For each case: every number under ``observed`` that SGLang printed in the log excerpt is a number of
the JSON output (a numeric leaf, compared at the precision the case states it); numbers the excerpt
does not contain, or that only a person, a debug print or another program (vLLM, a benchmark)
wrote, are listed in ``NOT_IN_SGLANG_LINES`` with the reason, and a test checks that list against
the excerpt text. The diagnosis's class fits the case's ``outcome``, its evidence line is quoted
from the log, and the ``lever`` (knob, direction, why) is the one the case's resolution supports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tuner.sglang.explain import Explanation, explain
from tuner.sglang.logs import clean_line, outcome_of, parse_log
from tuner.sglang.memory import GIB, cell_size_bytes, max_req_input_len, tokens_from_pool_drop
from tuner.sglang.modelconfig import model_arch_from_dict

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "cases"
CASE_IDS = sorted(p.stem for p in CASES.glob("case-*.json"))
TUNER = str(Path(sys.executable).with_name("tuner"))


def _case(case_id: str) -> dict[str, Any]:
    return json.loads((CASES / f"{case_id}.json").read_text())


NOT_IN_SGLANG_LINES: dict[str, dict[str, str]] = {
    "case-01": {"mem_fraction_static": "server_args only", "comparison_vllm_kv_tokens": "vLLM's own log line",
                "comparison_vllm_kv_gib": "vLLM's own log line"},
    "case-02": {"kv_pool_consumed_gb": "hand arithmetic (36.51 − 22.03); the explanation shows it as the derived pool_drop step"},
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
    "case-30": {},
    "case-31": {"mem_fraction_static": "a PR's debug print (self.server_args.mem_fraction_static 0.911), not an SGLang line",
                "kv_budget_gb_debug_print": "a PR's debug print", "aiter_workspace_buffer_gb": "a PR's debug print (###### self.workspace_buffer)"},
    "case-32": {"max_total_num_tokens_per_pr_text": "PR text, not in the excerpt"},
    "case-33": {"mem_fraction_static": "SGLang-Omni's doc", "weights_gb_approx_per_doc": "doc prose", "gpu_total_gb": "doc prose",
                "reserved_gb_per_doc": "doc prose", "rest_memory_gb_per_doc": "doc prose", "working_mem_fraction_per_doc": "doc prose"},
    "case-34": {},
    "case-37": {"page_size": "server_args only (--page-size 64)", "mem_fraction_static": "server_args only"},
    "case-38": {},
    "case-41": {},
    "case-45": {},
    "case-47": {},
    "case-49": {},
    "case-52": {},
    "case-54": {},
    "case-22": {"mem_fraction_oom_threshold": "the PR's prose (OOM at >=0.66)"},
    "case-39": {"failed_allocation_gib": "hand conversion of the logged bytes", "free_gib": "hand conversion of the logged bytes",
                "gpu_total_gib": "hand conversion of the logged bytes"},
    "case-66": {},
}

# Cases whose excerpt lacks the failure line: what the report says happened is fed too (an exit
# status, or the line torch raises for the OOM the report describes), and the class must follow.
EXTRA_EVIDENCE: dict[str, tuple[str | None, int | None]] = {
    "case-02": (None, 1),   # "server crashed later ... crash text not in the excerpt": an exit, nothing more
    "case-11": ("observed", None),  # prose: "the traceback posted as a screenshot"; the report's words for the error
    "case-12": ("observed", None),  # "CUDA OOM right after a 17-sequence ... prefill batch"
    "case-16": (None, 1),   # "init fails (no Python traceback in the excerpt)": exit right after the host-pool allocation
    # "OOM in the AITER attention backend's buffer allocation, right after the KV pool (the error line
    # itself is cut off)": on ROCm torch raises this (as case-32 shows for the same backend).
    "case-30": ("torch.OutOfMemoryError: HIP out of memory.", 1),
}

# Cases whose excerpt lacks the evidence that decides between levers (the resolution quotes a
# figure only the report's prose has): their lever must be among the levers shown, not first.
LEVER_NOT_IN_LOG: dict[str, str] = {
    "case-11": "the running batch of ~3,500 is only in the maintainer's prose; the excerpt has no batch line",
}


def _expected_lever(case_id: str) -> tuple[str | None, str]:
    """The (knob, direction) the case's ``lever`` field states (every handed case has one)."""
    lever = _case(case_id)["lever"]
    return lever["knob"], lever["direction"]


@pytest.fixture(scope="module")
def explained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """``tuner explain --log F --json`` of every case's excerpt (the installed CLI, a real subprocess)."""
    tmp = tmp_path_factory.mktemp("cases")
    out: dict[str, dict[str, Any]] = {}
    for case_id in CASE_IDS:
        path = tmp / f"{case_id}.log"
        case = _case(case_id)
        extra = EXTRA_EVIDENCE.get(case_id, (None, None))[0]
        path.write_text(case["log_excerpt"] + "\n" + ((case["observed"]["error"] if extra == "observed" else extra) + "\n" if extra else ""))
        proc = subprocess.run([TUNER, "explain", "--log", str(path), "--json"], capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, (case_id, proc.stderr)
        Explanation.model_validate_json(proc.stdout)
        out[case_id] = json.loads(proc.stdout)
    yield out


def _numbers(doc: Any) -> Iterator[float]:
    if isinstance(doc, bool):
        return
    if isinstance(doc, (int, float)):
        yield doc
    elif isinstance(doc, dict):
        for v in doc.values():
            yield from _numbers(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _numbers(v)


def _observed_numbers(observed: dict[str, Any]) -> Iterator[tuple[str, float]]:
    for key, value in observed.items():
        if isinstance(value, dict):
            yield from ((f"{key}.{k}", v) for k, v in _observed_numbers(value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, value


def _decimals(value: float) -> int:
    text = repr(value)
    return len(text.split(".")[1]) if "." in text and "e" not in text else 0


def _appears(value: float, numbers: list[float]) -> bool:
    """``value`` is a number of the output, at the precision the case states it (391.0 ↔ 391.01)."""
    d = _decimals(value)
    return any(n == value or (isinstance(n, float) and round(n, d) == value) for n in numbers)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case_every_logged_number_is_in_the_json(case_id: str, explained: dict[str, dict[str, Any]]) -> None:
    case = _case(case_id)
    numbers = list(_numbers(explained[case_id]))
    skipped = NOT_IN_SGLANG_LINES[case_id]
    missing = [k for k, v in _observed_numbers(case["observed"]) if k.split(".")[0] not in skipped and not _appears(v, numbers)]
    assert not missing, f"observed numbers not in the explain JSON: {missing}"


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


def test_case_11_excerpt_alone_is_prose() -> None:
    """case-11's excerpt is a person's summary (the traceback was a screenshot): a sentence that names
    "CUDA out of memory" is not a log line, so the excerpt alone holds no SGLang line."""
    report = parse_log(_case("case-11")["log_excerpt"])
    assert report.sglang_lines == 0 and report.failure is None


def _evidence_report(case_id: str) -> Any:
    case = _case(case_id)
    lines = case["log_excerpt"].splitlines()
    extra, exit_status = EXTRA_EVIDENCE.get(case_id, (None, None))
    if case_id in EXTRA_EVIDENCE:
        assert outcome_of(parse_log(lines).failure) == "started"  # the excerpt alone shows no failure
    if extra == "observed":
        lines.append(case["observed"]["error"])
    elif extra is not None:
        lines.append(extra)
    return parse_log(lines, exit_status=exit_status)


OUTCOME_ALIASES = {"startup_failure_not_memory": "other_error"}
"""Newer cases name the outcome more finely than ``outcome_of``'s vocabulary (case-66: a start that
failed for a reason other than memory is an ``other_error``)."""


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case_failure_class_matches_outcome(case_id: str) -> None:
    case = _case(case_id)
    report = _evidence_report(case_id)
    e = explain(report)
    expected = case["outcome"]
    if case_id == "case-27":
        # A throughput collapse after retraction, but the excerpt holds no retraction line: no
        # class, and a warning that the pool is nearly full.
        assert e.diagnosis is None and any(t.id == "kv_pool_nearly_full" for t in e.traps)
        return
    got = outcome_of(e.diagnosis)
    expected = OUTCOME_ALIASES.get(expected, expected)
    allowed = case.get("expected_class", "-")
    if isinstance(allowed, list) and None in allowed and e.diagnosis is None:
        return  # the excerpt is cut before the outcome, and the case says no class is a right answer
    assert got == expected, e.diagnosis
    if e.diagnosis is not None:
        # The evidence is quoted: a line of the log (prefixes stripped), or the exit the report describes.
        extra = EXTRA_EVIDENCE.get(case_id, (None, None))[0]
        lines = case["log_excerpt"].splitlines() + [case["observed"]["error"] if extra == "observed" else extra or ""]
        quoted = {clean_line(ln)[0][:500] for ln in lines}
        assert e.diagnosis.evidence in quoted or (e.diagnosis.exit_status is not None and "exited with status" in e.diagnosis.evidence)


def _levers_of(case_id: str, explained: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranked levers ``tuner explain --json`` shows (the first is ``lever``)."""
    if case_id in EXTRA_EVIDENCE:
        return [lv.model_dump() for lv in explain(_evidence_report(case_id)).levers]
    return list(explained[case_id]["levers"])


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case_lever(case_id: str, explained: dict[str, dict[str, Any]]) -> None:
    """The first lever is the knob and direction the case's ``lever`` field states (no lever, or a
    lever without a knob, where it says ``none``); its alternatives are among the levers shown."""
    levers = _levers_of(case_id, explained)
    shown = [(lv["knob"], lv["direction"]) for lv in levers]
    first = shown[0] if shown else (None, "none")
    expected = _expected_lever(case_id)
    if case_id in LEVER_NOT_IN_LOG:
        assert expected in shown, (shown, LEVER_NOT_IN_LOG[case_id])
    elif expected == (None, "none"):
        assert first[0] is None, levers[0]["why"]
    else:
        assert first == expected, levers[0]["why"] if levers else None
    for alt in _case(case_id)["lever"].get("alternatives", []):
        assert (alt["knob"], alt["direction"]) in shown, (alt, shown)
    assert all(len(lv["why"]) > 20 for lv in levers)
    if case_id not in EXTRA_EVIDENCE:
        doc = explained[case_id]["lever"]
        assert (doc is None and not levers) or doc == levers[0]


def test_every_case_states_its_lever() -> None:
    for case_id in CASE_IDS:
        lever = _case(case_id)["lever"]
        assert lever["direction"] in ("raise", "lower", "set", "none") and (lever["knob"] is None) == (lever["direction"] == "none"), case_id


@pytest.mark.parametrize("case_id", [c for c in CASE_IDS if "expected_class" in _case(c)])
def test_case_expected_class(case_id: str) -> None:
    """Where the outcome alone does not fix the class, the case's ``expected_class`` does (a list: any of)."""
    case = _case(case_id)
    want = case["expected_class"]
    allowed = want if isinstance(want, list) else [want]
    report = _evidence_report(case_id)
    got = report.failure.failure_class.value if report.failure is not None else None
    assert got in allowed, (got, case["expected_class_why"])
    if "expected_diagnosis" in case:
        assert report.diagnosis is not None and report.diagnosis.failure_class.value == case["expected_diagnosis"]


EXPECTED_CLASS = {"case-03": "startup_kv_oom", "case-05": "cuda_graph_oom", "case-08": "startup_kv_oom", "case-11": "runtime_oom",
                  "case-26": "crash", "case-29": "request_slot_exhaustion", "case-32": "startup_oom", "case-33": "startup_kv_oom",
                  "case-37": "kv_page_shortfall", "case-38": "retraction_storm"}


@pytest.mark.parametrize("case_id", sorted(EXPECTED_CLASS))
def test_case_failure_class(case_id: str) -> None:
    report = _evidence_report(case_id)
    assert report.diagnosis is not None and report.diagnosis.failure_class.value == EXPECTED_CLASS[case_id]


def test_retraction_is_never_a_launch_failure() -> None:
    """case-38: the old retraction wording is a soft class; a launcher watching the log sees no failure."""
    report = parse_log(_case("case-38")["log_excerpt"])
    assert report.failure is None and report.soft_failure is not None
    assert report.soft_failure.evidence.startswith("Decode out of memory happened.") and len(report.retractions) == 5


def test_case_37_page_shortfall_numbers() -> None:
    sf = parse_log(_case("case-37")["log_excerpt"]).kv_shortfall
    assert sf is not None and (sf.kind, sf.requested_tokens, sf.available_tokens, sf.available_size, sf.evictable_size) == ("decode", 148, 2048, 2048, 0)


def test_case_41_binding_rank_is_one_that_printed_the_pool() -> None:
    """TP0 printed no KV or pool line; the report does not fall back to it (SGLang's reading is a MIN over ranks)."""
    report = parse_log(_case("case-41")["log_excerpt"])
    prim = report.primary()
    assert prim is not None and prim.rank in ("TP1", "TP2") and prim.kv_tokens == 2090351
    e = explain(report)
    assert e.capacity.max_total_num_tokens == 2090351 and e.settings["cuda_graph_max_bs"].value == 512


def test_case_34_draft_pool_and_pending_capture() -> None:
    e = explain(parse_log(_case("case-34")["log_excerpt"]))
    steps = {s.item: s for s in e.waterfall}
    assert steps["kv_pool"].gib == pytest.approx(6.92) and steps["draft_kv_pool"].gib == pytest.approx(2.16)
    assert "free_after_graphs" not in steps and "free_so_far" in steps  # capture still pending: not runtime headroom
    assert "draft_model" not in steps  # no draft graph line in the log: no "None GiB" row


def test_case_31_allocation_after_the_pool_is_flagged() -> None:
    e = explain(parse_log(_case("case-31")["log_excerpt"]))
    trap = next(t for t in e.traps if t.id == "after_pool_allocation")
    assert "53.87 GiB" in trap.title


def test_case_32_and_30_startup_oom_is_not_a_runtime_oom() -> None:
    """A HIP OOM with no phase line and nothing of serving is a startup OOM; after the KV pool it is the reserve's."""
    e32 = explain(parse_log(_case("case-32")["log_excerpt"]))
    assert e32.diagnosis is not None and e32.diagnosis.failure_class.value == "startup_oom"
    assert e32.oom is not None and e32.oom.vendor == "hip" and e32.oom.free_mib == pytest.approx(4.23 * 1024)
    assert "chunked" not in (e32.lever.why if e32.lever else "")
    e30 = explain(_evidence_report("case-30"))
    assert e30.diagnosis is not None and e30.diagnosis.failure_class.value == "cuda_graph_oom" and e30.diagnosis.phase == "kv_pool"
    assert all(not p.starts for p in e30.predictions if p.mem_fraction_static >= e30.settings["mem_fraction_static"].value)


def _arch(case_id: str) -> Any:
    m = _case(case_id)["model"]
    cfg = {"num_hidden_layers": m["num_hidden_layers"], "model_type": m["name"]}
    if "kv_lora_rank" in m:
        cfg |= {"kv_lora_rank": m["kv_lora_rank"], "qk_rope_head_dim": m["qk_rope_head_dim"]}
    else:
        cfg |= {"num_attention_heads": 64, "num_key_value_heads": m["num_key_value_heads"], "head_dim": m["head_dim"]}
    return model_arch_from_dict(cfg)


# Model facts and a logged token count together: case-01 (K size), case-02 (memory lines), case-26
# (allowed input length), case-30 (K size). case-03 logs weights and free memory but not the
# baseline, and its negative profiled count (-561,981) cannot be rebuilt from the excerpt's numbers
# (ROCm 0.4.8, DP attention); case-12, 16, 19 log no token count.


def test_case_01_tokens_from_model_facts() -> None:
    """Qwen3-235B, tp 4, 4 KV heads → 1 per rank: the logged K size gives the logged token count within 1%."""
    case = _case("case-01")
    cell = cell_size_bytes(_arch("case-01"), tp=case["tp"])
    assert cell == 94 * 1 * 128 * 2 * 2
    report = parse_log(case["log_excerpt"])
    kv = report.ranks[""].kv_pool_gib
    predicted = kv * GIB / cell - 1
    assert predicted == pytest.approx(case["observed"]["kv_cache_tokens"], rel=0.01)


def test_case_30_tokens_from_model_facts() -> None:
    """A 5-layer Qwen3-30B-A3B cut, 4 KV heads × 128, bf16: 21,985,288 tokens × 5,120 B = the logged 104.83 GiB K."""
    case = _case("case-30")
    cell = cell_size_bytes(_arch("case-30"), tp=1)
    report = parse_log(case["log_excerpt"])
    assert report.ranks[""].k_size_gib == pytest.approx(case["observed"]["kv_cache_tokens"] * cell / 2 / GIB, abs=0.01)


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
