"""The one-line trial summaries `tuner run` prints as each trial ends."""

from __future__ import annotations

from tuner.records import TrialRecord
from tuner.sglang.failures import FailureClass
from tuner.study.progress import describe


def test_failed_trial_line_names_its_class_or_its_evidence() -> None:
    oom = TrialRecord(outcome="failed", failure_class=FailureClass.STARTUP_KV_OOM, failure_evidence="Not enough memory")
    assert describe(3, oom) == "trial 3: failed (startup_kv_oom)"
    gap = TrialRecord(outcome="failed", failure_evidence="measure window held no completed request: raise [budget] measure_s to ≥ 195")
    assert describe(4, gap) == f"trial 4: failed: {gap.failure_evidence}"
    ok = TrialRecord(outcome="ok", context_capacity=22, context_tokens=2048, output_throughput_tok_s=48.6,
                     constraints={"oom_or_crash": -1.0, "slo": -0.3, "stress": -1.0})
    assert describe(5, ok) == "trial 5: capacity 22 × 2048 tokens, 49 tok/s, feasible"
