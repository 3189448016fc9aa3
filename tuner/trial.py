"""One trial, end to end: :class:`TrialExecutor` runs one candidate on the launcher it is handed.

The ordered phases of a trial (one list, like SGLang's own pipeline)::

    render   candidate knobs → argv for the detected SGLang version (replace only the tuned flags)
    start    launcher restart with that argv; wait until ready, or a classified failure
    probe    memory report: startup log lines + /get_server_info + the GPU monitor (§4.2, §5.2)
             → token capacity, context capacity, headroom after graphs
    measure  warm-up and measured window of the configured workload (early stop when the SLO is
             clearly lost); skipped when the probe shows the candidate cannot matter
    stress   the workload's worst case: the longest contexts at the highest concurrency the config
             admits; a runtime OOM here makes the config infeasible
    record   objectives, constraints, record, artifacts (server log, per-request results, server info)

Nothing here decides which config to try (:mod:`tuner.study.planner`), tells Optuna (:mod:`tuner.study.loop`) or
chooses the launcher, flag table and GPU monitor (:mod:`tuner.entrypoints`, the composition root).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tuner.config import TunerConfig
from tuner.errors import LaunchError, LoadError, ServerError, ServiceControlError, TunerError
from tuner.launch.base import Launcher, LaunchPhase
from tuner.launch.hostmem import read_host_memory
from tuner.load import SLO, LiveStats, LoadResult, build_workload, capacity_probe, run_load_sync
from tuner.load.metrics import LoadSummary, tier_hits_from_metrics
from tuner.records import Constraints, PhaseResult, TrialRecord, context_capacity
from tuner.sglang.client import ServerInfo, SGLangClient
from tuner.sglang.failures import Failure, FailureClass
from tuner.sglang.flags import FlagTable, parse_argv, replace_flags, validate
from tuner.sglang.hicache import HostMemory
from tuner.sglang.logs import LogReport, LogWatcher, parse_log
from tuner.sglang.memory import KVCapacityModel
from tuner.study.budget import load_concurrency, prior_trial_cost_s
from tuner.study.hostcheck import ranks_of
from tuner.study.job import PhaseProgress, TrialJob
from tuner.study.space import HICACHE_KNOBS, SEARCHED_FIELDS

__all__ = [
    "TrialExecutor",
    "render_argv",
    "host_pool_kill",
    "slo_clearly_lost",
    "measure_gap",
    "resolve_facts",
    "memory_facts",
    "failed_record",
    "probe_only_record",
    "needs_probe_only",
    "gpu_peak_memory",
    "stress_concurrency",
    "stress_output_tokens",
    "slo_value",
    "assemble_record",
    "window_load",
]

_log = logging.getLogger(__name__)
_GIB = float(2**30)
_STRESS_OUTPUT_TOKENS = 32
"""Output tokens of each stress request: enough decode steps that the batch is resident together."""


def render_argv(baseline_argv: list[str], params: Mapping[str, Any], table: FlagTable) -> list[str]:
    """The full server command for ``params``: only the tuned flags of the baseline replaced.

    A disabled hierarchical cache removes its flag and its conditional knobs (size, ratio, write
    policy, I/O backend, memory layout; §7).

    Raises:
        FlagError: A knob this SGLang version lacks, or a value outside its choices.
    """
    if not params:
        return list(baseline_argv)
    rendered = dict(params)
    if rendered.get("enable_hierarchical_cache") is False:
        rendered.update(dict.fromkeys(("enable_hierarchical_cache", *HICACHE_KNOBS)))
    return replace_flags(baseline_argv, rendered, table)


def measure_gap(result: LoadResult | None, measure_s: float) -> str | None:
    """Why a measure phase holds no completed request, naming the ``[budget] measure_s`` it needs.

    ``None`` when the phase measured something, errored (the error rate is the SLO's business) or
    did not run. The E2E latency is the longest one seen in any phase (completed requests), else
    the longest a request stayed in flight (a lower bound, written ``≥``); twice it leaves room
    for a window that holds its sends.

    Args:
        result: The measure phase's load result.
        measure_s: The ``[budget] measure_s`` it ran with (s).

    Returns:
        One line, e.g. ``"measure window held no completed request: E2E ≈ 17.0 s > window 8 s:
        raise [budget] measure_s to ≥ 34"``, or ``None``.
    """
    if result is None or result.summary.completed > 0 or result.summary.errored > 0:
        return None
    done = [r.e2e_latency_s for r in result.records if r.status == "ok" and r.e2e_latency_s is not None]
    spans = [r.end_time_s - r.send_time_s for r in result.records if r.end_time_s is not None]
    e2e_s = max(done or spans or [measure_s])
    about = "≈" if done else "≥"  # in-flight spans only bound it from below
    why = f" ({result.stop_reason})" if result.stop_reason else ""
    return (
        f"measure window held no completed request{why}: E2E {about} {e2e_s:.1f} s > window {measure_s:g} s: "
        f"raise [budget] measure_s to ≥ {max(math.ceil(2 * e2e_s), math.ceil(measure_s) + 1)}"
    )


def slo_clearly_lost(stats: LiveStats, slo: SLO, *, min_completed: int = 16, factor: float = 2.0) -> bool:
    """Whether a running load phase has clearly lost its SLO (stop it early to save the budget).

    Clearly lost: in the measured window, at least ``min_completed`` requests finished and the
    p99 TTFT so far exceeds ``factor`` times the loosest TTFT limit; or more than half of the
    requests errored.

    Args:
        stats: The live statistics of the tick.
        slo: The limits.
        min_completed: Requests needed before judging.
        factor: How far over the limit counts as clearly lost.
    """
    if stats.completed + stats.errored >= min_completed and stats.errored > stats.completed:
        return True
    if stats.phase != "measure" or stats.completed < min_completed or stats.p99_ttft_ms_so_far is None:
        return False
    limits = list(slo.ttft_ms.values())
    return bool(limits) and stats.p99_ttft_ms_so_far > factor * max(limits)


def _log_float(report: LogReport, name: str) -> float | None:
    """A numeric ``server_args`` echo of the startup log (``None`` when absent or not a number)."""
    try:
        return float(report.server_args[name])
    except (KeyError, ValueError):
        return None


def resolve_facts(
    report: LogReport, info: ServerInfo, argv: list[str], table: FlagTable, context_tokens: int
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """What SGLang resolved for a started server, with sources, and the trial's derived facts.

    Each value comes from ``/get_server_info`` first, else the startup log (the scheduler line,
    the capture lines, the ``server_args=ServerArgs(...)`` echo), so a command that sets no
    ``--mem-fraction-static`` gets the fraction SGLang chose for the GPU, never an assumed one
    (§2.1, §4.2, §5.2).

    Args:
        report: The parsed startup log.
        info: ``/get_server_info`` normalised (``ServerInfo.from_json({})`` when not read).
        argv: The launched command line.
        table: The flag table of the SGLang version.
        context_tokens: The context length of context capacity (tokens).

    Returns:
        ``(resolved, facts)``: ``resolved`` maps a field to ``{"value", "source"}``; ``facts``
        holds ``max_total_num_tokens``, ``effective_max_running_requests``,
        ``chunked_prefill_size``, ``context_len``, ``context_capacity``, ``free_gib_after_graphs``
        (GiB) and ``params`` (the searched knobs as the server runs them).
    """
    resolved: dict[str, dict[str, Any]] = {}

    def put(name: str, *candidates: tuple[Any, str]) -> Any:
        for value, source in candidates:
            if value is not None:
                resolved[name] = {"value": value, "source": source}
                return value
        return None

    sched = report.scheduler
    tokens = put("max_total_num_tokens", (info.max_total_num_tokens, "server_info"),
                 (report.max_total_num_tokens, "log:scheduler"))
    mrr = put("max_running_requests", (info.effective_max_running_requests, "server_info:effective"),
              (sched.max_running_requests if sched else None, "log:scheduler"),
              (info.max_running_requests, "server_info:arg"))
    cps = put("chunked_prefill_size", (sched.chunked_prefill_size if sched else None, "log:scheduler"),
              (info.chunked_prefill_size, "server_info"))
    put("mem_fraction_static", (info.mem_fraction_static, "server_info"),
        (_log_float(report, "mem_fraction_static"), "log:server_args"))
    context_len = put("context_length", (sched.context_len if sched else None, "log:scheduler"),
                      (info.context_length, "server_info"))
    page = _log_float(report, "page_size")
    put("page_size", (info.page_size, "server_info"), (int(page) if page else None, "log:server_args"))
    put("cuda_graph_max_bs", (info.cuda_graph_max_bs, "server_info"))
    put("max_prefill_tokens", (sched.max_prefill_tokens if sched else None, "log:scheduler"),
        (info.max_prefill_tokens, "server_info"))
    free = put("available_gpu_mem_gib", (sched.available_gpu_mem_gib if sched else None, "log:scheduler"))
    rank = report.primary()
    if free is None and rank is not None:
        free = put("available_gpu_mem_gib", (rank.graph_end_avail_gib, "log:capture"))
    capacity = context_capacity(mrr, tokens, context_tokens) if tokens else None
    # The baseline's knobs: what its command line sets, plus what SGLang resolved for the
    # three knobs every study searches (the others stay at SGLang's own default).
    explicit = parse_argv(argv, table)
    params: dict[str, Any] = {name: explicit[name] for name in SEARCHED_FIELDS if explicit.get(name) is not None}
    for name in ("mem_fraction_static", "max_running_requests", "chunked_prefill_size"):
        if name not in params and name in resolved:
            params[name] = resolved[name]["value"]
    if info.enable_hierarchical_cache:
        params["enable_hierarchical_cache"] = True
        if not params.get("hicache_size"):
            params.setdefault("hicache_ratio", info.hicache_ratio)
    return resolved, {
        "max_total_num_tokens": tokens,
        "effective_max_running_requests": mrr,
        "chunked_prefill_size": cps,
        "context_len": context_len,
        "context_capacity": capacity,
        "free_gib_after_graphs": free,
        "params": params,
    }


def memory_facts(report: LogReport, info: ServerInfo, facts: Mapping[str, Any],
                 resolved: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The per-rank memory report, plus the memory model calibrated on it (§1.2, §1.6, §8).

    Args:
        report: The parsed startup log.
        info: ``/get_server_info`` normalised (empty when not read).
        facts: :func:`resolve_facts`' facts.
        resolved: :func:`resolve_facts`' resolved values (the fraction SGLang runs).

    Returns:
        ``ranks``, ``server_info``, ``scheduler``, ``context_len``, ``page_size``, ``weight_gib``,
        ``kv_pool_gib``, ``graph_gib`` (GiB) and ``capacity_model`` (or ``capacity_model_error``).
    """
    rank = report.primary()
    memory: dict[str, Any] = {
        "ranks": {key: r.model_dump(mode="json") for key, r in report.ranks.items()},
        "server_info": {
            "weight_gib": info.weight_gib, "kvcache_gib": info.kvcache_gib, "graph_gib": info.graph_gib,
            "startup_available_gib": info.startup_available_gib,
        },
        "scheduler": report.scheduler.model_dump(mode="json") if report.scheduler else None,
    }
    memory["context_len"] = facts.get("context_len")
    memory["page_size"] = (resolved.get("page_size") or {}).get("value") or 1
    memory["weight_gib"] = (rank.weight_gib if rank else None) or info.weight_gib
    memory["kv_pool_gib"] = (rank.kv_pool_gib if rank else None) or info.kvcache_gib
    memory["graph_gib"] = (rank.graph_gib if rank else None) or info.graph_gib
    mfs = (resolved.get("mem_fraction_static") or {}).get("value")
    if mfs is not None:
        try:
            model = KVCapacityModel.from_report(report, None, float(mfs), max_total_tokens=info.max_total_tokens)
        except TunerError as err:
            memory["capacity_model_error"] = str(err)
        else:
            memory["capacity_model"] = model.model_dump(mode="json")
    return memory


def failed_record(record: TrialRecord, failure: Failure, report: LogReport | None) -> TrialRecord:
    """``record`` as a failed trial: the failure, every constraint violated, the per-rank memory lines."""
    memory = {}
    if report is not None:
        memory = {"ranks": {k: r.model_dump(mode="json") for k, r in report.ranks.items()}}
    return record.model_copy(update={
        "outcome": "failed", "failure_class": failure.failure_class, "failure_evidence": failure.evidence,
        "constraints": Constraints.all_violated(), "feasible": False, "memory": memory,
    })


def probe_only_record(record: TrialRecord, memory: dict[str, Any], capacity: int, floor: int) -> TrialRecord:
    """``record`` when the boot probe shows a capacity below ``floor``: no load was run.

    It started (``oom_or_crash`` holds) but has no SLO verdict, so it is not feasible.
    """
    return record.model_copy(update={
        "memory": {**memory, "probe_only": True},
        "skipped_reason": (
            f"probe only: context capacity {capacity} is below {floor} "
            "(the share of the best feasible capacity that can still matter); full load not run"
        ),
        "constraints": {"oom_or_crash": -1.0, "slo": 1.0, "stress": 1.0},
        "feasible": False,
        "output_throughput_tok_s": 0.0,
    })


def gpu_peak_memory(after_start_mib: float, peak_used_mib: float) -> dict[str, float]:
    """The GPU monitor's memory facts of a trial: GiB in use after startup, the peak under load,
    and their difference, the activation peak the planner sizes headroom with (§1.6); empty
    without both readings (no GPU monitor)."""
    if not (after_start_mib and peak_used_mib):
        return {}
    return {
        "gpu_used_gib_after_start": round(after_start_mib / 1024, 3),
        "gpu_peak_used_gib_under_load": round(peak_used_mib / 1024, 3),
        "peak_activation_gib": round(max(0.0, (peak_used_mib - after_start_mib) / 1024), 3),
    }


def needs_probe_only(capacity: int | None, floor: int) -> bool:
    """Whether the full load is skipped: the probe's context capacity is below the job's floor."""
    return bool(floor) and capacity is not None and capacity < floor


def stress_output_tokens(context_tokens: int) -> int:
    """Output tokens of each stress request (a quarter of the context, at most 32: enough decode
    steps that the batch is resident together)."""
    return min(_STRESS_OUTPUT_TOKENS, max(1, context_tokens // 4))


def stress_concurrency(capacity: int, budget: Any) -> int:
    """Requests of the stress phase: the context capacity, capped by ``[budget] max_concurrency``."""
    return max(1, min(capacity, budget.max_concurrency))


def slo_value(summary: LoadSummary | None) -> float:
    """The ``slo`` constraint of a measured window: the largest relative overshoot of any limit
    (``measured / limit − 1``), at least the error rate when requests errored, 1.0 when nothing
    completed or no window ran; ≤ 0 when every limit holds."""
    if summary is None:
        return 1.0
    violations = [v for v in summary.slo_violations.values() if v is not None]
    value = max(violations) if violations else -1.0
    if summary.error_rate > 0:
        value = max(value, summary.error_rate)
    if summary.completed == 0:
        value = max(value, 1.0)
    return float(value)


def assemble_record(
    record: TrialRecord,
    *,
    memory: dict[str, Any],
    summary: LoadSummary | None,
    phases: list[PhaseResult],
    stress_failed: bool,
    runtime_failure: Failure | None,
    unmeasured: str | None,
    load: Mapping[str, float] | None = None,
) -> TrialRecord:
    """The one trial logic: a started trial's phases → its record, constraints and feasibility.

    Both the real trial (:class:`TrialExecutor`) and the search benchmark's offline runner call
    it, so the benchmark measures the product's record.

    Args:
        record: The record so far (params, argv, resolved, capacities).
        memory: :func:`memory_facts`, plus what the GPU monitor measured under load.
        summary: The measured window's summary (``None`` when it did not run).
        phases: The load phases that ran (measure, stress).
        stress_failed: The stress phase failed (OOM, errors, cut).
        runtime_failure: The server died under load (classified), or ``None``.
        unmeasured: :func:`measure_gap`'s verdict (no completed request), or ``None``.
        load: The load the server ran in the measured window (``streams``: closed-loop
            concurrency; ``running_requests``: at most the effective max_running_requests;
            ``chunk_tokens``: tokens per prefill chunk), stored as ``measured_load``.

    Returns:
        The record with ``constraints`` (``oom_or_crash``, ``slo`` (:func:`slo_value`),
        ``stress``) and ``feasible`` by :class:`tuner.records.Constraints`; ``outcome="failed"``
        on a runtime failure, or with no ``slo`` value when nothing was measured.
    """
    constraints = {
        "oom_or_crash": 1.0 if runtime_failure is not None else -1.0,
        "slo": slo_value(summary),
        "stress": 1.0 if stress_failed else -1.0,
    }
    update: dict[str, Any] = {
        "memory": memory,
        "phases": phases,
        "constraints": constraints,
        "feasible": Constraints.of(constraints).feasible,
        "output_throughput_tok_s": summary.output_throughput if summary else None,
        "goodput_req_s": summary.goodput if summary else None,
        "p99_ttft_ms": summary.p99_ttft_ms if summary else None,
        "p99_itl_ms": summary.p99_itl_ms if summary else None,
        "measured_load": dict(load or {}),
    }
    if runtime_failure is not None:
        update.update(outcome="failed", failure_class=runtime_failure.failure_class,
                      failure_evidence=runtime_failure.evidence)
    elif unmeasured is not None:
        # Not an SLO verdict: nothing was measured. No throughput, no slo value (unknown).
        constraints.pop("slo")
        update.update(outcome="failed", failure_evidence=unmeasured, constraints=constraints,
                      feasible=Constraints.of(constraints).feasible,
                      output_throughput_tok_s=None, goodput_req_s=None)
    return record.model_copy(update=update)


def window_load(concurrency: int, facts: Mapping[str, Any], longest_input_tokens: int) -> dict[str, float]:
    """The load a measured window puts on the server: closed-loop ``streams``, the
    ``running_requests`` the server admits of them (effective max_running_requests) and the
    ``chunk_tokens`` of a prefill chunk (``chunked_prefill_size``; the longest prompt when
    chunking is off, §2.1)."""
    mrr = facts.get("effective_max_running_requests") or concurrency
    cps = facts.get("chunked_prefill_size")
    chunk = int(cps) if cps and int(cps) > 0 else longest_input_tokens
    return {"streams": float(concurrency), "running_requests": float(min(concurrency, int(mrr))),
            "chunk_tokens": float(chunk)}


class TrialExecutor:
    """Runs trials against one service (implements :class:`tuner.study.loop.TrialRunner`).

    Args:
        config: The validated config.
        launcher: The service's launcher, inside its :meth:`~tuner.launch.base.Launcher.session`.
        table: SGLang's flag table for the installed version.
        gpu: A :class:`tuner.gpu.GPUMonitor`, or ``None`` (then no activation peak is measured).
        work_dir: Folder for per-trial artifact files before they are uploaded.
        environment: The environment facts (see :meth:`environment`).

    .. note:: :meth:`run` restarts the production service; call it inside the launcher's session.
    """

    def __init__(
        self,
        config: TunerConfig,
        launcher: Launcher,
        table: FlagTable,
        *,
        gpu: Any | None = None,
        work_dir: Path | None = None,
        environment: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.launcher = launcher
        self.table = table
        self.gpu = gpu
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="tuner-trial-"))
        self._environment = dict(environment or {})
        self._baseline_argv = list(launcher.current_argv())
        self._workload = build_workload(config.workload, seed=config.study.seed)
        self._pinned_now_bytes = 0  # host pools of the server the tuner started last (freed at its restart)

    # ---- the TrialRunner facts ---------------------------------------------------------------

    def environment(self) -> dict[str, Any]:
        """``sglang_version``, ``gpu_name``, ``gpu_count``, ``driver_version``, ``model``, ``gpu_total_mib``."""
        return dict(self._environment)

    def target(self) -> dict[str, Any]:
        """``launcher``, ``unit`` or ``command``, ``url``."""
        service = self.config.service
        out: dict[str, Any] = {"launcher": service.launcher, "url": service.url}
        if service.launcher == "systemd":
            out["unit"] = service.unit
        else:
            out["command"] = list(service.command or [])
        return out

    def baseline_argv(self) -> list[str]:
        """The command the service ran before the study."""
        return list(self._baseline_argv)

    def prior_cost_s(self) -> float:
        """A first trial's expected cost (:func:`tuner.study.budget.prior_trial_cost_s`)."""
        return prior_trial_cost_s(self.config)

    def host_memory(self) -> HostMemory:
        """The host's memory before a launch (:func:`tuner.launch.hostmem.read_host_memory`): the
        simulator's ``/sim/host_memory`` or ``/proc/meminfo``, and the unit's ``MemoryMax``."""
        return read_host_memory(self._baseline_argv, url=self.config.service.url,
                                unit=getattr(self.launcher, "unit", None), pinned_now_bytes=self._pinned_now_bytes)

    # ---- one trial -----------------------------------------------------------------------------

    def argv_for(self, params: Mapping[str, Any]) -> list[str]:
        """The full server command for ``params`` (see :func:`render_argv`)."""
        return render_argv(self._baseline_argv, params, self.table)

    def run(self, job: TrialJob, on_phase: Callable[..., None]) -> TrialRecord:  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
        """Run one trial; a failed server is a record with ``outcome="failed"``, never an exception.

        Args:
            job: What to run.
            on_phase: Called with each phase name as it starts.

        Returns:
            The record, with objectives, constraints and artifact files (``artifacts`` maps a name
            to a local file; :func:`tuner.study.loop.run_study` uploads them and stores the ids).

        Raises:
            KeyboardInterrupt: Ctrl-C / SIGTERM (the caller records the trial as far as it got).
            ServiceControlError: The launcher could not change the service (e.g. its drop-in
                folder became read-only); nothing was stopped, and the run must stop.
        """
        begun = time.monotonic()
        trial_dir = self.work_dir / f"trial-{job.number}"
        trial_dir.mkdir(parents=True, exist_ok=True)
        asked = dict(job.params)
        explicit = parse_argv(self._baseline_argv, self.table) if job.kind == "baseline" else {}
        record = TrialRecord(
            params=asked or {k: explicit[k] for k in SEARCHED_FIELDS if explicit.get(k) is not None},
            kind=job.kind,  # type: ignore[arg-type]
            prediction=dict(job.prediction),
            context_tokens=job.context_tokens,
            started_at=job.started_at or None,
            repeat_of=job.repeat_of,
        )

        on_phase("render")
        reasons = validate(asked, self.table) if asked else []
        try:
            argv = self.argv_for(asked)
        except TunerError as err:
            reasons.append(str(err))
            argv = []
        if reasons:
            return self._failed(
                record, Failure(failure_class=FailureClass.INVALID_ARGUMENTS, evidence="; ".join(reasons)),
                None, begun, trial_dir,
            ).model_copy(update={"argv": argv})
        record = record.model_copy(update={"argv": argv})

        on_phase("start")
        try:
            self.launcher.start(argv)
            with _StartupLines(self.launcher, lambda d: on_phase("start", d)):
                state = self.launcher.wait(timeout_s=self.config.service.start_timeout_s)
        except ServiceControlError:
            raise  # the host refused the change (read-only drop-in folder): not a server crash
        except (LaunchError, ServerError) as err:
            return self._failed(
                record, Failure(failure_class=FailureClass.CRASH, evidence=str(err)), None, begun, trial_dir
            )
        lines = self.launcher.logs()
        report = parse_log(lines)
        if state.phase != LaunchPhase.READY:
            failure = state.failure or report.failure or Failure(
                failure_class=FailureClass.CRASH, evidence=f"server {state.phase.value} before ready"
            )
            failure = host_pool_kill(failure, lines) or failure
            return self._failed(record, failure, report, begun, trial_dir, lines=lines)

        on_phase("probe")
        try:
            info = SGLangClient(self.config.service.url, timeout_s=10.0).server_info()
        except ServerError as err:
            return self._failed(
                record, Failure(failure_class=FailureClass.CRASH, evidence=str(err)), report, begun, trial_dir,
                lines=lines,
            )
        after_start = self._gpu_used_mib()
        resolved, facts = resolve_facts(report, info, argv, self.table, self._context_tokens())
        if job.kind == "baseline":
            record = record.model_copy(update={"params": facts["params"]})
        capacity = facts["context_capacity"]
        record = record.model_copy(
            update={
                "resolved": resolved,
                "token_capacity": facts["max_total_num_tokens"],
                "context_capacity": capacity,
                "free_gib_after_graphs": facts["free_gib_after_graphs"],
            }
        )
        (trial_dir / "server_info.json").write_text(json.dumps(info.raw, indent=2, default=str))
        memory = memory_facts(report, info, facts, resolved)

        if needs_probe_only(capacity, job.capacity_floor):
            record = probe_only_record(record, memory, capacity or 0, job.capacity_floor)
            return self._finish(record, report, lines, begun, trial_dir, None)

        phases: list[PhaseResult] = []
        runtime_failure: Failure | None = None
        peak_used = after_start
        measure: LoadResult | None = None
        slo = self.config.slo

        on_phase("measure")
        concurrency = load_concurrency(
            self.config.budget, capacity=capacity, max_running_requests=facts.get("effective_max_running_requests"),
            max_total_num_tokens=facts.get("max_total_num_tokens"),
            mean_request_tokens=self._workload.mean_request_tokens,
        )
        counters_before = self._counters()
        budget = self.config.budget
        measure_ticks = _load_ticks(
            on_phase, "measure", expected=budget.max_requests or (concurrency if budget.request_rate is None else None),
            duration_s=budget.warmup_s + budget.measure_s,
            stop=(lambda s: slo_clearly_lost(s, slo)) if budget.early_stop else None,
        )
        with self._window() as window:
            try:
                measure = run_load_sync(
                    self.config.service.url, self._workload, concurrency=concurrency,
                    rate=self.config.budget.request_rate, warmup_s=self.config.budget.warmup_s,
                    duration_s=self.config.budget.measure_s, max_requests=self.config.budget.max_requests,
                    slo=slo,
                    on_tick=measure_ticks,
                    timeout_s=self.config.budget.warmup_s + 4 * self.config.budget.measure_s + 120.0,
                    request_timeout_s=max(60.0, 4 * self.config.budget.measure_s),
                    seed=self.config.study.seed,
                )
            except LoadError as err:
                runtime_failure = self._runtime_failure() or Failure(
                    failure_class=FailureClass.CRASH, evidence=f"load could not run: {err}"
                )
            peak_used = max(peak_used, self._window_peak(window))
        cache = self._cache(report, argv, measure.summary if measure is not None else None,
                            counters_before, self._counters() if counters_before is not None else None)
        if measure is not None:
            phase = measure.phase_result("measure")
            if measure.stopped_early:
                phase = phase.model_copy(update={"stop_reason": "SLO clearly lost (early stop)"})
            phases.append(phase)
            (trial_dir / "requests-measure.json").write_text(
                json.dumps({"result": measure.to_json_dict(),
                            "requests": [r.model_dump(mode="json") for r in measure.records]}, default=str)
            )
        runtime_failure = runtime_failure or self._runtime_failure()
        unmeasured = measure_gap(measure, self.config.budget.measure_s) if runtime_failure is None else None

        stress_failed = False
        if runtime_failure is None and self.config.budget.stress_s > 0 and capacity:
            on_phase("stress")
            stress, stress_failure, stress_peak = self._stress(capacity, facts, job, on_phase)
            peak_used = max(peak_used, stress_peak)
            if stress is not None:
                phases.append(stress.phase_result("stress"))
                stress_failed = stress.summary.errored > 0 or stress.partial
            if stress_failure is not None:
                runtime_failure = stress_failure
                stress_failed = True

        on_phase("record")
        if facts["free_gib_after_graphs"] is not None:
            memory.update(gpu_peak_memory(after_start, peak_used))
        report_after = parse_log(self.launcher.logs())
        memory["retractions"] = len(report_after.retractions)
        record = assemble_record(
            record, memory=memory, summary=measure.summary if measure is not None else None, phases=phases,
            stress_failed=stress_failed, runtime_failure=runtime_failure, unmeasured=unmeasured,
            load=window_load(concurrency, facts, self._workload_longest_input()),
        )
        record = record.model_copy(update={"cache": cache})
        return self._finish(record, report_after, self.launcher.logs(), begun, trial_dir, measure)

    # ---- pieces ------------------------------------------------------------------------------

    def _counters(self) -> dict[str, float] | None:
        """A ``/metrics`` scrape (§5.5), or None without ``--enable-metrics``."""
        try:
            return SGLangClient(self.config.service.url, timeout_s=5.0).metrics()
        except ServerError:
            return None

    def _cache(self, report: LogReport, argv: list[str], summary: Any, before: dict[str, float] | None,
               after: dict[str, float] | None) -> dict[str, Any]:
        """The prefix cache's tiers for the record: hit rates by tier and the host pool pinned (§7).

        Hit rates come from ``cached_tokens_details`` per request (0.5.10+), else from ``/metrics``
        counter deltas over the load phase (:func:`tuner.load.metrics.tier_hits_from_metrics`).
        The host pool is the log's ``Allocating ... host memory`` per rank × the ranks that logged it.
        """
        out: dict[str, Any] = {}
        if summary is not None and summary.cache_hit_rate is not None:
            out["hit_rate"] = summary.cache_hit_rate
        if summary is not None and summary.host_hit_rate is not None:
            out.update(device_hit_rate=summary.device_hit_rate, host_hit_rate=summary.host_hit_rate,
                       hit_rate_source="cached_tokens_details")
            if summary.storage_hit_rate is not None:
                out["storage_hit_rate"] = summary.storage_hit_rate
        elif before is not None and after is not None:
            tiers = tier_hits_from_metrics(before, after)
            if tiers is not None:
                out.update(hit_rate=out.get("hit_rate", tiers["cache_hit_rate"]),
                           device_hit_rate=tiers["device_hit_rate"], host_hit_rate=tiers["host_hit_rate"],
                           hit_rate_source="/metrics")
                if parse_argv(argv, self.table).get("hicache_storage_backend"):
                    out["storage_hit_rate"] = tiers["storage_hit_rate"]
        self._pinned_now_bytes = 0
        if report.host_pool_gb is not None:
            ranks = len(report.host_pool_ranks) or ranks_of(argv)
            out.update(host_pool_gb_per_rank=report.host_pool_gb, host_pool_ranks=ranks,
                       host_pool_gb=round(report.host_pool_gb * ranks, 3))
            if report.host_pool_tokens is not None:
                out["host_pool_tokens_per_rank"] = report.host_pool_tokens
            self._pinned_now_bytes = int(report.host_pool_gb * 1e9 * ranks)
        return out

    def _context_tokens(self) -> int:
        return self.config.objective.context_tokens or self._workload.context_tokens

    def _workload_longest_input(self) -> int:
        return int(getattr(self.config.workload, "input_len", 0) or self._workload.context_tokens)

    def _stress(self, capacity: int, facts: Mapping[str, Any], job: TrialJob,
                on_phase: Callable[..., None] | None = None) -> tuple[LoadResult | None, Failure | None, float]:
        """Longest contexts at the highest admitted concurrency, for ``stress_s`` seconds."""
        budget = self.config.budget
        n = stress_concurrency(capacity, budget)
        ticks = _load_ticks(on_phase, "stress", expected=n, duration_s=budget.stress_s) if on_phase else None
        output = stress_output_tokens(job.context_tokens)
        workload = capacity_probe(n, job.context_tokens, output_len=output, seed=self.config.study.seed + job.number)
        result = None
        peak = 0.0
        with self._window() as window:
            try:
                result = run_load_sync(
                    self.config.service.url, workload, concurrency=n, duration_s=budget.stress_s, on_tick=ticks,
                    timeout_s=budget.stress_s * 4 + 120.0, request_timeout_s=max(60.0, budget.stress_s * 4),
                    seed=self.config.study.seed,
                )
            except LoadError as err:
                failure = self._runtime_failure() or Failure(
                    failure_class=FailureClass.CRASH, evidence=f"stress load could not run: {err}"
                )
                return None, failure, self._window_peak(window)
            peak = self._window_peak(window)
        return result, self._runtime_failure(), peak

    def _runtime_failure(self) -> Failure | None:
        state = self.launcher.state()
        if state.phase in (LaunchPhase.FAILED, LaunchPhase.EXITED):
            failure = state.failure or parse_log(self.launcher.logs()).failure
            return failure or Failure(failure_class=FailureClass.CRASH, evidence=f"server {state.phase.value} under load")
        return None

    def _gpu_used_mib(self) -> float:
        if self.gpu is None:
            return 0.0
        try:
            return max((g.used_mib for g in self.gpu.snapshot()), default=0.0)
        except TunerError:
            return 0.0

    def _window(self) -> Any:
        if self.gpu is None:
            import contextlib

            return contextlib.nullcontext(None)
        return self.gpu.window()

    @staticmethod
    def _window_peak(window: Any) -> float:
        if window is None:
            return 0.0
        return max((p.peak_used_mib for p in window.peaks), default=0.0)

    def _failed(
        self,
        record: TrialRecord,
        failure: Failure,
        report: LogReport | None,
        begun: float,
        trial_dir: Path,
        *,
        lines: list[str] | None = None,
    ) -> TrialRecord:
        return self._finish(failed_record(record, failure, report), report, lines or [], begun, trial_dir, None)

    def _finish(
        self,
        record: TrialRecord,
        report: LogReport | None,
        lines: list[str],
        begun: float,
        trial_dir: Path,
        measure: LoadResult | None,
    ) -> TrialRecord:
        artifacts = {}
        if lines:
            path = trial_dir / "server.log"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            artifacts["server_log"] = str(path)
        for name, file in (("server_info", "server_info.json"), ("requests", "requests-measure.json")):
            if (trial_dir / file).exists():
                artifacts[name] = str(trial_dir / file)
        excerpt = _excerpt(lines, record.failure_evidence)
        return record.model_copy(
            update={"artifacts": artifacts, "log_excerpt": excerpt, "duration_s": time.monotonic() - begun}
        )


def host_pool_kill(failure: Failure, lines: list[str]) -> Failure | None:
    """A start killed while pinning HiCache host pools, with no exception after them: the kernel's
    OOM killer (the unit's ``MemoryMax`` or the host's RAM; SGLang's own check reads only the host's
    available memory, §7) — a host-memory failure, monotone in the pool's size like SGLang's own
    ``Not enough host memory`` error. None when the log says otherwise."""
    if failure.failure_class not in (FailureClass.CRASH, FailureClass.STARTUP_TIMEOUT):
        return None
    last = max((i for i, line in enumerate(lines) if "host memory for hierarchical KV cache" in line
                or "hierarchical KV host pool" in line), default=None)
    if last is None or any("Traceback" in x or "Error" in x or "exception" in x for x in lines[last + 1:]):
        return None
    return Failure(failure_class=FailureClass.HOST_MEMORY, exit_status=failure.exit_status, rank=failure.rank,
                   evidence=f"killed while pinning the hierarchical cache's host pools (last line: "
                            f"{lines[last].strip()[-160:]}); pinned host memory beyond the unit's MemoryMax "
                            "or the host's RAM is OOM-killed")


def _load_ticks(on_phase: Callable[..., None], phase: str, *, expected: int | None, duration_s: float | None,
                stop: Callable[[LiveStats], bool] | None = None) -> Callable[[LiveStats], bool | None]:
    """An ``on_tick`` for :func:`tuner.load.run_load_sync` that reports the phase's requests done
    (ok or errored, warm-up included) against ``expected``, then asks ``stop`` (early stop)."""

    def tick(stats: LiveStats) -> bool | None:
        on_phase(phase, PhaseProgress(requests_done=stats.completed + stats.errored, requests_expected=expected,
                                      elapsed_s=round(stats.elapsed_s, 1), duration_s=duration_s))
        return stop(stats) if stop is not None else None

    return tick


class _StartupLines:
    """While a server starts, report each new SGLang line of its log (a reader thread on
    :meth:`Launcher.logs`, which the launcher's own wait keeps filling): the startup's progress
    is the last phase line (``Load weight end``, ``KV Cache is allocated``, ``Capture cuda graph``).

    Args:
        launcher: The launcher whose :meth:`~Launcher.wait` runs meanwhile.
        report: Called with a :class:`PhaseProgress` per new SGLang line (from the reader thread).
        poll_s: How often the log is read, seconds.
    """

    def __init__(self, launcher: Launcher, report: Callable[[PhaseProgress], None], poll_s: float = 0.25) -> None:
        self._launcher, self._report, self._poll_s = launcher, report, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tuner-startup-lines", daemon=True)
        self._begun = time.monotonic()

    def __enter__(self) -> _StartupLines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _watch(self) -> None:
        watcher, seen, last = LogWatcher(), 0, None
        while not self._stop.wait(self._poll_s):
            lines = self._launcher.logs()
            watcher.feed_many(lines[seen:])
            seen = len(lines)
            if watcher.last_line and watcher.last_line != last:
                last = watcher.last_line
                try:
                    self._report(PhaseProgress(line=last[:200], stage=watcher.phase,
                                               elapsed_s=round(time.monotonic() - self._begun, 1)))
                except Exception as err:  # noqa: BLE001 - a progress display must never end a trial
                    _log.debug("startup progress not shown: %s", err)


def _excerpt(lines: list[str], evidence: str | None, *, limit: int = 20) -> list[str]:
    """The memory lines of the log (and the failure evidence), at most ``limit`` lines."""
    keys = ("avail mem", "KV Cache", "max_total_num_tokens", "Capture", "Not enough memory", "out of memory",
            "Retract", "fired up", "Scheduler hit an exception", "Error")
    picked = [line for line in lines if any(k in line for k in keys)]
    if evidence and not any(evidence in line for line in picked):
        picked.append(evidence)
    return [line[:400] for line in picked[-limit:]]
