"""Offline evaluation: one simulated SGLang server and a whole workload, on virtual time.

:func:`evaluate` sizes the server from its command line exactly as ``python -m tuner.sim`` does
(the same argument parsing, memory ledger and startup lines), then runs the engine step by step
on a :class:`~tuner.sim.clock.VirtualClock`, so a workload that would take minutes on a GPU takes
a fraction of a second of CPU. Metrics follow ``sglang.bench_serving``'s definitions
(``shared/sglang-reference.md`` §6.2): TTFT = first token − arrival, TPOT = (E2E − TTFT) /
(output − 1), ITL = gap between token deliveries divided by the tokens delivered, throughputs =
totals / duration; the cache hit rate is Σ cached / Σ prompt tokens (§5.5).

This is what the study's search-quality benchmark calls many times, so it avoids per-token
objects: it reads the engine's internal step results instead of building events.
"""

from __future__ import annotations

import io
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from tuner.sim.clock import VirtualClock
from tuner.sim.engine import Engine, EngineSpec, RequestRejected, SimRequest, SimRuntimeOOM
from tuner.sim.models import GIB
from tuner.sim.startup import SimLogger, engine_spec, log_startup, plan_from_argv

__all__ = ["EvalResult", "SizedServer", "evaluate", "size_server"]


@dataclass(frozen=True)
class SizedServer:
    """A server command line after startup sizing.

    Attributes:
        engine_spec: The engine's settings (None when startup fails).
        failure: Startup failure class (the memory ledger's kind, e.g. ``graph_oom``), or None.
        log_lines: The startup log as the server prints it.
        max_total_num_tokens: KV pool size, tokens (0 when it was never sized).
        free_gib_after_graphs: Free GPU memory after CUDA graphs, GiB (§4.2 ``available_gpu_mem``).
        max_running_requests: Effective value (§2.3).
        hicache_host_bytes: One rank's HiCache host pool (0 without it, §7).
    """

    engine_spec: EngineSpec | None
    failure: str | None
    log_lines: list[str]
    max_total_num_tokens: int
    free_gib_after_graphs: float
    max_running_requests: int
    hicache_host_bytes: int = 0


def size_server(argv: Sequence[str]) -> SizedServer:
    """Run the simulator's startup on ``argv`` without waiting or serving.

    The same path as ``python -m tuner.sim``: :func:`~tuner.sim.startup.plan_from_argv` (argv →
    memory ledger), :func:`~tuner.sim.startup.log_startup` (its log lines, with no delays) and
    :func:`~tuner.sim.startup.engine_spec` (ledger → engine settings).

    Args:
        argv: ``python -m tuner.sim`` arguments (SGLang's flags plus ``--sim-*``).

    Returns:
        The sized server, or its startup failure with the lines printed up to it.

    Raises:
        tuner.sim.errors.SimError: Bad input (unknown GPU preset, unreadable model config, bad value).
        SystemExit: argparse rejected a flag (status 2, as SGLang).
    """
    parsed, plan = plan_from_argv(list(argv))
    stream = io.StringIO()
    up = log_startup(parsed, plan, SimLogger(stream, plan.config.tp_size), time_scale=0)
    lines = stream.getvalue().splitlines()
    if not up or plan.failure is not None:
        kind = plan.failure.kind if plan.failure is not None else "startup"
        return SizedServer(None, kind, lines, plan.max_total_num_tokens, 0.0, plan.max_running_requests)
    return SizedServer(
        engine_spec(plan, parsed.sim.seed, parsed.sim.scheduler), None, lines, plan.max_total_num_tokens,
        plan.available_bytes / GIB, plan.max_running_requests,
        plan.hicache_host_bytes if plan.config.enable_hierarchical_cache else 0,
    )


@dataclass(frozen=True)
class EvalResult:
    """One offline run: what startup resolved and what the workload measured.

    Latencies are None when no request produced the needed tokens.

    Attributes:
        started: Startup succeeded.
        startup_failure: Startup failure class, or None.
        runtime_oom: A step's activations exceeded the free memory (torch OOM; the server died).
        error: Another fatal engine error (e.g. a decode allocation failure), or None.
        max_total_num_tokens: KV pool size, tokens.
        max_running_requests: Effective limit.
        free_gib_after_graphs: Free GPU memory after graphs, GiB.
        completed: Requests finished.
        rejected: Requests refused as too long (§1.4): at arrival, or aborted by the engine when
            the pool can never admit them.
        retractions: Requests retracted (§4.4).
        duration_s: Simulated time from the start to the last event (or the ``duration_s`` cut).
        total_output_tokens: Tokens generated (finished or not).
        output_throughput: ``total_output_tokens / duration_s``, tokens/s.
        request_throughput: ``completed / duration_s``, requests/s.
        mean_ttft_ms, p50_ttft_ms, p99_ttft_ms: Time to first token, ms.
        p99_itl_ms: Inter-token latency, ms.
        itls_ms: Every inter-token gap of the window, ms (single precision: the share over an
            SLO's ITL limit is computed from them, :func:`tuner.load.metrics.itl_exceedance`).
        p99_tpot_ms: Time per output token after the first, ms (``mean_tpot_ms`` and
            ``p50_tpot_ms`` likewise: bench_serving's mean and median TPOT).
        mean_e2e_latency_ms: End-to-end latency of completed requests, ms.
        cache_hit_rate: Σ cached / Σ prompt tokens of finished requests.
        host_hit_rate: The part of it loaded back from the HiCache host tier (load-back tokens /
            prompt tokens, §7).
        host_pool_bytes_per_rank: The HiCache host pool of one rank (0 without it).
        peak_activation_gib: The largest step's activation memory per GPU, GiB (what the simulated
            GPU monitor adds to the memory in use under load).
        counters: The engine's counters at the end (``prompt_tokens_total``,
            ``cached_tokens_total``, ``load_back_tokens_total``, ...): what the server's
            ``/metrics`` exports as ``sglang:<name>``.
        log_lines: Startup and engine log lines.
    """

    started: bool
    startup_failure: str | None
    runtime_oom: bool
    max_total_num_tokens: int
    max_running_requests: int
    free_gib_after_graphs: float
    completed: int = 0
    rejected: int = 0
    retractions: int = 0
    duration_s: float = 0.0
    total_output_tokens: int = 0
    output_throughput: float = 0.0
    request_throughput: float = 0.0
    mean_ttft_ms: float | None = None
    p50_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    p99_itl_ms: float | None = None
    itls_ms: array = field(default_factory=lambda: array("f"))
    p99_tpot_ms: float | None = None
    mean_tpot_ms: float | None = None
    p50_tpot_ms: float | None = None
    mean_e2e_latency_ms: float | None = None
    cache_hit_rate: float = 0.0
    host_hit_rate: float = 0.0
    host_pool_bytes_per_rank: int = 0
    error: str | None = None
    peak_activation_gib: float = 0.0
    counters: dict[str, int] = field(default_factory=dict)
    log_lines: list[str] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def evaluate(
    argv: list[str],
    requests: Iterable[SimRequest],
    *,
    concurrency: int | None = None,
    duration_s: float | None = None,
    max_steps: int = 5_000_000,
    after: Mapping[str, str] | None = None,
    ramp_s: float = 0.0,
    measure_from_s: float = 0.0,
    send_until_s: float | None = None,
    min_measured: int = 0,
    steady: bool = False,
) -> EvalResult:
    """Start a simulated server from ``argv`` and run ``requests`` through it on virtual time.

    Args:
        argv: The server's command line (SGLang flags plus ``--sim-*``).
        requests: The workload. Open loop (``concurrency`` None): each request arrives at its
            ``arrival_s`` (seconds from the start). Closed loop: ``concurrency`` requests are in
            flight at once, in order, each next one sent when one finishes; ``arrival_s`` is
            ignored; without ``after`` it may be an iterator, drawn as requests are sent.
        concurrency: Closed-loop concurrency, or None for open loop.
        duration_s: Stop after this much simulated time (a measured window); None runs to the end.
        max_steps: Safety bound on engine steps.
        after: rid → rid of a request that must finish first (the previous turn of a
            conversation); closed loop only: a request waits, and the next one that may go is sent.
        ramp_s: Closed loop: the ``concurrency`` streams start staggered over this many seconds
            (stream ``i`` at ``i × ramp_s / concurrency``), as the load generator's ramp does.
        measure_from_s: Latencies, throughputs and counts cover only the requests sent at or after
            this time (the warm-up before it is excluded, bench_serving's definition, §6.1).
        send_until_s: Closed loop: no request is sent after this time (once ``min_measured``
            were sent at or after ``measure_from_s``); the requests in flight run to their end,
            as the load generator's measured window does (:class:`tuner.load.arrivals.PhasePlan`).
        steady: Closed loop with ``send_until_s``: the streams keep sending after the window,
            unmeasured, until its last measured request ends, and the run ends then (a steady
            window: :meth:`tuner.load.steady.SteadyWindow.cooldown_s`).

    Returns:
        The startup outcome and the workload metrics.

    Raises:
        tuner.sim.errors.SimError: Bad server arguments.
        SystemExit: argparse rejected a flag (status 2).
        ValueError: ``concurrency`` below 1 or a negative ``duration_s``.
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if duration_s is not None and duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    sized = size_server(argv)
    logs = list(sized.log_lines)
    base = dict(
        max_total_num_tokens=sized.max_total_num_tokens,
        max_running_requests=sized.max_running_requests,
        free_gib_after_graphs=sized.free_gib_after_graphs,
    )
    if sized.engine_spec is None:
        return EvalResult(started=False, startup_failure=sized.failure, runtime_oom=False, log_lines=logs, **base)
    base["host_pool_bytes_per_rank"] = sized.hicache_host_bytes
    return _run(sized.engine_spec, requests, logs, base, concurrency, duration_s, max_steps, dict(after or {}),
                ramp_s=ramp_s, measure_from_s=measure_from_s, send_until_s=send_until_s, min_measured=min_measured,
                steady=steady)


def _run(  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
    spec: EngineSpec,
    requests: Iterable[SimRequest],
    logs: list[str],
    base: dict,
    concurrency: int | None,
    duration_s: float | None,
    max_steps: int,
    after: dict[str, str] | None = None,
    *,
    ramp_s: float = 0.0,
    measure_from_s: float = 0.0,
    send_until_s: float | None = None,
    min_measured: int = 0,
    steady: bool = False,
) -> EvalResult:
    """Drive an engine over the workload on a virtual clock and summarise it."""
    engine = Engine(spec, logs.append)
    clock = VirtualClock()
    closed = concurrency is not None
    # A closed loop without turns draws its requests as it sends them (a steady window's pool may
    # be an iterator: only what the window sends is built).
    source = iter(requests) if closed and not after else None
    pending = [] if source is not None else (list(requests) if closed else sorted(requests, key=lambda r: r.arrival_s))
    n = len(pending)
    nxt = 0
    # rid -> [arrival_s, first_token_s, last_token_s, output tokens, measured (1.0) or not (0.0)]
    timing: dict[str, list[float]] = {}
    itls: list[float] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    e2es: list[float] = []
    total_out = 0
    rejected = 0
    in_flight = 0
    runtime_oom = False
    error: str | None = None
    last_event_s = 0.0
    queue = list(pending) if closed and after else []
    finished_rids: set[str] = set()

    measured_sent = 0
    measured_in_flight = 0
    window_end_s: float | None = None  # when the window stopped counting sends

    def submit(req: SimRequest, at_s: float) -> bool:
        nonlocal rejected, measured_sent, measured_in_flight
        try:
            engine.add_request(replace(req, arrival_s=at_s))
        except RequestRejected:
            rejected += 1
            finished_rids.add(req.rid)  # its next turn may go (it never will be answered)
            return False
        measured = at_s >= measure_from_s and not (steady and window_end_s is not None)
        timing[req.rid] = [at_s, -1.0, at_s, 0, float(measured)]
        measured_sent += measured
        measured_in_flight += measured
        return True

    def streams(at_s: float) -> int:
        """Closed-loop streams started by ``at_s`` (all of them without a ramp)."""
        if ramp_s <= 0:
            return concurrency or 0
        return min(concurrency or 0, math.floor(at_s * (concurrency or 0) / ramp_s + 1e-9) + 1)

    steps = 0
    while steps < max_steps:
        now = clock.now_s()
        if duration_s is not None and now >= duration_s:
            break
        active = streams(now) if closed else 0
        if send_until_s is not None and now >= send_until_s and measured_sent >= min_measured:
            window_end_s = now if window_end_s is None else window_end_s
            if steady and not measured_in_flight:
                break  # the window's last request ended while the streams kept sending
            if not steady:
                active = 0  # the window is over: no more sends, the requests in flight finish
        if closed and after:
            while in_flight < active and queue:
                ready = next((i for i, q in enumerate(queue) if after.get(q.rid) in (None, *finished_rids)), None)
                if ready is None:
                    break  # every waiting turn waits for a turn in flight
                in_flight += submit(queue.pop(ready), now)
        elif closed:
            while in_flight < active:
                if nxt >= n and source is not None and (drawn := next(source, None)) is not None:
                    pending.append(drawn)
                    n += 1
                if nxt >= n:
                    break
                in_flight += submit(pending[nxt], now)
                nxt += 1
        else:
            while nxt < n and pending[nxt].arrival_s <= now:
                submit(pending[nxt], pending[nxt].arrival_s)
                nxt += 1
        try:
            dur, token_reqs, finished = engine._step(now)
        except SimRuntimeOOM as oom:
            logs.append("Scheduler hit an exception: " + oom.message)
            runtime_oom = True
            break
        except RuntimeError as exc:
            logs.append(f"Scheduler hit an exception: {exc}")
            error = str(exc).splitlines()[0]
            break
        steps += 1
        if engine.idle_wait and not closed and nxt < n:  # waiting for the request path; an arrival may come first
            dur = min(dur, max(0.0, pending[nxt].arrival_s - now))
            if dur == 0.0:
                continue
        if dur == 0.0 and not token_reqs and not finished:  # idle: the engine never stalls (it aborts)
            if closed and after and active and queue and any(after.get(q.rid) in (None, *finished_rids) for q in queue):
                continue
            if not closed and nxt < n:
                clock.advance_to(pending[nxt].arrival_s)
                continue
            more = bool(queue) or nxt < n or source is not None  # an iterator's end shows at the next draw
            if closed and 0 < active < (concurrency or 0) and more:  # the next stream's start
                clock.advance_to(active * ramp_s / (concurrency or 1))
                continue
            break
        clock.sleep(dur)
        t = clock.now_s()
        last_event_s = t
        for r in token_reqs:
            k = r.new_tokens
            if not k:
                continue
            rec = timing[r.rid]
            measured = rec[4] > 0
            if rec[1] < 0:
                rec[1] = t
                if measured:
                    ttfts.append(t - rec[0])
            elif measured:
                itls.append((t - rec[2]) / k)
            rec[2] = t
            rec[3] += k
            total_out += k if measured else 0
        for r in finished:
            in_flight -= 1
            finished_rids.add(r.rid)
            rec = timing.pop(r.rid)
            measured_in_flight -= rec[4] > 0
            if r.finish_reason["type"] == "abort":  # the pool can never admit it (§1.4)
                rejected += 1
                continue
            if not rec[4]:
                continue
            e2es.append(t - rec[0])
            if rec[3] > 1 and rec[1] >= 0:
                tpots.append((t - rec[1]) / (rec[3] - 1))
    end_s = clock.now_s() if duration_s is None else min(duration_s, max(clock.now_s(), last_event_s))
    span = max(end_s - min(measure_from_s, end_s), 1e-9)
    stats = engine.stats()
    ms = 1e3
    return EvalResult(
        started=True,
        startup_failure=None,
        runtime_oom=runtime_oom,
        completed=len(e2es),
        rejected=rejected,
        retractions=stats["num_retractions_total"],
        duration_s=end_s,
        total_output_tokens=total_out,
        output_throughput=total_out / span,
        request_throughput=len(e2es) / span,
        mean_ttft_ms=sum(ttfts) / len(ttfts) * ms if ttfts else None,
        p50_ttft_ms=_scale(_percentile(ttfts, 50), ms),
        p99_ttft_ms=_scale(_percentile(ttfts, 99), ms),
        p99_itl_ms=_scale(_percentile(itls, 99), ms),
        itls_ms=array("f", (v * ms for v in itls)),
        p99_tpot_ms=_scale(_percentile(tpots, 99), ms),
        mean_tpot_ms=sum(tpots) / len(tpots) * ms if tpots else None,
        p50_tpot_ms=_scale(_percentile(tpots, 50), ms),
        mean_e2e_latency_ms=sum(e2es) / len(e2es) * ms if e2es else None,
        cache_hit_rate=stats["cached_tokens_total"] / stats["prompt_tokens_total"] if stats["prompt_tokens_total"] else 0.0,
        host_hit_rate=stats["load_back_tokens_total"] / stats["prompt_tokens_total"] if stats["prompt_tokens_total"] else 0.0,
        error=error,
        peak_activation_gib=stats["peak_activation_bytes"] / GIB,
        counters={**{k: v for k, v in stats.items() if k.endswith("_total")},
                  "spec_accepted_total": engine.spec_accepted_total, "spec_forward_total": engine.spec_forward_total},
        log_lines=logs,
        **base,
    )


def _scale(x: float | None, k: float) -> float | None:
    return None if x is None else x * k
