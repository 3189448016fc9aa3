"""One trial, end to end: :class:`TrialExecutor` runs one candidate on the server it is handed.

The ordered phases of a trial (one list, like SGLang's own pipeline), one method each::

    render   candidate knobs → argv for the detected SGLang version (replace only the tuned flags)
    start    restart the server with that argv; wait until ready, or a classified failure
    probe    memory report: startup log lines + /get_server_info + the GPU monitor (§4.2, §5.2)
             → token capacity, context capacity, headroom after graphs
    measure  warm-up and measured window of the configured workload (early stop when the SLO is
             clearly lost); skipped when the probe shows the candidate cannot matter
    stress   the OOM stress: every longest context the config admits sent at once (a runtime OOM
             here makes the config infeasible), judged by the SLO as the *burst admission*; then
             the SLO-safe capacity: steady windows of closed-loop sessions started over a ramp
             (:mod:`tuner.load.steady`), bracketed down from the OOM-safe capacity
    quality  a candidate whose numerics differ from the baseline's answers a fixed prompt set
             greedily, compared with the baseline's answers (:mod:`tuner.load.quality`; one probe per
             distinct numerics per study); the first start of the baseline's numerics records them
    record   objectives, constraints, record, artifacts (server log, per-request results, server info)

What a trial needs from a server is :class:`ServerUnderTest`, defined here by its one consumer:
:class:`tuner.served.LaunchedServer` implements it with a launcher, the HTTP load generator and the
GPU monitor; the tests' offline server (``tests/support/offline_server.py``) with the simulator's
offline evaluation. This module never imports :mod:`tuner.launch`.

Nothing here decides which config to try (:mod:`tuner.study.decide`), tells Optuna (:mod:`tuner.study.loop`) or
chooses the server, flag table and GPU monitor (:mod:`tuner.entrypoints`, the composition root).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import tuner.knobs
from tuner.config import BudgetSection, TunerConfig
from tuner.errors import LoadError, ServerError, TunerError
from tuner.load import SLO, LiveStats, LoadResult, Workload, build_workload, capacity_probe
from tuner.load.metrics import LoadSummary, tier_hits_from_metrics
from tuner.load.quality import ProbeAnswers, gate, probe_digest, quality_constraint, read_tasks, run_probe
from tuner.load.search import bracket_level, context_slo, judge_contexts, slo_capacity
from tuner.load.steady import session_workload
from tuner.records import (
    CacheFacts,
    Constraints,
    MeasuredLoad,
    MemoryFacts,
    PhaseResult,
    QualityFacts,
    SloCapacity,
    SloStep,
    TrialRecord,
    context_capacity,
)
from tuner.sglang.client import GreedyAnswer, ServerInfo
from tuner.sglang.failures import Failure, FailureClass
from tuner.sglang.flags import FlagTable, parse_argv, replace_flags, validate
from tuner.sglang.hicache import HostMemory
from tuner.sglang.ladder import per_request_max_tokens
from tuner.sglang.logs import LogReport, log_error_line, parse_log
from tuner.sglang.memory import KVCapacityModel
from tuner.sglang.numerics import numerics_changes, numerics_key
from tuner.sglang.speculative import DRAFT_ALGORITHMS, DraftMemory, SpecShape, auto_shape, resolve_shape
from tuner.study.budget import load_concurrency
from tuner.study.hostcheck import ranks_of
from tuner.study.job import PhaseProgress, TrialJob
from tuner.study.launch import launch_changes, render_levers
from tuner.study.space import SEARCHED_FIELDS, SPEC_SHAPE_KNOBS

__all__ = [
    "ServerUnderTest",
    "StartOutcome",
    "LoadPlan",
    "LoadOutcome",
    "TrialExecutor",
    "render_argv",
    "without_neutral_levers",
    "host_pool_kill",
    "host_pools",
    "slo_clearly_lost",
    "measure_gap",
    "resolve_facts",
    "memory_facts",
    "quote_server_log",
]

_STRESS_OUTPUT_TOKENS = 32
"""Output tokens of each stress request: enough decode steps that the batch is resident together."""


# ---- the seam: what a trial needs from a server ----------------------------------------------------


@dataclass(frozen=True)
class StartOutcome:
    """What a start came to: ready, or a classified failure.

    Attributes:
        failure: ``None`` when the server is ready to serve; else why it is not (the server's own
            classification: its exit, its log's failure line, a timeout).
        log_lines: Every server log line since the start, oldest first (empty when the start
            could not even be issued).
    """

    failure: Failure | None
    log_lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LoadPlan:
    """One load phase as the trial asks for it (the measured window, or the stress load).

    Attributes:
        name: ``measure``, ``stress`` (the burst) or ``steady`` (a steady window of sessions).
        workload: What to send (the configured workload, a capacity probe for ``stress``, the
            sessions' requests for ``steady``: :func:`tuner.load.steady.session_workload`).
        concurrency: Closed-loop streams, or the in-flight cap of an open loop.
        duration_s: Length of the measured window, seconds (after the warm-up).
        seed: Seed of the arrival process.
        timeout_s: Limit for the whole phase, seconds (then the result is ``partial``).
        request_timeout_s: Limit per request, send to end of stream, seconds.
        warmup_s: Seconds of load before the window, excluded from the summary.
        rate: Mean arrival rate, requests/s (open loop), or ``None`` (closed loop).
        max_requests: Measured requests to send at most, or ``None``.
        slo: The limits the summary's goodput and violations are judged by, or ``None``.
        ramp_s: Closed-loop streams start staggered over this many seconds, inside ``warmup_s``
            (:func:`tuner.load.run_load`'s ``ramp_s``); 0: together.
        cooldown_s: Seconds the streams keep sending, unmeasured, after the window while its
            measured requests finish (a steady window: :meth:`tuner.load.steady.SteadyWindow.cooldown_s`).
    """

    name: str
    workload: Workload
    concurrency: int
    duration_s: float
    seed: int
    timeout_s: float
    request_timeout_s: float
    warmup_s: float = 0.0
    rate: float | None = None
    max_requests: int | None = None
    slo: SLO | None = None
    ramp_s: float = 0.0
    cooldown_s: float = 0.0


@dataclass(frozen=True)
class LoadOutcome:
    """What one load phase came to.

    Attributes:
        result: The load's result (summary, per-request records if any, stop facts); ``None``
            when the load could not run at all (then ``load_error`` says why).
        failure: The server's death during the phase, classified (runtime OOM, crash), or ``None``
            while it still serves.
        load_error: Why the load could not run (the load generator's one line), or ``None``.
        peak_gpu_used_mib: The highest GPU memory in use during the phase, MiB (the most loaded
            GPU); 0.0 without a GPU monitor.
    """

    result: LoadResult | None
    failure: Failure | None = None
    load_error: str | None = None
    peak_gpu_used_mib: float = 0.0


class ServerUnderTest(Protocol):
    """What one trial needs from the server it tunes: start it with a command line, read what it
    resolved, load it, watch its memory; and the facts the study asks for before any trial.

    Implementations: :class:`tuner.served.LaunchedServer` (the service, restarted by a launcher,
    loaded over HTTP) and, in the tests, the simulator's offline evaluation. :class:`TrialExecutor`
    drives it; nothing else does.

    .. note:: :meth:`start` restarts the production service (inside the launcher's session).
    """

    def environment(self) -> dict[str, Any]:
        """``sglang_version``, ``gpu_name``, ``gpu_count``, ``driver_version``, ``model``, and
        ``gpu_total_mib`` (MiB) when known: what a study refuses to mix."""
        ...

    def target(self) -> dict[str, Any]:
        """``launcher``, ``unit`` or ``command``, ``url``: what the study tunes."""
        ...

    def baseline_argv(self) -> list[str]:
        """The command line the server runs before the study.

        Raises:
            LaunchError: The unit or command cannot be read.
        """
        ...

    def prior_cost_s(self) -> float:
        """A first trial's expected cost in seconds, before any history exists."""
        ...

    def host_memory(self) -> HostMemory:
        """The host's memory before the next start: what the hierarchical cache's host pools may
        pin (``MemAvailable``, the unit's ``MemoryMax``, the pools the running server frees)."""
        ...

    def start(self, argv: list[str], *, timeout_s: float,
              on_progress: Callable[[PhaseProgress], None]) -> StartOutcome:
        """Stop the running server, start it with ``argv``, and wait until it is ready or failed.

        Args:
            argv: The full server command line.
            timeout_s: How long to wait for the ready line, seconds (then a ``startup_timeout``).
            on_progress: Called with each new startup line as it arrives (may never be called).

        Returns:
            Ready, or the classified failure, with the log lines since the start.

        Raises:
            ServiceControlError: The service could not be changed (nothing was stopped); the
                study must stop.
        """
        ...

    def info(self) -> ServerInfo:
        """``/get_server_info`` of the ready server, normalised (an empty one where the server
        has none: then every value comes from the startup log).

        Raises:
            ServerError: The ready server did not answer.
        """
        ...

    def logs(self) -> list[str]:
        """Every server log line since the last :meth:`start`, oldest first."""
        ...

    def gpu_used_mib(self) -> float:
        """GPU memory in use now, MiB (the most loaded GPU); 0.0 without a GPU monitor."""
        ...

    def metrics(self) -> dict[str, float] | None:
        """A ``/metrics`` scrape (sample name → value, §5.5), or ``None`` when the server
        exports none (no ``--enable-metrics``) or does not answer."""
        ...

    def generate(self, texts: list[str], max_new_tokens: int, timeout_s: float) -> list[GreedyAnswer]:
        """Greedy answers (temperature 0) with the chosen tokens' logprobs, one per prompt: the
        quality probe (SGLang's native ``/generate`` with ``return_logprob``, §5.3).

        Raises:
            QualityError: The server returns no logprobs (the line names the fix).
            ServerError: It did not answer within ``timeout_s`` seconds.
        """
        ...

    def load(self, plan: LoadPlan, on_tick: Callable[[LiveStats], bool | None] | None) -> LoadOutcome:
        """Run one load phase on the ready server and watch it.

        Args:
            plan: What to send, how and for how long.
            on_tick: Called about once a second with the live statistics (may never be called);
                returning ``True`` stops the phase early.

        Returns:
            The result, the server's death if it died, and the GPU memory peak of the phase. A
            load that could not run is an outcome with ``load_error``, never an exception.
        """
        ...


# ---- the phases' helpers -----------------------------------------------------------------------------


def without_neutral_levers(params: Mapping[str, Any], table: FlagTable) -> dict[str, Any]:
    """``params`` less a structural lever at its no-op value (:attr:`tuner.knobs.Lever.neutral`) that
    this version has no flag for (``dcp_size`` 1 on a version without ``--dcp-size``: the space's
    baseline value; the lever screen skips the other values before a launch)."""
    out = dict(params)
    for lever in tuner.knobs.LEVERS:
        name = lever.knob.name
        if out.get(name) in (None, lever.neutral) and not table.has(lever.flag):
            out.pop(name, None)
    return out


def render_argv(baseline_argv: list[str], params: Mapping[str, Any], table: FlagTable) -> list[str]:
    """The full server command for ``params``: only the tuned flags of the baseline replaced
    (:func:`tuner.study.launch.launch_changes` says which).

    DP attention's size (``dp_size``; 1 = off) sets ``--enable-dp-attention`` with it, or removes both (§1.5b).
    A disabled hierarchical cache removes its flag and its conditional knobs (size, ratio, write
    policy, I/O backend, memory layout; §7). Speculative decoding switched off removes every
    ``--speculative-*`` flag; switched on (``True``) it keeps the baseline's algorithm and draft
    model and sets the shape the candidate names (§1.5).

    Raises:
        FlagError: A knob this SGLang version lacks, or a value outside its choices.
    """
    if not params:
        return list(baseline_argv)
    changes = launch_changes(without_neutral_levers(params, table), parse_argv(baseline_argv, table))
    return replace_flags(baseline_argv, changes, table)


def context_fits(per_request_max_tokens: int | None, longest_tokens: int) -> float:
    """The ``context_fits`` constraint (issue 23): -1.0 when the workload's longest request
    (``longest_tokens``, input + output) fits one request's ceiling (``per_request_max_tokens``,
    :func:`tuner.sglang.ladder.per_request_max_tokens`), 1.0 when it does not (SGLang would refuse
    or truncate it: one DP rank's pool is the ceiling under DP attention); -1.0 when unknown."""
    if per_request_max_tokens is None:
        return -1.0
    return -1.0 if longest_tokens <= per_request_max_tokens else 1.0


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
    # The captured decode batch sizes, where the log lists them (§2.1: `Capture cuda graph bs [...]`,
    # 0.5.23's `bs=[...]`); the planner predicts them otherwise (tuner.sglang.graphs).
    put("cuda_graph_bs", (rank.graph_bs if rank is not None and rank.graph_bs else None, "log:capture"))
    if free is None and rank is not None:
        free = put("available_gpu_mem_gib", (rank.graph_end_avail_gib, "log:capture"))
    # The baseline's knobs: what its command line sets, plus what SGLang resolved for the
    # three knobs every study searches (the others stay at SGLang's own default).
    explicit = parse_argv(argv, table)
    # Across the deployment (issue 23): DCP interleaves a request over dcp ranks (the pool SGLang
    # 0.5.23 reports is one rank's), DP attention runs dp pools of their own (§1.5b): each lever's
    # Lever.interleave / Lever.pools of the baseline's value.
    levers = [(lever, lever.base(explicit)) for lever in tuner.knobs.LEVERS]
    dcp = math.prod(lever.interleave(value) for lever, value in levers)
    dp = math.prod(lever.pools(value) for lever, value in levers)
    capacity = dp * context_capacity(mrr, tokens * dcp, context_tokens) if tokens else None
    ceiling = per_request_max_tokens(tokens * dcp, context_len) if tokens else None
    params: dict[str, Any] = {name: explicit[name] for name in SEARCHED_FIELDS if explicit.get(name) is not None}
    for lever, value in levers:  # a lever's knob the command sets for something else: plain --dp-size is not DP attention
        if lever.knob.name in params and params[lever.knob.name] != value:
            params.pop(lever.knob.name)
    for name in ("mem_fraction_static", "max_running_requests", "chunked_prefill_size"):
        if name not in params and name in resolved:
            params[name] = resolved[name]["value"]
    algorithm = info.speculative_algorithm or explicit.get("speculative_algorithm")
    if algorithm and str(algorithm).upper() in DRAFT_ALGORITHMS:
        # The draft shape SGLang resolved (§1.5): /get_server_info's, else the command's, else
        # SGLang's auto choice for the model class the weight line names; the space's first choices.
        params["speculative_algorithm"] = True
        given = [info.raw.get(name, explicit.get(name)) for name in SPEC_SHAPE_KNOBS]
        if any(v is None for v in given):
            auto = auto_shape(rank.model_class if rank is not None else None, str(algorithm))
            given = [auto[i] if v is None else v for i, v in enumerate(given)]
        shape = resolve_shape(*(int(v) for v in given if v is not None))
        params.update(zip(SPEC_SHAPE_KNOBS, shape, strict=True))
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
        "per_request_max_tokens": ceiling,
        "free_gib_after_graphs": free,
        "params": params,
    }


def memory_facts(report: LogReport, info: ServerInfo, facts: Mapping[str, Any],
                 resolved: Mapping[str, Mapping[str, Any]]) -> MemoryFacts:
    """The per-rank memory report, plus the memory model calibrated on it (§1.2, §1.6, §8).

    Args:
        report: The parsed startup log.
        info: ``/get_server_info`` normalised (empty when not read).
        facts: :func:`resolve_facts`' facts.
        resolved: :func:`resolve_facts`' resolved values (the fraction SGLang runs).

    Returns:
        The :class:`tuner.records.MemoryFacts` of the start: ranks, server info, scheduler line,
        ``context_len``, page size, weights, KV pool and graphs (GiB), and the calibrated memory
        model (or why there is none).
    """
    rank = report.primary()
    model = error = None
    mfs = (resolved.get("mem_fraction_static") or {}).get("value")
    if mfs is not None:
        try:
            model = KVCapacityModel.from_report(report, None, float(mfs), max_total_tokens=info.max_total_tokens)
        except TunerError as err:
            error = str(err)
    return MemoryFacts(
        ranks=_ranks(report),
        server_info={"weight_gib": info.weight_gib, "kvcache_gib": info.kvcache_gib, "graph_gib": info.graph_gib,
                     "startup_available_gib": info.startup_available_gib},
        scheduler=report.scheduler.model_dump(mode="json") if report.scheduler else None,
        context_len=facts.get("context_len"),
        page_size=(resolved.get("page_size") or {}).get("value") or 1,
        weight_gib=(rank.weight_gib if rank else None) or info.weight_gib,
        kv_pool_gib=(rank.kv_pool_gib if rank else None) or info.kvcache_gib,
        graph_gib=(rank.graph_gib if rank else None) or info.graph_gib,
        capacity_model=model, capacity_model_error=error,
        **_draft_fact(report, facts),
    )


def _draft_fact(report: LogReport, facts: Mapping[str, Any]) -> dict[str, Any]:
    """``{"draft": ...}``: the draft model's memory as a typed fact of the start
    (:class:`tuner.sglang.speculative.DraftMemory`), when the server runs one and its shape is known."""
    params = facts.get("params") or {}
    if not all(params.get(k) for k in SPEC_SHAPE_KNOBS):
        return {}
    dtype = params.get("speculative_draft_kv_cache_dtype") or params.get("kv_cache_dtype") or "auto"
    fact = DraftMemory.from_report(report, SpecShape(*(int(params[k]) for k in SPEC_SHAPE_KNOBS)), str(dtype))
    return {} if fact is None else {"draft": fact.model_dump(mode="json")}


def _ranks(report: LogReport) -> dict[str, dict[str, Any]]:
    """The per-rank startup lines as stored (:class:`tuner.sglang.logs.RankMemory` fields)."""
    return {key: r.model_dump(mode="json") for key, r in report.ranks.items()}


def _failed_record(record: TrialRecord, failure: Failure, report: LogReport | None) -> TrialRecord:
    """``record`` as a failed trial: the failure, every constraint violated, the per-rank memory lines."""
    memory = MemoryFacts(ranks=_ranks(report)) if report is not None else MemoryFacts()
    return record.model_copy(update={
        "outcome": "failed", "failure_class": failure.failure_class, "failure_evidence": failure.evidence,
        "constraints": Constraints.all_violated(), "memory": memory,
    })


def _probe_only_record(record: TrialRecord, memory: MemoryFacts, capacity: int, floor: int) -> TrialRecord:
    """``record`` when the boot probe shows a capacity below ``floor``: no load was run.

    It started (``oom_or_crash`` holds) but has no SLO verdict, so it is not feasible.
    """
    return record.model_copy(update={
        "memory": memory.model_copy(update={"probe_only": True}),
        "skipped_reason": (
            f"probe only: context capacity {capacity} is below {floor} "
            "(the share of the best feasible capacity that can still matter); full load not run"
        ),
        "constraints": {"oom_or_crash": -1.0, "slo": 1.0, "stress": 1.0},
        "output_throughput_tok_s": 0.0,
    })


def _gpu_peak_memory(after_start_mib: float, peak_used_mib: float) -> dict[str, float]:
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


def _needs_probe_only(capacity: int | None, floor: int) -> bool:
    """Whether the full load is skipped: the probe's context capacity is below the job's floor."""
    return bool(floor) and capacity is not None and capacity < floor


_STEP_SEED = 1_000_003
"""Seed stride between a trial's stress load and its bracketing steps (distinct prompts each)."""


def _stress_output_tokens(context_tokens: int) -> int:
    """Output tokens of each stress request (a quarter of the context, at most 32: enough decode
    steps that the batch is resident together)."""
    return min(_STRESS_OUTPUT_TOKENS, max(1, context_tokens // 4))


def _stress_concurrency(capacity: int, budget: BudgetSection) -> int:
    """Requests of the stress phase: the context capacity, capped by ``[budget] max_concurrency``."""
    return max(1, min(capacity, budget.max_concurrency))


def _slo_value(summary: LoadSummary | None) -> float:
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


def _assemble_record(
    record: TrialRecord,
    *,
    memory: MemoryFacts,
    summary: LoadSummary | None,
    phases: list[PhaseResult],
    stress_failed: bool,
    runtime_failure: Failure | None,
    unmeasured: str | None,
    load: MeasuredLoad | None = None,
) -> TrialRecord:
    """A started trial's phases → its record, constraints and feasibility (the record phase).

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
        The record with ``constraints`` (``oom_or_crash``, ``slo`` (:func:`_slo_value`),
        ``stress``) and ``feasible`` by :class:`tuner.records.Constraints`; ``outcome="failed"``
        on a runtime failure, or with no ``slo`` value when nothing was measured.
    """
    constraints = {
        "oom_or_crash": 1.0 if runtime_failure is not None else -1.0,
        "slo": _slo_value(summary),
        "stress": 1.0 if stress_failed else -1.0,
    }
    update: dict[str, Any] = {
        "memory": memory,
        "phases": phases,
        "constraints": constraints,
        "output_throughput_tok_s": summary.output_throughput if summary else None,
        "goodput_req_s": summary.goodput if summary else None,
        "p99_ttft_ms": summary.p99_ttft_ms if summary else None,
        "p99_itl_ms": summary.p99_itl_ms if summary else None,
        "itl_exceedance": summary.itl_exceedance if summary else None,
        "itl_exceedance_low": summary.itl_exceedance_low if summary else None,
        "measured_load": load or MeasuredLoad(),
    }
    if runtime_failure is not None:
        update.update(outcome="failed", failure_class=runtime_failure.failure_class,
                      failure_evidence=runtime_failure.evidence)
    elif unmeasured is not None:
        # Not an SLO verdict: nothing was measured. No throughput, no slo value (unknown).
        constraints.pop("slo")
        update.update(outcome="failed", failure_evidence=unmeasured, constraints=constraints,
                      output_throughput_tok_s=None, goodput_req_s=None)
    return record.model_copy(update=update)


def _window_load(concurrency: int, facts: Mapping[str, Any], longest_input_tokens: int) -> MeasuredLoad:
    """The load a measured window puts on the server: closed-loop ``streams``, the
    ``running_requests`` the server admits of them (effective max_running_requests) and the
    ``chunk_tokens`` of a prefill chunk (``chunked_prefill_size``; the longest prompt when
    chunking is off, §2.1)."""
    mrr = facts.get("effective_max_running_requests") or concurrency
    cps = facts.get("chunked_prefill_size")
    chunk = int(cps) if cps and int(cps) > 0 else longest_input_tokens
    return MeasuredLoad(streams=float(concurrency), running_requests=float(min(concurrency, int(mrr))),
                        chunk_tokens=float(chunk))


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


def host_pools(report: LogReport, argv: list[str]) -> tuple[float, int] | None:
    """The hierarchical cache's host pools a started server pinned (§7): ``(GB per rank, ranks)``.

    Each rank allocates its own pool; the log's ``Allocating ... host memory`` line gives its size
    in decimal GB, the ranks that logged one give their count (else the command's tp × pp).

    Args:
        report: The parsed startup log.
        argv: The launched command line.

    Returns:
        ``(GB per rank, ranks)``, or ``None`` when the log shows no host pool.
    """
    if report.host_pool_gb is None:
        return None
    return report.host_pool_gb, len(report.host_pool_ranks) or ranks_of(argv)


# ---- one trial ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Started:
    """The start phase: the server's classified failure (``None``: ready), its log lines and their report."""

    failure: Failure | None
    lines: list[str]
    report: LogReport


@dataclass(frozen=True)
class _Probe:
    """The probe phase: what SGLang resolved (:func:`resolve_facts`), the memory report
    (:func:`memory_facts`) and the GPU memory in use after the start (MiB)."""

    resolved: dict[str, dict[str, Any]]
    facts: dict[str, Any]
    memory: MemoryFacts
    after_start_mib: float

    @property
    def capacity(self) -> int | None:
        """The context capacity at the job's context length."""
        return self.facts["context_capacity"]


@dataclass(frozen=True)
class _Measured:
    """The measure phase: its load outcome, the concurrency it ran at, the prefix cache's facts and
    the verdicts the record needs (the server's death under load; why nothing was measured)."""

    outcome: LoadOutcome
    concurrency: int
    cache: CacheFacts
    failure: Failure | None
    unmeasured: str | None


@dataclass(frozen=True)
class _Stressed:
    """The stress phase (``outcome`` ``None`` when it was not run): its outcome, failure and verdict."""

    outcome: LoadOutcome | None = None
    failure: Failure | None = None
    failed: bool = False
    slo_capacity: SloCapacity | None = None


class _TrialFiles:
    """One trial's artifact files (``folder`` ``None``: the trial keeps none).

    Args:
        folder: The trial's folder (created), or ``None``.
    """

    _NAMES = {"server_log": "server.log", "server_info": "server_info.json", "requests": "requests-measure.json"}

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, text: str) -> None:
        """Write artifact ``name`` (one of :attr:`_NAMES`) when the trial keeps files."""
        if self.folder is not None:
            (self.folder / self._NAMES[name]).write_text(text, encoding="utf-8")

    def paths(self) -> dict[str, str]:
        """Artifact name → local file, for those written."""
        if self.folder is None:
            return {}
        return {name: str(self.folder / file) for name, file in self._NAMES.items() if (self.folder / file).exists()}


class TrialExecutor:
    """Runs trials on one server (implements :class:`tuner.study.loop.TrialRunner`).

    Args:
        config: The validated config.
        server: The server under test (:class:`tuner.served.LaunchedServer` in production).
        table: SGLang's flag table for the installed version.
        work_dir: Folder for per-trial artifact files before they are uploaded; ``None`` keeps
            no files (records then carry no ``artifacts``).
        workload: The workload of the measured windows (default: the config's, drawn with the
            study's seed).
        clock: Seconds of a monotonic clock (a trial's ``duration_s`` is the difference).

    .. note:: :meth:`run` restarts the production service; call it inside the launcher's session.
    """

    def __init__(
        self,
        config: TunerConfig,
        server: ServerUnderTest,
        table: FlagTable,
        *,
        work_dir: Path | None = None,
        workload: Workload | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.server = server
        self.table = table
        self.work_dir = work_dir
        self._baseline_argv = list(server.baseline_argv())
        self._workload = workload or build_workload(config.workload, seed=config.study.seed)
        self._clock = clock
        quality = config.quality
        self._tasks = read_tasks(quality.tasks) if quality.enabled and quality.tasks else []

    # ---- the TrialRunner facts (the server's) ------------------------------------------------------

    def environment(self) -> dict[str, Any]:
        """``sglang_version``, ``gpu_name``, ``gpu_count``, ``driver_version``, ``model``, ``gpu_total_mib``."""
        return self.server.environment()

    def target(self) -> dict[str, Any]:
        """``launcher``, ``unit`` or ``command``, ``url``."""
        return self.server.target()

    def baseline_argv(self) -> list[str]:
        """The command the service ran before the study."""
        return list(self._baseline_argv)

    def prior_cost_s(self) -> float:
        """A first trial's expected cost, seconds."""
        return self.server.prior_cost_s()

    def host_memory(self) -> HostMemory:
        """The host's memory before a launch (:meth:`ServerUnderTest.host_memory`)."""
        return self.server.host_memory()

    def argv_for(self, params: Mapping[str, Any]) -> list[str]:
        """The full server command for ``params`` (see :func:`render_argv`).

        Raises:
            FlagError: A knob this SGLang version lacks, or a value outside its choices.
        """
        return render_argv(self._baseline_argv, params, self.table)

    # ---- one trial: the ordered phases --------------------------------------------------------------

    def run(self, job: TrialJob, on_phase: Callable[..., None]) -> TrialRecord:
        """Run one trial; a failed server is a record with ``outcome="failed"``, never an exception.

        Args:
            job: What to run.
            on_phase: Called with each phase name as it starts, and with ``(name,
                PhaseProgress)`` as a long phase advances.

        Returns:
            The record, with objectives, constraints and artifact files (``artifacts`` maps a name
            to a local file; :func:`tuner.study.loop.run_study` uploads them and stores the ids).

        Raises:
            KeyboardInterrupt: Ctrl-C / SIGTERM (the caller records the trial as far as it got).
            ServiceControlError: The service could not be changed (e.g. its drop-in folder became
                read-only); nothing was stopped, and the run must stop.
        """
        begun_s = self._clock()
        files = _TrialFiles(self.work_dir / f"trial-{job.number}" if self.work_dir is not None else None)
        record = self._asked(job)
        on_phase("render")
        argv, invalid = self._render(job)
        record = record.model_copy(update={"argv": argv})
        if invalid is not None:
            return self._finish(_failed_record(record, invalid, None), [], begun_s, files)
        on_phase("start")
        started = self._start(argv, on_phase)
        if started.failure is not None:
            report = started.report if started.lines else None
            return self._finish(_failed_record(record, started.failure, report), started.lines, begun_s, files)
        on_phase("probe")
        probe = self._probe(job, argv, started, files)
        if isinstance(probe, Failure):
            return self._finish(_failed_record(record, probe, started.report), started.lines, begun_s, files)
        record = _probed_record(record, probe, job)
        if _needs_probe_only(probe.capacity, job.capacity_floor):
            record = _probe_only_record(record, probe.memory, probe.capacity or 0, job.capacity_floor)
            return self._finish(record, started.lines, begun_s, files)
        on_phase("measure")
        measured = self._measure(argv, started, probe, on_phase, files)
        stressed = self._stress(job, probe, measured, on_phase)
        rank = started.report.primary()
        quality = self._quality(job, argv, alive=measured.failure is None and stressed.failure is None, on_phase=on_phase,
                                model_class=rank.model_class if rank is not None else None)
        on_phase("record")
        lines = self.server.logs()
        record = self._record(record, probe, measured, stressed, lines)
        record = record.model_copy(update={"quality": quality, "constraints": {
            **record.constraints, "quality": quality_constraint(quality, self.config.quality),
            "context_fits": context_fits(record.per_request_max_tokens, self._workload.context_tokens)}})
        return self._finish(record, lines, begun_s, files)

    def _asked(self, job: TrialJob) -> TrialRecord:
        """The record of what ``job`` asks (the baseline: the searched knobs its command sets)."""
        explicit = parse_argv(self._baseline_argv, self.table) if job.kind == "baseline" else {}
        return TrialRecord(
            params=dict(job.params) or {k: explicit[k] for k in SEARCHED_FIELDS if explicit.get(k) is not None},
            kind=job.kind,  # type: ignore[arg-type]
            prediction=job.prediction,
            context_tokens=job.context_tokens,
            started_at=job.started_at or None,
            repeat_of=job.repeat_of,
        )

    def _render(self, job: TrialJob) -> tuple[list[str], Failure | None]:
        """Render: the command line for the job's knobs, or why SGLang would reject them (no start)."""
        asked = without_neutral_levers(job.params, self.table)
        # The speculative switch is the tuner's (on: the baseline's algorithm), not a flag value.
        # A structural lever's knob is checked as the flags it launches (tuner.knobs: dp_size → --enable-dp-attention).
        checked = {k: v for k, v in render_levers(asked).items() if not (k == "speculative_algorithm" and isinstance(v, bool))}
        reasons = validate(checked, self.table) if checked else []
        try:
            argv = self.argv_for(asked)
        except TunerError as err:
            reasons.append(str(err))
            argv = []
        if reasons:
            return argv, Failure(failure_class=FailureClass.INVALID_ARGUMENTS, evidence="; ".join(reasons))
        return argv, None

    def _start(self, argv: list[str], on_phase: Callable[..., None]) -> _Started:
        """Start: restart the server with ``argv``; a start killed while pinning the hierarchical
        cache's host pools is a host-memory failure (:func:`host_pool_kill`).

        Raises:
            ServiceControlError: The service could not be changed.
        """
        outcome = self.server.start(argv, timeout_s=self.config.service.start_timeout_s,
                                    on_progress=lambda detail: on_phase("start", detail))
        lines = list(outcome.log_lines)
        failure = outcome.failure
        if failure is not None:
            failure = host_pool_kill(failure, lines) or failure
        return _Started(failure=failure, lines=lines, report=parse_log(lines))

    def _probe(self, job: TrialJob, argv: list[str], started: _Started, files: _TrialFiles) -> _Probe | Failure:
        """Probe: what SGLang resolved, the memory report and the GPU memory after the start; the
        server's silence on ``/get_server_info`` is a crash."""
        try:
            info = self.server.info()
        except ServerError as err:
            return Failure(failure_class=FailureClass.CRASH, evidence=str(err))
        after_start_mib = self.server.gpu_used_mib()
        resolved, facts = resolve_facts(started.report, info, argv, self.table, job.context_tokens)
        files.write("server_info", json.dumps(info.raw, indent=2, default=str))
        return _Probe(resolved=resolved, facts=facts, memory=memory_facts(started.report, info, facts, resolved),
                      after_start_mib=after_start_mib)

    def _measure(self, argv: list[str], started: _Started, probe: _Probe, on_phase: Callable[..., None],
                 files: _TrialFiles) -> _Measured:
        """Measure: the workload's warm-up and measured window at the concurrency the pool admits
        (stopped early when the SLO is clearly lost), with ``/metrics`` scraped around it."""
        budget, facts = self.config.budget, probe.facts
        concurrency = load_concurrency(
            budget, capacity=probe.capacity, max_running_requests=facts.get("effective_max_running_requests"),
            max_total_num_tokens=facts.get("max_total_num_tokens"), mean_request_tokens=self._workload.mean_request_tokens,
        )
        slo = self.config.slo
        ticks = _load_ticks(
            on_phase, "measure", expected=budget.max_requests or (concurrency if budget.request_rate is None else None),
            duration_s=budget.warmup_s + budget.measure_s,
            stop=(lambda s: slo_clearly_lost(s, slo)) if budget.early_stop else None,
        )
        before = self.server.metrics()
        outcome = self.server.load(LoadPlan(
            name="measure", workload=self._workload, concurrency=concurrency, rate=budget.request_rate,
            warmup_s=budget.warmup_s, duration_s=budget.measure_s, max_requests=budget.max_requests, slo=slo,
            seed=self.config.study.seed, timeout_s=budget.warmup_s + 4 * budget.measure_s + 120.0,
            request_timeout_s=max(60.0, 4 * budget.measure_s),
        ), ticks)
        after = self.server.metrics() if before is not None else None
        result = outcome.result
        cache = self._cache(started.report, argv, result.summary if result is not None else None, before, after)
        if result is not None:
            files.write("requests", json.dumps({"result": result.to_json_dict(),
                                                "requests": [r.model_dump(mode="json") for r in result.records]},
                                               default=str))
        failure = outcome.failure or _could_not_run("load", outcome)
        unmeasured = measure_gap(result, budget.measure_s) if failure is None else None
        return _Measured(outcome=outcome, concurrency=concurrency, cache=cache, failure=failure, unmeasured=unmeasured)

    def _stress(self, job: TrialJob, probe: _Probe, measured: _Measured, on_phase: Callable[..., None]) -> _Stressed:
        """Stress, then the SLO-safe capacity.

        The stress load (the OOM stress) sends every longest context the config admits at once for
        ``stress_s``; it failed when any request errored, the load was cut, or the server died. Its
        SLO verdict is the *burst admission*, reported beside the SLO-safe capacity, never as it.
        The SLO-safe capacity is then bracketed on steady windows (:mod:`tuner.load.steady`): the
        first at the stress load's count of sessions, each next one below the smallest count that
        broke the SLO (:func:`tuner.load.search.bracket_level`), at most ``slo_capacity_steps``
        more. Not run after a death under the measured load, without ``stress_s`` or without a
        capacity."""
        budget = self.config.budget
        if measured.failure is not None or budget.stress_s <= 0 or not probe.capacity:
            return _Stressed()
        on_phase("stress")
        n = _stress_concurrency(probe.capacity, budget)
        slo = context_slo(self.config.slo)
        outcome = self._stress_load(job, n, slo, on_phase, step=0)
        failure = outcome.failure or _could_not_run("stress load", outcome)
        result = outcome.result
        failed = failure is not None or (result is not None and (result.summary.errored > 0 or result.partial))
        burst = None if failed or slo is None or result is None else judge_contexts(result.summary, n, slo)
        steps: list[SloStep] = []
        k: int | None = n if burst is not None else None
        while k is not None and failure is None and len(steps) <= budget.slo_capacity_steps:
            assert slo is not None
            step = self._steady_load(job, k, slo, on_phase, step=len(steps) + 1)
            failure = step.failure  # a window that could not run leaves the capacity unmeasured, the config unjudged
            if failure is not None or step.result is None or step.result.partial:
                break
            steps.append(judge_contexts(step.result.summary, k, slo))
            # The window broke the SLO: bracket the count that still meets it (one window each).
            met = max((s.contexts for s in steps if s.met), default=None)
            broken = min((s.contexts for s in steps if not s.met), default=None)
            worst = max((v for s in steps if s.contexts == broken for v in s.violations.values()
                         if v is not None), default=None)
            k = bracket_level(met, broken, worst) if broken is not None else None
        basis = self.config.objective.capacity
        capacity = None if slo is None else slo_capacity(
            steps, slo, capped=n < probe.capacity, burst=burst,
            basis="oom_safe" if basis == "oom_safe" else "slo_safe")
        return _Stressed(outcome=outcome, failure=failure, failed=failed or failure is not None,
                         slo_capacity=capacity)

    def _stress_load(self, job: TrialJob, n: int, slo: SLO | None, on_phase: Callable[..., None], *,
                     step: int) -> LoadOutcome:
        """The burst: ``n`` requests of the longest context at once for ``stress_s``, judged by
        ``slo`` (the OOM stress and the burst admission figure)."""
        budget = self.config.budget
        workload = capacity_probe(n, job.context_tokens, output_len=_stress_output_tokens(job.context_tokens),
                                  seed=self.config.study.seed + job.number + _STEP_SEED * step)
        return self.server.load(LoadPlan(
            name="stress", workload=workload, concurrency=n, duration_s=budget.stress_s, seed=self.config.study.seed,
            slo=slo, timeout_s=budget.stress_s * 4 + 120.0, request_timeout_s=max(60.0, budget.stress_s * 4),
        ), _load_ticks(on_phase, "stress", expected=n, duration_s=budget.stress_s))

    def _steady_load(self, job: TrialJob, sessions: int, slo: SLO, on_phase: Callable[..., None], *,
                     step: int) -> LoadOutcome:
        """One steady window of ``sessions`` closed-loop sessions (:mod:`tuner.load.steady`): the
        workload with ``[objective] longest_share`` of its requests at the longest context, started
        over the ramp, ``warmup_s`` more of warm-up, ``stress_s`` measured. Each window draws its
        own prompts (``step`` seeds them): with an earlier load's, the server's radix cache would
        hold them already and its TTFT would measure a cache hit (a real run of the reference twin
        saw p99 TTFT 72 ms at 3 × 32k after 15.7 s at 4). The seed is the study's and the step's,
        not the trial number's: every trial's n-th window sends the same prompts (common random
        numbers: configs compared on the same traffic), and a window's traffic does not depend on
        how many skipped proposals were numbered before its trial (which a background writer
        decides: the decision trace flapped on it)."""
        budget = self.config.budget
        window = budget.steady_window()
        seed = self.config.study.seed + _STEP_SEED * step
        base = build_workload(self.config.workload, seed=seed) if self._workload.spec is not None else self._workload
        try:
            workload = session_workload(base, job.context_tokens, self.config.objective.longest_share, sessions=sessions)
        except LoadError as err:  # a resumed study's stored context its sessions never reach
            return LoadOutcome(result=None, load_error=str(err))
        limit_s = window.warmup_s + window.duration_s
        request_timeout_s = max(60.0, limit_s * 4)
        return self.server.load(LoadPlan(
            name="steady", workload=workload, concurrency=sessions, duration_s=window.duration_s,
            warmup_s=window.warmup_s, ramp_s=window.ramp, seed=seed, slo=slo,
            timeout_s=limit_s * 4 + 120.0, request_timeout_s=request_timeout_s,
            cooldown_s=window.cooldown_s(request_timeout_s),
        ), _load_ticks(on_phase, "stress", expected=None, duration_s=limit_s))

    def _quality(self, job: TrialJob, argv: list[str], *, alive: bool, on_phase: Callable[..., None],
                 model_class: str | None) -> QualityFacts:
        """Quality: the launch's numerics against the baseline's, both as SGLang resolves them
        (``model_class``, the startup log's, chooses a speculative shape the command leaves to
        SGLang: :func:`tuner.sglang.numerics.resolve_numerics`); a change is probed (after the
        load phases, on a server that still serves) unless this study already probed the same
        numerics; the baseline's numerics record the study's reference answers once
        (:func:`tuner.load.quality.gate`)."""
        flags, baseline = parse_argv(argv, self.table), parse_argv(self._baseline_argv, self.table)
        numerics = dict(numerics_key(flags, model_class=model_class))
        changes = numerics_changes(flags, baseline, model_class=model_class)
        config = self.config.quality
        if not alive:
            return QualityFacts(numerics=numerics, changes=changes, status="same" if not changes else "unprobed",
                                reason="the server died under load: no probe")

        def probe() -> ProbeAnswers:
            on_phase("quality")
            return run_probe(self.server.generate, config, self._tasks, clock=self._clock)

        return gate(job.number, numerics, changes, config, reference=job.quality_reference, probes=job.quality_probes,
                    probe=probe, digest=probe_digest(config, self._tasks))

    def _record(self, record: TrialRecord, probe: _Probe, measured: _Measured, stressed: _Stressed,
                lines: list[str]) -> TrialRecord:
        """Record: the phases, the memory peaks and the retractions of the whole trial's log →
        objectives, constraints and feasibility (:func:`_assemble_record`)."""
        peaks: dict[str, float] = {}
        outcomes = [o for o in (measured.outcome, stressed.outcome) if o is not None]
        if probe.facts["free_gib_after_graphs"] is not None:
            peak_used_mib = max([probe.after_start_mib, *(o.peak_gpu_used_mib for o in outcomes)])
            peaks = _gpu_peak_memory(probe.after_start_mib, peak_used_mib)
        memory = probe.memory.model_copy(update={**peaks, "retractions": len(parse_log(lines).retractions)})
        result = measured.outcome.result
        phases = [_phase_result("measure", result)] if result is not None else []
        if stressed.outcome is not None and stressed.outcome.result is not None:
            phases.append(_phase_result("stress", stressed.outcome.result))
        record = _assemble_record(
            record, memory=memory, summary=result.summary if result is not None else None, phases=phases,
            stress_failed=stressed.failed, runtime_failure=measured.failure or stressed.failure,
            unmeasured=measured.unmeasured, load=_window_load(measured.concurrency, probe.facts, self._longest_input()),
        )
        update: dict[str, Any] = {"cache": measured.cache}
        if stressed.slo_capacity is not None:
            update["slo_capacity"] = stressed.slo_capacity
        return record.model_copy(update=update)

    def _finish(self, record: TrialRecord, lines: list[str], begun_s: float, files: _TrialFiles) -> TrialRecord:
        """The record's artifacts, log excerpt and duration; a failure quotes the server log's error line."""
        if lines:
            files.write("server_log", "\n".join(lines) + "\n")
        record = record.model_copy(update={
            "artifacts": files.paths(), "log_excerpt": _excerpt(lines, record.failure_evidence),
            "duration_s": self._clock() - begun_s,
        })
        return quote_server_log(record, lines)

    # ---- pieces ------------------------------------------------------------------------------------

    def _cache(self, report: LogReport, argv: list[str], summary: LoadSummary | None,
               before: dict[str, float] | None, after: dict[str, float] | None) -> CacheFacts:
        """The prefix cache's tiers for the record: hit rates by tier and the host pool pinned (§7).

        Hit rates come from ``cached_tokens_details`` per request (0.5.10+), else from ``/metrics``
        counter deltas over the load phase (:func:`tuner.load.metrics.tier_hits_from_metrics`).
        The host pool is :func:`host_pools` (per rank × ranks).
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
        pools = host_pools(report, argv)
        if pools is not None:
            per_rank_gb, ranks = pools
            out.update(host_pool_gb_per_rank=per_rank_gb, host_pool_ranks=ranks,
                       host_pool_gb=round(per_rank_gb * ranks, 3))
            if report.host_pool_tokens is not None:
                out["host_pool_tokens_per_rank"] = report.host_pool_tokens
        return CacheFacts(**out)

    def _longest_input(self) -> int:
        return int(getattr(self.config.workload, "input_len", 0) or self._workload.context_tokens)


def _probed_record(record: TrialRecord, probe: _Probe, job: TrialJob) -> TrialRecord:
    """``record`` with what the probe resolved: capacities, free memory, and (the baseline) its knobs."""
    update: dict[str, Any] = {
        "resolved": probe.resolved,
        "token_capacity": probe.facts["max_total_num_tokens"],
        "context_capacity": probe.capacity,
        "per_request_max_tokens": probe.facts.get("per_request_max_tokens"),
        "free_gib_after_graphs": probe.facts["free_gib_after_graphs"],
    }
    if job.kind == "baseline":
        update["params"] = probe.facts["params"]
    return record.model_copy(update=update)


def _could_not_run(what: str, outcome: LoadOutcome) -> Failure | None:
    """A load that could not run on a server that still serves: a crash naming the load's error."""
    if outcome.load_error is None:
        return None
    return Failure(failure_class=FailureClass.CRASH, evidence=f"{what} could not run: {outcome.load_error}")


def _phase_result(name: str, result: LoadResult) -> PhaseResult:
    """A load phase as the record stores it (an early stop on the SLO named as such)."""
    phase = result.phase_result(name)
    if name == "measure" and result.stopped_early:
        phase = phase.model_copy(update={"stop_reason": "SLO clearly lost (early stop)"})
    return phase


def _load_ticks(on_phase: Callable[..., None], phase: str, *, expected: int | None, duration_s: float | None,
                stop: Callable[[LiveStats], bool] | None = None) -> Callable[[LiveStats], bool | None]:
    """An ``on_tick`` for :meth:`ServerUnderTest.load` that reports the phase's requests done
    (ok or errored, warm-up included) against ``expected``, then asks ``stop`` (early stop)."""

    def tick(stats: LiveStats) -> bool | None:
        on_phase(phase, PhaseProgress(requests_done=stats.completed + stats.errored, requests_expected=expected,
                                      elapsed_s=round(stats.elapsed_s, 1), duration_s=duration_s))
        return stop(stats) if stop is not None else None

    return tick


def _excerpt(lines: list[str], evidence: str | None, *, limit: int = 20) -> list[str]:
    """The memory lines of the log (and the failure evidence), at most ``limit`` lines."""
    keys = ("avail mem", "KV Cache", "max_total_num_tokens", "Capture", "Not enough memory", "out of memory",
            "Retract", "fired up", "Scheduler hit an exception", "Error")
    picked = [line for line in lines if any(k in line for k in keys)]
    if evidence and not any(evidence in line for line in picked):
        picked.append(evidence)
    return [line[:400] for line in picked[-limit:]]


def quote_server_log(record: TrialRecord, lines: Sequence[str]) -> TrialRecord:
    """Add the server log's error line to a failure whose evidence is not a log line itself.

    The launcher classifies an exit (``exited with status 2 (argparse) before any startup line``)
    without quoting the server; the user needs the server's words (``--model-path ... is neither a
    directory ...``, ``address already in use``).

    Args:
        record: A trial's record (only a failed one changes).
        lines: The server log's lines, oldest first.

    Returns:
        ``record`` with ``failure_evidence`` ``"<evidence>; server log: <line>"`` and the line
        last in ``log_excerpt``; unchanged when it did not fail, when its evidence is a log line
        or quotes the error line already, or when no line reads like an error.
    """
    if record.outcome != "failed":
        return record
    evidence = record.failure_evidence or ""
    if evidence and any(evidence in line for line in lines):
        return record
    line = log_error_line(lines)
    if line is None or line in evidence:
        return record
    excerpt = [x for x in record.log_excerpt if x != line] + [line]
    return record.model_copy(update={
        "failure_evidence": f"{evidence}; server log: {line}" if evidence else line,
        "log_excerpt": excerpt,
    })
