"""Build real SQLite Optuna studies the way ``tuner run`` stores them (for the readers' tests).

Each trial is asked with its distributions, given the ``tuner.record`` user attribute
(``TrialRecord.model_dump(mode="json")``), its constraints via ``trial.set_constraint`` (feasible
when ≤ 0), and told COMPLETE with ``[context_capacity, output_throughput]`` or PRUNED (skips).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna

from tuner.records import CONSTRAINT_NAMES, RECORD_ATTR, STUDY_ATTR, PhaseResult, StudyInfo, TrialRecord

HTML_LOG_LINE = '[TP0] Scheduler hit an exception: <script>alert("pwned")</script> & <b>bold</b>'
"""A log line with HTML in it: the report must show it escaped."""

DISTRIBUTIONS = {
    "mem_fraction_static": optuna.distributions.FloatDistribution(0.5, 0.98),
    "max_running_requests": optuna.distributions.IntDistribution(8, 512),
    "chunked_prefill_size": optuna.distributions.IntDistribution(-1, 16384),
}


def ok_trial(mfs: float, mrr: int, cap: int, tput: float, *, kind: str = "sampled",
             slo_overshoot: float = -0.2, log: list[str] | None = None, token_capacity: int | None = None,
             chunked_prefill_size: int = 8192) -> dict[str, Any]:
    """A measured trial: feasible when ``slo_overshoot`` ≤ 0."""
    token_capacity = cap * 8192 + 17 if token_capacity is None else token_capacity
    return {
        "params": {"mem_fraction_static": mfs, "max_running_requests": mrr, "chunked_prefill_size": chunked_prefill_size},
        "constraints": {"oom_or_crash": -1.0, "slo": slo_overshoot, "stress": -1.0},
        "values": [cap, tput],
        "record": {
            "kind": kind, "outcome": "ok", "context_tokens": 8192, "context_capacity": cap,
            "token_capacity": token_capacity, "free_gib_after_graphs": round(8.0 - 40 * (mfs - 0.8), 2),
            "output_throughput_tok_s": tput, "goodput_req_s": tput / 300, "p99_ttft_ms": 800.0,
            "p99_itl_ms": 40.0 * (1 + slo_overshoot), "feasible": slo_overshoot <= 0,
            "argv": ["python", "-m", "tuner.sim", "--mem-fraction-static", str(mfs),
                     "--max-running-requests", str(mrr)],
            "resolved": {"max_total_num_tokens": {"value": token_capacity, "source": "log:scheduler"}},
            "memory": {"ranks": [{"rank": "TP0", "weights_gib": 15.0, "kv_gib": 40.0, "free_gib_after_graphs": 7.4}]},
            "phases": [PhaseResult(name="measure", duration_s=30.0, completed=120, metrics={
                "request_throughput": 4.0, "output_throughput": tput, "p99_ttft_ms": 800.0,
                "p99_itl_ms": 40.0, "goodput": 3.9, "slo_attainment": 0.98, "error_rate": 0.0}).model_dump(mode="json")],
            "artifacts": {"server_log": "abc123"},
            "log_excerpt": log or ["[2026-11-29 10:00:00] The server is fired up and ready to roll!"],
            "started_at": "2026-11-29T10:00:00+00:00", "duration_s": 95.0,
        },
    }


def failed_trial(mfs: float, failure_class: str, evidence: str, *, log: list[str] | None = None) -> dict[str, Any]:
    """A startup failure told COMPLETE with a violated ``oom_or_crash`` constraint."""
    return {
        "params": {"mem_fraction_static": mfs, "max_running_requests": 64, "chunked_prefill_size": 8192},
        "constraints": {"oom_or_crash": 1.0, "slo": 0.0, "stress": 1.0},
        "values": [0, 0.0],
        "record": {
            "kind": "sampled", "outcome": "failed", "feasible": False, "failure_class": failure_class,
            "failure_evidence": evidence, "log_excerpt": log or [evidence],
            "argv": ["python", "-m", "tuner.sim", "--mem-fraction-static", str(mfs)],
        },
    }


def skipped_trial(mfs: float, proved_by: int) -> dict[str, Any]:
    """A proven-infeasible skip: PRUNED, no restart."""
    return {
        "params": {"mem_fraction_static": mfs, "max_running_requests": 64, "chunked_prefill_size": 8192},
        "state": "PRUNED",
        "record": {"kind": "sampled", "outcome": "skipped", "feasible": False,
                   "skipped_reason": f"mem_fraction_static {mfs} >= a fraction that failed at startup",
                   "proved_by_trial": proved_by},
    }


def make_study(db: Path, name: str, trials: list[dict[str, Any]], *, policy: dict | None = None,
               info: dict[str, Any] | None = None) -> str:
    """Create ``db`` with one study holding ``trials``; returns the storage URL.

    ``info`` overrides fields of the study's :class:`StudyInfo` (``target``, ``config_path``...).
    """
    url = f"sqlite:///{db}"
    study = optuna.create_study(study_name=name, storage=url, directions=["maximize", "maximize"])
    info = StudyInfo(
        environment={"sglang_version": "0.5.5", "gpu_name": "H100-80GB", "model": "llama-3.1-8b"},
        target={"launcher": "process", "command": "python -m tuner.sim", "url": "http://127.0.0.1:30000"},
        baseline_argv=["python", "-m", "tuner.sim", "--mem-fraction-static", "0.8"],
        policy=policy or {"name": "capacity_then_throughput", "capacity_tolerance": 0.10},
        context_tokens=8192,
    ).model_copy(update=info or {})
    study.set_user_attr(STUDY_ATTR, info.model_dump(mode="json"))
    for spec in trials:
        study.enqueue_trial(spec["params"], skip_if_exists=False)
        trial = study.ask({k: DISTRIBUTIONS[k] for k in spec["params"]})
        assert trial.params == spec["params"], trial.params
        record = TrialRecord.model_validate({"params": spec["params"], **spec["record"]})
        trial.set_user_attr(RECORD_ATTR, record.model_dump(mode="json"))
        if spec.get("state") == "PRUNED":
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        for cname in CONSTRAINT_NAMES:
            trial.set_constraint(cname, spec["constraints"][cname])
        study.tell(trial, spec["values"])
    return url
