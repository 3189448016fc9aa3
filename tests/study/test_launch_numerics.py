"""One numerics key for a launch (issue 38's first gap): the key a proposal's params give
(:func:`tuner.study.launch.launch_numerics`, what the "failed the gate already" screen compares)
equals the key the trial's record stores for the same launch (the rendered command parsed back,
:func:`tuner.sglang.numerics.numerics_key`), on speculative and DP-attention deployments too.

Before, the screen keyed ``dp_size: 4`` / ``speculative_algorithm: True`` where the record keyed
``enable_dp_attention: True`` / ``'eagle3'``: a numerics that failed the gate was launched again
(3 of 8 launches on the reference twin with an fp8 fault, 4 with a DP-attention fault)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tuner.records import QualityFacts, TrialRecord
from tuner.sglang.flags import FlagTable, parse_argv
from tuner.sglang.numerics import numerics_changes, numerics_key
from tuner.study.decide.screens import QualityFailed
from tuner.study.launch import launch_numerics
from tuner.trial import render_argv

TWIN = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "8", "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "/d", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4", "--mem-fraction-static", "0.88"]
PLAIN = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "8", "--mem-fraction-static", "0.88"]
CANDIDATES: list[dict[str, Any]] = [
    {"dp_size": 4, "mem_fraction_static": 0.9},
    {"dp_size": 8},
    {"dp_size": 1},
    {"kv_cache_dtype": "fp8_e4m3", "dp_size": 4},
    {"speculative_algorithm": True, "speculative_num_steps": 2, "speculative_num_draft_tokens": 3},
    {"speculative_algorithm": True},
    {"speculative_algorithm": False, "dp_size": 4},
    {"enable_hierarchical_cache": False, "mem_fraction_static": 0.85},
]


@pytest.mark.parametrize("version", ["0.5.5.post3", "0.5.23"])
@pytest.mark.parametrize("argv", [TWIN, PLAIN], ids=["speculative", "plain"])
@pytest.mark.parametrize("params", CANDIDATES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_a_proposal_s_key_is_the_key_its_launch_records(version: str, argv: list[str], params: dict[str, Any]) -> None:
    table = FlagTable.for_version(version)
    if argv is PLAIN and "speculative_algorithm" in params:
        pytest.skip("a plain baseline searches no speculation")
    baseline = dict(numerics_key(parse_argv(argv, table)))
    recorded = dict(numerics_key(parse_argv(render_argv(argv, params, table), table)))
    assert launch_numerics(params, baseline) == recorded


def test_two_dp_attention_sizes_are_two_numerics_and_plain_data_parallelism_none() -> None:
    assert numerics_changes({"enable_dp_attention": True, "dp_size": 4}, {}) == ["dp_size", "enable_dp_attention"]
    assert numerics_changes({"enable_dp_attention": True, "dp_size": 4},
                            {"enable_dp_attention": True, "dp_size": 8}) == ["dp_size"]
    assert numerics_changes({"dp_size": 2}, {}) == []  # replicas each compute what one server computes


def _record(kind: str, numerics: dict[str, Any], status: str) -> TrialRecord:
    return TrialRecord(kind=kind, params={"mem_fraction_static": 0.88},  # type: ignore[arg-type]
                       quality=QualityFacts(numerics=numerics, status=status, reason="answers differ"))


def test_the_screen_skips_a_dp_attention_or_speculative_numerics_that_failed_already() -> None:
    table = FlagTable.for_version("0.5.23")
    baseline = dict(numerics_key(parse_argv(TWIN, table)))
    failed: list[tuple[int, TrialRecord]] = [(0, _record("baseline", baseline, "reference"))]
    for number, params in enumerate(({"dp_size": 4}, {"speculative_algorithm": True, "speculative_num_steps": 2}), 1):
        launched = dict(numerics_key(parse_argv(render_argv(TWIN, params, table), table)))
        failed.append((number, _record("sampled", launched, "failed")))
    view: Any = SimpleNamespace(finished=tuple(failed))
    screen = QualityFailed()
    dp = screen.why_not({"dp_size": 4, "mem_fraction_static": 0.93}, view)
    assert dp is not None and dp.proof == 1, dp
    spec = screen.why_not({"speculative_algorithm": True, "speculative_num_steps": 2, "max_running_requests": 8}, view)
    assert spec is not None and spec.proof == 2, spec
    assert screen.why_not({"dp_size": 8}, view) is None  # another DP size: other numerics, probed on its own
    assert screen.why_not({"mem_fraction_static": 0.95}, view) is None  # the baseline's numerics
