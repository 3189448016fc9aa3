"""A :class:`tuner.study.loop.TrialRunner` on the simulator's offline evaluation (virtual time).

Used by the search-quality benchmark and the fast study tests: every trial sizes a simulated
server from the rendered command line and runs the workload's measured window and the stress load
on a virtual clock, so a trial costs a fraction of a second instead of minutes. What a trial makes
of its phases is the product's own code (:mod:`tuner.trial`): flag rendering, what SGLang resolved
(read from the startup log, as a real trial does when ``/get_server_info`` lacks a value), the
memory model, the measured window's concurrency, the boot probe's probe-only path, the stress
concurrency, and :func:`tuner.trial.assemble_record` (constraints, SLO value with the error rate,
feasibility). Only the load itself differs: the simulator's aggregate metrics
(:func:`tuner.sim.evaluate.evaluate`) stand in for the HTTP load generator's per-request ones, and
the window's metrics include its warm-up.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from tuner.config import TunerConfig
from tuner.launch.hostmem import read_host_memory
from tuner.load import build_workload, capacity_probe
from tuner.load.metrics import LoadSummary, slo_violations
from tuner.records import PhaseResult, TrialRecord
from tuner.sglang.client import ServerInfo
from tuner.sglang.failures import Failure, FailureClass
from tuner.sglang.flags import FlagTable, parse_argv
from tuner.sglang.hicache import HostMemory
from tuner.sglang.logs import parse_log
from tuner.sim.engine import SimRequest
from tuner.sim.evaluate import EvalResult, evaluate
from tuner.study.budget import load_concurrency
from tuner.study.job import TrialJob
from tuner.study.space import SEARCHED_FIELDS
from tuner.trial import (
    assemble_record,
    failed_record,
    gpu_peak_memory,
    memory_facts,
    needs_probe_only,
    probe_only_record,
    render_argv,
    resolve_facts,
    stress_concurrency,
    stress_output_tokens,
    window_load,
)

_MEMO: dict[tuple, EvalResult] = {}
"""Offline evaluations by (argv, request pool, concurrency, duration): the simulated world is
deterministic, so a config measured once (by the grid, another seed, another strategy) is not
simulated again."""


def _evaluate(argv: list[str], requests: list[SimRequest], key: str, **kwargs: Any) -> EvalResult:
    memo_key = (tuple(argv), key, tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                                              for k, v in kwargs.items())))
    if memo_key not in _MEMO:
        result = evaluate(argv, requests, **kwargs)
        # The probe's startup lines are read whole; of a load, only its last lines (a crash).
        _MEMO[memo_key] = result if key == "probe" else dataclasses.replace(result, log_lines=result.log_lines[-5:])
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
        p99_tpot_ms=scale(result.p99_tpot_ms), mean_e2e_latency_ms=scale(result.mean_e2e_latency_ms),
    )


def _sim_requests(workload: Any, limit: int, after: dict[str, str] | None = None) -> list[SimRequest]:
    out = []
    for i, req in enumerate(workload.passes()):
        if i >= limit:
            break
        out.append(SimRequest(rid=req.rid, input_ids=list(req.input_ids), max_new_tokens=req.max_new_tokens))
        if after is not None and req.after is not None:
            after[req.rid] = req.after  # turn k waits for turn k-1, as the load generator does
    return out


def _cache(result: EvalResult, explicit: dict[str, Any]) -> dict[str, Any]:
    """The record's ``cache`` facts from the engine's own counters (load-back = the host tier)."""
    out: dict[str, Any] = {"hit_rate": result.cache_hit_rate, "host_hit_rate": result.host_hit_rate,
                           "device_hit_rate": result.cache_hit_rate - result.host_hit_rate,
                           "hit_rate_source": "/metrics"}
    if result.host_pool_bytes_per_rank:
        ranks = int(explicit.get("tp_size") or 1) * int(explicit.get("pp_size") or 1)
        per_rank = round(result.host_pool_bytes_per_rank / 1e9, 2)
        out.update(host_pool_gb_per_rank=per_rank, host_pool_ranks=ranks, host_pool_gb=round(per_rank * ranks, 2))
    return out


def _summary(result: EvalResult, config: TunerConfig) -> LoadSummary:
    """The simulator's window as the load generator's summary (the metrics it has; SLO by the
    product's :func:`tuner.load.metrics.slo_violations`)."""
    duration = max(result.duration_s, 1e-9)
    fields: dict[str, Any] = {
        "mean_ttft_ms": result.mean_ttft_ms, "median_ttft_ms": result.p50_ttft_ms, "p99_ttft_ms": result.p99_ttft_ms,
        "p99_itl_ms": result.p99_itl_ms, "p99_tpot_ms": result.p99_tpot_ms,
        "mean_e2e_latency_ms": result.mean_e2e_latency_ms,
    }
    errored = result.rejected + (1 if result.error else 0)
    done = result.completed
    return LoadSummary(
        duration=result.duration_s, completed=done, errored=errored, incomplete=0, total_input_tokens=0,
        total_output_tokens=result.total_output_tokens, request_throughput=result.request_throughput,
        input_throughput=0.0, output_throughput=result.output_throughput,
        total_throughput=result.output_throughput,
        concurrency=(result.mean_e2e_latency_ms or 0.0) / 1000 * done / duration,
        error_rate=errored / (done + errored) if done or errored else 0.0,
        slo_violations=slo_violations(config.slo, fields), **fields,
    )


class OfflineRunner:
    """Runs trials with :func:`tuner.sim.evaluate.evaluate` (``[service] command`` = sim argv).

    Args:
        config: The scenario's config (``[service] command`` is ``python -m tuner.sim ...``).
        world_seed: Seed of the simulated world (the workload's draw); default the study's seed.
        noise: Relative run-to-run spread of the measured speed: each launch's measured window
            runs ``1 + u`` times as fast, ``u`` uniform in ``[-noise, noise]`` (seeded by the
            study's seed and the launch count).
    """

    def __init__(self, config: TunerConfig, *, world_seed: int | None = None, noise: float = 0.0,
                 pool_requests: int | None = None) -> None:
        self.config = config
        command = list(config.service.command or [])
        self.sim_argv = command[command.index("tuner.sim") + 1:] if "tuner.sim" in command else command
        version = self.sim_argv[self.sim_argv.index("--sim-version") + 1] if "--sim-version" in self.sim_argv else "0.5.5"
        self.table = FlagTable.for_version(version)
        self.world_seed = config.study.seed if world_seed is None else world_seed
        self.workload = build_workload(config.workload, seed=self.world_seed)
        self._pools: dict[int, list[SimRequest]] = {}
        self.after: dict[str, str] = {}
        self.pool_requests = pool_requests
        self._pool_key = f"{config.workload.model_dump_json()}|{self.world_seed}"
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

    def host_memory(self) -> HostMemory:
        """The simulated host, read by the product from the command line (nothing runs offline)."""
        return read_host_memory(["-m", "tuner.sim", *self.sim_argv])

    def _pool(self, concurrency: int) -> list[SimRequest]:
        """The measured window's requests: as many as a closed loop of ``concurrency`` streams
        sends in a window (the real load generator's stream is endless), ``[budget] max_requests``
        at most."""
        n = self.pool_requests or max(64, 6 * concurrency)
        if self.config.budget.max_requests:
            n = min(n, self.config.budget.max_requests)
        if n not in self._pools:
            self._pools[n] = _sim_requests(self.workload, n, self.after)
        return self._pools[n]

    def run(self, job: TrialJob, on_phase: Callable[[str], None]) -> TrialRecord:
        self.launches += 1
        record = self._run(job)
        self.failures += record.outcome == "failed"
        record = record.model_copy(update={"duration_s": 1.0, "repeat_of": job.repeat_of})
        self.history.append((job.number, record))
        return record

    def _run(self, job: TrialJob) -> TrialRecord:
        argv = render_argv(self.sim_argv, job.params, self.table)
        explicit = parse_argv(argv, self.table) if job.kind == "baseline" else {}
        record = TrialRecord(params=dict(job.params) or {k: explicit[k] for k in SEARCHED_FIELDS
                                                         if explicit.get(k) is not None},
                             argv=argv, kind=job.kind,  # type: ignore[arg-type]
                             prediction=dict(job.prediction), context_tokens=job.context_tokens)
        budget = self.config.budget
        probe = _evaluate(argv, [], "probe", concurrency=1, duration_s=0.0)
        factor = 1.0 + self._rng.uniform(-self.noise, self.noise) if self.noise else 1.0
        report = parse_log(probe.log_lines)
        if not probe.started:
            failure = report.failure or Failure(failure_class=FailureClass.CRASH,
                                                evidence=probe.startup_failure or "startup failed")
            return failed_record(record, failure, report)
        info = ServerInfo.from_json({})  # no HTTP offline: every value comes from the log
        resolved, facts = resolve_facts(report, info, argv, self.table, job.context_tokens)
        if job.kind == "baseline":
            record = record.model_copy(update={"params": facts["params"]})
        capacity = facts["context_capacity"]
        record = record.model_copy(update={
            "resolved": resolved, "token_capacity": facts["max_total_num_tokens"], "context_capacity": capacity,
            "free_gib_after_graphs": facts["free_gib_after_graphs"],
        })
        memory = memory_facts(report, info, facts, resolved)
        if needs_probe_only(capacity, job.capacity_floor):
            return probe_only_record(record, memory, capacity or 0, job.capacity_floor)
        concurrency = load_concurrency(budget, capacity=capacity,
                                       max_running_requests=facts.get("effective_max_running_requests"),
                                       max_total_num_tokens=facts.get("max_total_num_tokens"),
                                       mean_request_tokens=self.workload.mean_request_tokens)
        pool = self._pool(concurrency)
        measure = _noisy(_evaluate(argv, pool, f"{self._pool_key}|{len(pool)}", concurrency=concurrency,
                                   duration_s=budget.warmup_s + budget.measure_s, after=self.after), factor)
        phases = [_phase("measure", measure)]
        loads = [measure]
        runtime_failure = _runtime_failure(measure)
        summary = _summary(measure, self.config)
        stress_failed = False
        if runtime_failure is None and budget.stress_s > 0 and capacity:
            n = stress_concurrency(capacity, budget)
            requests = _sim_requests(capacity_probe(n, job.context_tokens, output_len=stress_output_tokens(
                job.context_tokens), seed=self.config.study.seed + job.number), n)
            # Capacity-probe requests all have the context's length; their random token ids share
            # no prefix, so the outcome does not depend on the seed (one memo entry per size).
            stress = _evaluate(argv, requests, f"stress|{n}|{job.context_tokens}", concurrency=n)
            phases.append(_phase("stress", stress))
            loads.append(stress)
            runtime_failure = _runtime_failure(stress)
            stress_failed = runtime_failure is not None or bool(stress.rejected) or stress.completed < n
        memory["retractions"] = measure.retractions
        # What the simulated GPU monitor reads (a real trial on the simulator has one, ``auto``):
        # the memory in use after startup, and under load that plus the largest step's activations.
        total_mib = _gpu_total_mib(self.sim_argv)
        if total_mib and record.free_gib_after_graphs is not None:
            after_start = total_mib - record.free_gib_after_graphs * 1024
            peak = max(measure.peak_activation_gib, *(p.peak_activation_gib for p in loads))
            memory.update(gpu_peak_memory(after_start, after_start + peak * 1024))
        longest = int(getattr(self.config.workload, "input_len", 0) or self.workload.context_tokens)
        record = assemble_record(record, memory=memory, summary=summary, phases=phases, stress_failed=stress_failed,
                                 runtime_failure=runtime_failure, unmeasured=_gap(summary),
                                 load=window_load(concurrency, facts, longest))
        return record.model_copy(update={"cache": _cache(measure, parse_argv(argv, self.table))})


def _gpu_total_mib(sim_argv: list[str]) -> float | None:
    """The simulated GPU's size as its GPU monitor reports it (MiB), from ``--sim-gpu``."""
    from tuner.sim.gpus import get_gpu

    name = sim_argv[sim_argv.index("--sim-gpu") + 1] if "--sim-gpu" in sim_argv else None
    return float(get_gpu(name).memory_mib) if name else None


def _gap(summary: LoadSummary) -> str | None:
    """The real trial's :func:`tuner.trial.measure_gap` verdict, without per-request records."""
    if summary.completed or summary.errored:
        return None
    return "measure window held no completed request (offline window too short for one E2E latency)"


def _runtime_failure(result: EvalResult) -> Failure | None:
    """The server's death under load, classified by the product's log parser."""
    if not (result.runtime_oom or result.error):
        return None
    return parse_log(result.log_lines).failure or Failure(
        failure_class=FailureClass.RUNTIME_OOM if result.runtime_oom else FailureClass.CRASH,
        evidence=result.error or "runtime OOM under load")


def _phase(name: str, result: EvalResult) -> PhaseResult:
    return PhaseResult(name=name, duration_s=result.duration_s, completed=result.completed,
                       metrics={"output_throughput": result.output_throughput, "p99_ttft_ms": result.p99_ttft_ms,
                                "p99_itl_ms": result.p99_itl_ms, "retractions": float(result.retractions)})
