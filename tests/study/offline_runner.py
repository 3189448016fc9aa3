"""A :class:`tuner.study.loop.TrialRunner` on the simulator's offline evaluation (virtual time).

Used by the search-quality benchmark and the fast study tests: every trial sizes a simulated
server from the rendered command line (the same flag rendering, log parsing and memory model as a
real trial) and runs the workload's measured window and the stress load on a virtual clock, so a
trial costs a fraction of a second instead of minutes. Nothing here replaces product code: the
study loop, the planner, the sampler and the skipping rules run unchanged.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from tuner.config import TunerConfig
from tuner.load import build_workload, capacity_probe
from tuner.records import PhaseResult, TrialRecord
from tuner.records import Constraints, context_capacity
from tuner.study.loop import TrialJob
from tuner.study.space import SEARCHED_FIELDS
from tuner.sglang.failures import FailureClass
from tuner.sglang.flags import FlagTable, parse_argv
from tuner.sglang.logs import parse_log
from tuner.sglang.memory import KVCapacityModel
from tuner.sim.engine import SimRequest
from tuner.sim.evaluate import EvalResult, evaluate
from tuner.trial import load_concurrency, render_argv

_MEMO: dict[tuple, EvalResult] = {}
"""Offline evaluations by (argv, request pool, concurrency, duration): the simulated world is
deterministic, so a config measured once (by the grid, another seed, another strategy) is not
simulated again."""


def _evaluate(argv: list[str], requests: list[SimRequest], key: str, **kwargs: Any) -> EvalResult:
    memo_key = (tuple(argv), key, tuple(sorted(kwargs.items())))
    if memo_key not in _MEMO:
        result = evaluate(argv, requests, **kwargs)
        # Only the probe's startup lines are read; the engine's step lines of a load are dropped.
        _MEMO[memo_key] = result if key == "probe" else dataclasses.replace(result, log_lines=[])
    return _MEMO[memo_key]


def _noisy(result: EvalResult, factor: float) -> EvalResult:
    """``result`` on a run ``factor`` times as fast (throughput × factor, latencies ÷ factor)."""
    if factor == 1.0:
        return result
    scale = lambda v: None if v is None else v / factor  # noqa: E731
    return dataclasses.replace(
        result, output_throughput=result.output_throughput * factor,
        request_throughput=result.request_throughput * factor,
        p99_ttft_ms=scale(result.p99_ttft_ms), p99_itl_ms=scale(result.p99_itl_ms),
        mean_ttft_ms=scale(result.mean_ttft_ms), p50_ttft_ms=scale(result.p50_ttft_ms),
        p99_tpot_ms=scale(result.p99_tpot_ms),
    )


def _sim_requests(workload: Any, limit: int) -> list[SimRequest]:
    out = []
    for i, req in enumerate(workload.passes()):
        if i >= limit:
            break
        out.append(SimRequest(rid=req.rid, input_ids=list(req.input_ids), max_new_tokens=req.max_new_tokens))
    return out


class OfflineRunner:
    """Runs trials with :func:`tuner.sim.evaluate.evaluate` (``[service] command`` = sim argv).

    Args:
        config: The scenario's config (``[service] command`` is ``python -m tuner.sim ...``).
        measure_requests: Requests in the measured window's pool (closed loop).
        world_seed: Seed of the simulated world (the workload's draw); default the study's seed.
        noise: Relative run-to-run spread of the measured speed: each launch's measured window
            runs ``1 + u`` times as fast, ``u`` uniform in ``[-noise, noise]`` (seeded by the
            study's seed and the launch count).
    """

    def __init__(self, config: TunerConfig, *, measure_requests: int = 64, world_seed: int | None = None,
                 noise: float = 0.0) -> None:
        self.config = config
        command = list(config.service.command or [])
        self.sim_argv = command[command.index("tuner.sim") + 1:] if "tuner.sim" in command else command
        version = self.sim_argv[self.sim_argv.index("--sim-version") + 1] if "--sim-version" in self.sim_argv else "0.5.5"
        self.table = FlagTable.for_version(version)
        self.world_seed = config.study.seed if world_seed is None else world_seed
        self.workload = build_workload(config.workload, seed=self.world_seed)
        self.requests = _sim_requests(self.workload, measure_requests)
        self._pool_key = f"{config.workload.model_dump_json()}|{self.world_seed}|{measure_requests}"
        self.noise = noise
        self._rng = random.Random(config.study.seed * 7919 + 17)
        self.launches = 0
        self.failures = 0
        self.history: list[tuple[int, TrialRecord]] = []

    def environment(self) -> dict[str, Any]:
        gpu = self.sim_argv[self.sim_argv.index("--sim-gpu") + 1] if "--sim-gpu" in self.sim_argv else "H100-80GB"
        return {"sglang_version": self.table.version, "gpu_name": gpu, "driver_version": "simulated",
                "model": parse_argv(self.sim_argv, self.table).get("model_path")}

    def target(self) -> dict[str, Any]:
        return {"launcher": "offline", "command": self.sim_argv}

    def baseline_argv(self) -> list[str]:
        return list(self.sim_argv)

    def prior_cost_s(self) -> float:
        return 1.0

    def run(self, job: TrialJob, on_phase: Callable[[str], None]) -> TrialRecord:
        self.launches += 1
        argv = render_argv(self.sim_argv, job.params, self.table)
        record = TrialRecord(params=dict(job.params), argv=argv, kind=job.kind,  # type: ignore[arg-type]
                             prediction=dict(job.prediction), context_tokens=job.context_tokens)
        budget = self.config.budget
        probe = _evaluate(argv, [], "probe", concurrency=1, duration_s=0.0)
        factor = 1.0 + self._rng.uniform(-self.noise, self.noise) if self.noise else 1.0
        if not probe.started:
            self.failures += 1
            classified = parse_log(probe.log_lines).failure  # the product's own classifier
            failure = classified.failure_class if classified else FailureClass.CRASH
            record = record.model_copy(update={
                "outcome": "failed", "failure_class": failure,
                "failure_evidence": classified.evidence if classified else probe.startup_failure,
                "constraints": Constraints.all_violated(), "duration_s": 1.0,
            })
            self.history.append((job.number, record))
            return record
        report = parse_log(probe.log_lines)
        explicit = parse_argv(argv, self.table)
        sched = report.scheduler
        mfs = float(explicit.get("mem_fraction_static") or 0.88)
        capacity = context_capacity(probe.max_running_requests, probe.max_total_num_tokens, job.context_tokens)
        memory: dict[str, Any] = {"context_len": sched.context_len if sched else None, "page_size": 1}
        memory["capacity_model"] = KVCapacityModel.from_report(report, None, mfs).model_dump(mode="json")
        params = dict(job.params)
        if job.kind == "baseline":
            params = {k: explicit[k] for k in SEARCHED_FIELDS if k in explicit}
            params.setdefault("max_running_requests", probe.max_running_requests)
            params.setdefault("chunked_prefill_size", sched.chunked_prefill_size if sched else None)
        concurrency = load_concurrency(budget, capacity=capacity, max_running_requests=probe.max_running_requests,
                                       max_total_num_tokens=probe.max_total_num_tokens,
                                       mean_request_tokens=self.workload.context_tokens)
        measure = _noisy(_evaluate(argv, self.requests, self._pool_key, concurrency=concurrency,
                                   duration_s=budget.warmup_s + budget.measure_s), factor)
        phases = [_phase("measure", measure)]
        failure = FailureClass.RUNTIME_OOM if measure.runtime_oom else None
        stress_failed = False
        if failure is None and capacity:
            n = max(1, min(capacity, budget.max_concurrency))
            stress_reqs = _sim_requests(capacity_probe(n, job.context_tokens, output_len=32, seed=job.number), n)
            stress = _evaluate(argv, stress_reqs, f"stress|{n}|{job.context_tokens}", concurrency=n)
            phases.append(_phase("stress", stress))
            if stress.runtime_oom:
                failure, stress_failed = FailureClass.RUNTIME_OOM, True
            stress_failed = stress_failed or bool(stress.error) or stress.completed < n
        slo = self.config.slo
        violations = []
        for name, value in (("ttft", measure.p99_ttft_ms), ("itl", measure.p99_itl_ms)):
            limit = getattr(slo, f"{name}_ms").get("p99")
            if limit and value is not None:
                violations.append(value / limit - 1)
        slo_value = max(violations) if violations else -1.0
        if measure.completed == 0:
            slo_value = 1.0
        constraints = {"oom_or_crash": 1.0 if failure else -1.0, "slo": slo_value,
                       "stress": 1.0 if stress_failed else -1.0}
        if failure:
            self.failures += 1
        record = record.model_copy(update={
            "params": params,
            "outcome": "failed" if failure else "ok",
            "failure_class": failure,
            "token_capacity": probe.max_total_num_tokens,
            "context_capacity": capacity,
            "free_gib_after_graphs": probe.free_gib_after_graphs,
            "output_throughput_tok_s": measure.output_throughput,
            "p99_ttft_ms": measure.p99_ttft_ms,
            "p99_itl_ms": measure.p99_itl_ms,
            "constraints": constraints,
            "feasible": Constraints.of(constraints).feasible,
            "memory": memory,
            "phases": phases,
            "duration_s": 1.0,
        })
        self.history.append((job.number, record))
        return record


def _phase(name: str, result: EvalResult) -> PhaseResult:
    return PhaseResult(name=name, duration_s=result.duration_s, completed=result.completed,
                       metrics={"output_throughput": result.output_throughput, "p99_ttft_ms": result.p99_ttft_ms,
                                "p99_itl_ms": result.p99_itl_ms, "retractions": float(result.retractions)})
