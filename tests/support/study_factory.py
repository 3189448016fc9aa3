"""Real SQLite Optuna studies written the way ``tuner run`` stores them (for the readers' tests).

A trial is a spec: its params and its record's fields (``ok_trial``, ``failed_trial``,
``skipped_trial``; a test may change them). :func:`make_study` validates each record as
:class:`tuner.records.TrialRecord` and stores it through the product's own
:func:`tuner.study.optuna_io.tell_record` (the record, its constraints, COMPLETE with
``[context_capacity, output_throughput]`` or PRUNED), and the study's facts through
:func:`tuner.study.optuna_io.save_study_info`. A measured trial's memory report is the product's
(:func:`tuner.trial.memory_facts`) of the simulated server's startup for the trial's flags, so the
readers render it as they render a real run's (the waterfall, not a fallback).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import optuna

from tuner.config import ObjectiveSection
from tuner.records import Constraints, MemoryFacts, PhaseResult, StudyInfo, TrialRecord
from tuner.sglang.client import ServerInfo
from tuner.sglang.flags import FlagTable
from tuner.sglang.logs import parse_log
from tuner.study.optuna_io import make_sampler, open_study, save_study_info, tell_record
from tuner.study.storage import open_storage

HTML_LOG_LINE = '[TP0] Scheduler hit an exception: <script>alert("pwned")</script> & <b>bold</b>'
"""A log line with HTML in it: the report must show it escaped."""

DISTRIBUTIONS = {
    "mem_fraction_static": optuna.distributions.FloatDistribution(0.5, 0.98),
    "max_running_requests": optuna.distributions.IntDistribution(8, 512),
    "chunked_prefill_size": optuna.distributions.IntDistribution(-1, 16384),
    # structural levers (tuner/study/decide/rungs.py), for a trial that moves one
    "dp_size": optuna.distributions.IntDistribution(1, 8),
    "kv_cache_dtype": optuna.distributions.CategoricalDistribution(["auto", "fp8_e4m3"]),
}
SIM_ARGV = ["python", "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB"]
"""The simulated deployment the factory's studies describe (the study's environment says the same)."""


def simulated_start(argv: list[str], context_tokens: int,
                    table: FlagTable | None = None) -> tuple[dict[str, Any], dict[str, Any], MemoryFacts]:
    """What the product makes of a start of the simulated server with ``argv`` (the simulator's
    arguments, no interpreter): ``(resolved, facts, memory)`` of :func:`tuner.trial.resolve_facts`
    and :func:`tuner.trial.memory_facts` on its startup log (no ``/get_server_info``)."""
    from tuner.sim.evaluate import size_server
    from tuner.trial import memory_facts, resolve_facts

    report = parse_log(size_server(argv).log_lines)
    info = ServerInfo.from_json({})
    resolved, facts = resolve_facts(report, info, argv, table or FlagTable.for_version("0.5.5"), context_tokens)
    return resolved, facts, memory_facts(report, info, facts, resolved)


@functools.cache
def simulated_memory(mfs: float, mrr: int, chunked_prefill_size: int, context_tokens: int = 8192) -> dict[str, Any]:
    """The memory report the product stores for a start of the factory's deployment with these flags."""
    argv = [*SIM_ARGV[3:], "--mem-fraction-static", str(mfs), "--max-running-requests", str(mrr),
            "--chunked-prefill-size", str(chunked_prefill_size)]
    return simulated_start(argv, context_tokens)[2].model_dump(mode="json")


def ok_trial(mfs: float, mrr: int, cap: int, tput: float, *, kind: str = "sampled",
             slo_overshoot: float = -0.2, log: list[str] | None = None, token_capacity: int | None = None,
             chunked_prefill_size: int = 8192) -> dict[str, Any]:
    """A measured trial: feasible when ``slo_overshoot`` ≤ 0."""
    token_capacity = cap * 8192 + 17 if token_capacity is None else token_capacity
    return {
        "params": {"mem_fraction_static": mfs, "max_running_requests": mrr, "chunked_prefill_size": chunked_prefill_size},
        "record": {
            "kind": kind, "outcome": "ok", "context_tokens": 8192, "context_capacity": cap,
            "token_capacity": token_capacity, "free_gib_after_graphs": round(8.0 - 40 * (mfs - 0.8), 2),
            "output_throughput_tok_s": tput, "goodput_req_s": tput / 300, "p99_ttft_ms": 800.0,
            "p99_itl_ms": 40.0 * (1 + slo_overshoot),
            "constraints": {"oom_or_crash": -1.0, "slo": slo_overshoot, "stress": -1.0},
            "argv": [*SIM_ARGV, "--mem-fraction-static", str(mfs), "--max-running-requests", str(mrr)],
            "resolved": {"max_total_num_tokens": {"value": token_capacity, "source": "log:scheduler"}},
            "memory": simulated_memory(mfs, mrr, chunked_prefill_size),
            "phases": [PhaseResult(name="measure", duration_s=30.0, completed=120, metrics={
                "request_throughput": 4.0, "output_throughput": tput, "p99_ttft_ms": 800.0,
                "p99_itl_ms": 40.0, "goodput": 3.9, "slo_attainment": 0.98, "error_rate": 0.0}).model_dump(mode="json")],
            "artifacts": {"server_log": "abc123"},
            "log_excerpt": log or ["[2026-11-29 10:00:00] The server is fired up and ready to roll!"],
            "started_at": "2026-11-29T10:00:00+00:00", "duration_s": 95.0,
        },
    }


def failed_trial(mfs: float, failure_class: str, evidence: str, *, log: list[str] | None = None) -> dict[str, Any]:
    """A startup failure: COMPLETE with every constraint violated, as the product tells one."""
    return {
        "params": {"mem_fraction_static": mfs, "max_running_requests": 64, "chunked_prefill_size": 8192},
        "record": {
            "kind": "sampled", "outcome": "failed", "failure_class": failure_class,
            "failure_evidence": evidence, "log_excerpt": log or [evidence],
            "constraints": Constraints.all_violated(),
            "argv": [*SIM_ARGV, "--mem-fraction-static", str(mfs)],
        },
    }


def skipped_trial(mfs: float, proved_by: int) -> dict[str, Any]:
    """A proven-infeasible skip: PRUNED, no restart."""
    return {
        "params": {"mem_fraction_static": mfs, "max_running_requests": 64, "chunked_prefill_size": 8192},
        "record": {"kind": "sampled", "outcome": "skipped", "constraints": Constraints.all_violated(),
                   "skipped_reason": f"mem_fraction_static {mfs} >= a fraction that failed at startup",
                   "proved_by_trial": proved_by},
    }


def make_study(db: Path, name: str, trials: list[dict[str, Any]], *, policy: dict | None = None,
               info: dict[str, Any] | None = None, metric_names: bool = True) -> str:
    """Create ``db`` with one study holding ``trials``; returns the storage URL.

    Args:
        db: The SQLite file.
        name: The study's name.
        trials: Trial specs (:func:`ok_trial`, :func:`failed_trial`, :func:`skipped_trial`).
        policy: The stored ``[objective]`` (default: the default policy with a 10 % capacity band).
        info: Fields of the study's :class:`StudyInfo` to override (``target``, ``config_path``...).
        metric_names: Created as ``tuner run`` creates it (:func:`tuner.study.optuna_io.open_study`:
            the objectives named); ``False``: as versions before the names created it.
    """
    url = f"sqlite:///{db}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if metric_names:
        study = open_study(name, open_storage(url), make_sampler("tpe", 0))
    else:
        study = optuna.create_study(study_name=name, storage=url, directions=["maximize", "maximize"])
    stored = StudyInfo(
        environment={"sglang_version": "0.5.5", "gpu_name": "H100-80GB", "model": "llama-3.1-8b"},
        target={"launcher": "process", "command": "python -m tuner.sim", "url": "http://127.0.0.1:30000"},
        baseline_argv=[*SIM_ARGV, "--mem-fraction-static", "0.8"],
        policy=ObjectiveSection.model_validate(policy or {"capacity_tolerance": 0.10}).model_dump(mode="json"),
        context_tokens=8192,
    ).model_copy(update=info or {})
    save_study_info(study, stored)
    for spec in trials:
        study.enqueue_trial(spec["params"], skip_if_exists=False)
        trial = study.ask({k: DISTRIBUTIONS[k] for k in spec["params"]})
        assert trial.params == spec["params"], trial.params
        tell_record(study, trial, TrialRecord.model_validate({"params": spec["params"], **spec["record"]}))
    return url


def stored_trials(url: str, name: str = "demo-sim") -> list[optuna.trial.FrozenTrial]:
    """The trials of study ``name`` in ``url`` as another reader sees them now (``[]`` before the
    study exists): how the many-hosts tests watch ``tuner run`` processes work."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.load_study(study_name=name, storage=url).trials
    except KeyError:
        return []
