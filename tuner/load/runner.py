"""Runner: drives one load run against a server and returns its records and summary.

:func:`run_load` is the one entry point (``run_load_sync`` wraps it for callers without an event
loop). It checks the server with a 1-token request, then sends the workload closed-loop
(``concurrency``), open-loop (``rate``, optional ``burstiness``) or by the trace's own times,
labels each request with its phase (:class:`tuner.load.arrivals.PhasePlan`), calls ``on_tick``
about every second with :class:`LiveStats` (returning ``True`` stops the run), and summarizes the
measured window with :func:`tuner.load.metrics.summarize`.

A window that ends by time stays open until it holds ``min_measured`` sends (default: the
concurrency), so warm-up requests that outlast it cannot leave it empty (see
:class:`tuner.load.arrivals.PhasePlan`); ``timeout_s`` bounds that wait.

A server that dies mid-run ends the run promptly: a refused connection (or a lost stream followed
by a refused probe connection) stops sending, cancels what is in flight and marks the result
``partial``; nothing waits for a dead server.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import signal
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tuner.errors import LoadError
from tuner.load.arrivals import Phase, PhasePlan, arrival_offsets_s
from tuner.load.client import Api, StreamClient, TokenCounter, Transport
from tuner.load.metrics import SLO, LoadSummary, RequestRecord, summarize
from tuner.load.workloads import Request, Workload
from tuner.records import PhaseResult

__all__ = ["LiveStats", "PhaseWindow", "LoadResult", "run_load", "run_load_sync", "run_sync", "check_fits_server", "MAX_CONCURRENCY"]

T = TypeVar("T")

MAX_CONCURRENCY = 100_000
"""The most requests in flight a load opens (``tuner load --concurrency``, ``[budget] concurrency``
and ``max_concurrency``): each is a connection and a task, and 10⁸ exhausted memory before the
first request."""

_POLL_S = 0.05
"""How often the run's supervisor wakes up to check phases, stops and server death."""
_CSV_FIELDS = (
    "rid", "phase", "status", "group", "input_len", "max_new_tokens", "prompt_tokens", "completion_tokens",
    "cached_tokens", "send_time_s", "ttft_ms", "tpot_ms", "e2e_latency_ms", "chunks", "finish_reason",
    "error_kind", "error",
)


class LiveStats(BaseModel):
    """Statistics of a run in progress, passed to ``on_tick`` about once a second.

    Attributes:
        elapsed_s: Seconds since the run's start.
        phase: ``warmup``, ``measure``, ``cooldown`` or ``drain`` (no more sends).
        sent: Requests sent so far (all phases).
        completed / errored: Requests finished ok / with an error so far (all phases).
        in_flight: Requests sent and not finished.
        waiting: Requests due (open loop) but held by the concurrency cap or a previous turn.
        output_tok_s: Output tokens/s streamed during the last tick.
        request_throughput: Requests/s finished during the last tick.
        p99_ttft_ms_so_far: p99 TTFT of the measured requests finished so far.
        mean_ttft_ms_last_tick: Mean TTFT of requests whose first token arrived in the last tick.
    """

    model_config = ConfigDict(frozen=True)

    elapsed_s: float
    phase: str
    sent: int
    completed: int
    errored: int
    in_flight: int
    waiting: int = 0
    output_tok_s: float
    request_throughput: float
    p99_ttft_ms_so_far: float | None = None
    mean_ttft_ms_last_tick: float | None = None


class PhaseWindow(BaseModel):
    """One phase of the run (``warmup``, ``measure``, ``cooldown``, ``drain``): when it started and
    ended (s from the start) and how many requests it sent."""

    model_config = ConfigDict(frozen=True)

    name: str
    start_s: float
    end_s: float
    sent: int


class LoadResult(BaseModel):
    """Everything one run produced.

    Attributes:
        summary: The measured window's :class:`LoadSummary`.
        records: Every request's record, all phases (``record.phase`` tells them apart).
        phases: The phases as they happened.
        live: The :class:`LiveStats` of every tick.
        workload: :meth:`Workload.describe` of what was sent.
        settings: The pacing (``concurrency``, ``rate``, ``burstiness``, ``api``, ...).
        stopped_early: ``on_tick`` asked to stop.
        stop_reason: Why the run ended before its plan, if it did.
        partial: The run was aborted (server died or ``timeout_s``): results cover part of the plan.
    """

    model_config = ConfigDict(extra="forbid")

    summary: LoadSummary
    records: list[RequestRecord] = Field(default_factory=list)
    phases: list[PhaseWindow] = Field(default_factory=list)
    live: list[LiveStats] = Field(default_factory=list)
    workload: str = ""
    settings: dict[str, Any] = Field(default_factory=dict)
    stopped_early: bool = False
    stop_reason: str | None = None
    partial: bool = False

    def measured(self) -> list[RequestRecord]:
        """The records of the measured window."""
        return [r for r in self.records if r.phase == "measure"]

    def phase_result(self, name: str = "measure") -> PhaseResult:
        """This run as a :class:`tuner.records.PhaseResult` named ``name`` (for a trial record)."""
        s = self.summary
        return PhaseResult(
            name=name,
            duration_s=s.duration,
            completed=s.completed,
            errored=s.errored,
            incomplete=s.incomplete,
            stopped_early=self.stopped_early or self.partial,
            stop_reason=self.stop_reason,
            metrics=s.metrics(),
        )

    def to_json_dict(self) -> dict[str, Any]:
        """Summary, phases, settings and stop facts (no per-request arrays) as JSON-ready data."""
        return self.model_dump(mode="json", exclude={"records"})

    def write_csv(self, path: Path) -> None:
        """Write one row per request (all phases) to ``path``.

        Raises:
            LoadError: ``path`` cannot be written.
        """
        try:
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=_CSV_FIELDS)
                writer.writeheader()
                for r in self.records:
                    ms = lambda x: None if x is None else round(x * 1000, 3)  # noqa: E731
                    writer.writerow({
                        "rid": r.rid, "phase": r.phase, "status": r.status, "group": r.group,
                        "input_len": r.input_len, "max_new_tokens": r.max_new_tokens,
                        "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                        "cached_tokens": r.cached_tokens, "send_time_s": round(r.send_time_s, 6),
                        "ttft_ms": ms(r.ttft_s), "tpot_ms": ms(r.tpot_s), "e2e_latency_ms": ms(r.e2e_latency_s),
                        "chunks": len(r.chunk_times_s), "finish_reason": r.finish_reason,
                        "error_kind": r.error_kind, "error": r.error,
                    })
        except OSError as err:
            raise LoadError(f"cannot write {path}: {err.strerror}", hint="pass a writable --csv path") from err


class _Run:
    """The state of one run (created per call; nothing shared between runs)."""

    def __init__(
        self,
        client: StreamClient,
        workload: Workload,
        plan: PhasePlan,
        *,
        concurrency: int | None,
        rate: float | None,
        burstiness: float,
        seed: int,
        one_pass: bool,
        on_tick: Callable[[LiveStats], bool | None] | None,
        tick_s: float,
        timeout_s: float | None,
        ramp_s: float = 0.0,
    ) -> None:
        self.client = client
        self.ramp_s = ramp_s
        self.workload = workload
        self.plan = plan
        self.concurrency = concurrency
        self.rate = rate
        self.burstiness = burstiness
        self.seed = seed
        self.requests = iter(workload) if one_pass else workload.passes()
        self.on_tick = on_tick
        self.tick_s = tick_s
        self.timeout_s = timeout_s
        self.counter = TokenCounter()
        self.records: list[RequestRecord] = []
        self.tasks: set[asyncio.Task[RequestRecord]] = set()
        self.spawned: dict[asyncio.Task[RequestRecord], tuple[Request, Phase, float]] = {}
        self.measured_tasks: set[asyncio.Task[RequestRecord]] = set()
        self.done_events: dict[str, asyncio.Event] = {}
        self.sem = asyncio.Semaphore(concurrency) if concurrency else None
        self.sent = self.completed = self.errored = self.waiting = 0
        self.phase_sent: dict[str, int] = {}
        self.phase_start: dict[str, float] = {}
        self.exhausted = False
        self.pending = 0
        self.fatal: str | None = None
        self.probe: asyncio.Task[None] | None = None
        self.t0 = 0.0
        self.live: list[LiveStats] = []
        self.measured_ttfts_ms: list[float] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _next_request(self) -> Request | None:
        if self.exhausted:
            return None
        try:
            request = next(self.requests)
        except StopIteration:
            # The window ends once every request taken so far has been sent (see execute()).
            self.exhausted = True
            return None
        self.pending += 1
        return request

    async def _after(self, request: Request) -> None:
        if request.after is not None:
            event = self.done_events.setdefault(request.after, asyncio.Event())
            await event.wait()

    def _claim_phase(self) -> Phase | None:
        t = self.now()
        self.pending -= 1
        phase = self.plan.phase_for_send(t)
        if phase is not None:
            self.sent += 1
            self.phase_sent[phase] = self.phase_sent.get(phase, 0) + 1
            self.phase_start.setdefault(phase, t)
        return phase

    def _finish(self, request: Request, record: RequestRecord) -> None:
        self.records.append(record)
        if record.status == "ok":
            self.completed += 1
            if record.phase == "measure" and record.first_token_time_s is not None:
                self.measured_ttfts_ms.append((record.first_token_time_s - record.send_time_s) * 1000)
        elif record.status == "error":
            self.errored += 1
            if record.error_kind == "connect" and self.fatal is None:
                self.fatal = f"server unreachable mid-run: {record.error}"
            elif record.error_kind == "disconnect" and self.probe is None:
                self.probe = asyncio.get_running_loop().create_task(self._probe_server())
        if self.workload.has_dependencies:
            self.done_events.setdefault(request.rid, asyncio.Event()).set()

    async def _probe_server(self) -> None:
        """After a lost stream, one TCP connect tells a dead server from a dropped connection."""
        parts = urlsplit(self.client.base_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), 2.0)
            writer.close()
        except (TimeoutError, OSError) as err:
            if self.fatal is None:
                self.fatal = f"server died mid-run: a stream was cut and {self.client.base_url} refuses connections ({err})"
        finally:
            self.probe = None

    def _task_done(self, task: asyncio.Task[RequestRecord]) -> None:
        self.tasks.discard(task)
        request, phase, sent_s = self.spawned.pop(task)
        if task.cancelled():
            # Cancelled before its coroutine ran: no record was made; keep it visible.
            self._finish(request, RequestRecord(
                rid=request.rid, phase=phase, status="incomplete", send_time_s=sent_s, end_time_s=self.now(),
                error="cancelled before it was sent", error_kind="cancelled", input_len=request.input_len,
                max_new_tokens=request.max_new_tokens, group=request.group,
            ))

    async def _send(self, request: Request, phase: Phase) -> RequestRecord:
        record = await self.client.send(request, t0=self.t0, phase=phase, counter=self.counter)
        self._finish(request, record)
        return record

    def _spawn(self, request: Request, phase: Phase) -> asyncio.Task[RequestRecord]:
        task = asyncio.get_running_loop().create_task(self._send(request, phase))
        self.tasks.add(task)
        self.spawned[task] = (request, phase, self.now())
        task.add_done_callback(self._task_done)
        if phase == "measure":
            self.measured_tasks.add(task)
            task.add_done_callback(self.measured_tasks.discard)
        return task

    async def _worker(self, index: int = 0) -> None:
        """Closed loop: send, wait for the answer, send the next; worker ``index`` of ``concurrency``
        starts ``index / concurrency`` of the ramp after the run's start (staggered sessions)."""
        if self.ramp_s > 0 and index:
            await asyncio.sleep(self.ramp_s * index / max(1, self.concurrency or 1))
        while not self.plan.sending_stopped and self.fatal is None:
            request = self._next_request()
            if request is None:
                return
            await self._after(request)
            phase = self._claim_phase()
            if phase is None:
                return
            await self._spawn(request, phase)

    async def _open_loop_send(self, request: Request) -> None:
        self.waiting += 1
        claimed = False
        try:
            await self._after(request)
            async with self.sem or contextlib.nullcontext():
                phase = self._claim_phase()
                self.waiting -= 1
                claimed = True
                if phase is not None:
                    await self._spawn(request, phase)
        finally:
            if not claimed:
                self.waiting -= 1

    async def _dispatcher(self, stop: asyncio.Event) -> None:
        """Open loop (rate or trace times): start each request at its arrival time."""
        offsets = arrival_offsets_s(self.rate, burstiness=self.burstiness, seed=self.seed) if self.rate else None
        holders: set[asyncio.Task[None]] = set()
        try:
            while not self.plan.sending_stopped and self.fatal is None:
                request = self._next_request()
                if request is None:
                    break
                due = next(offsets) if offsets is not None else (request.arrival_s or 0.0)
                delay = due - self.now()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                        break
                    except TimeoutError:
                        pass
                self.plan.advance(self.now())
                if self.plan.sending_stopped:
                    break
                holder = asyncio.get_running_loop().create_task(self._open_loop_send(request))
                holders.add(holder)
                holder.add_done_callback(holders.discard)
            if holders:
                await asyncio.gather(*holders, return_exceptions=True)
        finally:
            for holder in holders:
                holder.cancel()

    def _live(self, t: float, last_tokens: int, last_completed: int, dt: float) -> LiveStats:
        recent = [
            (r.first_token_time_s - r.send_time_s) * 1000
            for r in self.records[-4096:]
            if r.first_token_time_s is not None and r.first_token_time_s >= t - dt
        ]
        ttfts = self.measured_ttfts_ms
        return LiveStats(
            elapsed_s=t,
            phase=self.plan.current(t),
            sent=self.sent,
            completed=self.completed,
            errored=self.errored,
            in_flight=len(self.tasks),
            waiting=self.waiting,
            output_tok_s=(self.counter.tokens - last_tokens) / dt if dt > 0 else 0.0,
            request_throughput=(self.completed - last_completed) / dt if dt > 0 else 0.0,
            p99_ttft_ms_so_far=float(np.percentile(ttfts, 99)) if ttfts else None,
            mean_ttft_ms_last_tick=sum(recent) / len(recent) if recent else None,
        )

    async def execute(self) -> tuple[bool, str | None, bool]:
        """Run to the end of the plan; returns ``(stopped_early, stop_reason, partial)``."""
        stop = asyncio.Event()
        self.t0 = time.monotonic()
        closed = self.rate is None and not self.workload.has_arrivals
        drivers = (
            [asyncio.get_running_loop().create_task(self._worker(i)) for i in range(self.concurrency or 1)]
            if closed
            else [asyncio.get_running_loop().create_task(self._dispatcher(stop))]
        )
        stopped_early, reason, partial = False, None, False
        next_tick, last_tick, last_tokens, last_completed = self.tick_s, 0.0, 0, 0
        try:
            while True:
                await asyncio.sleep(_POLL_S)
                t = self.now()
                self.plan.advance(t)
                if self.exhausted and self.pending == 0:
                    self.plan.end_measure(t)
                if t >= next_tick:
                    stats = self._live(t, last_tokens, last_completed, t - last_tick)
                    self.live.append(stats)
                    last_tick, last_tokens, last_completed = t, self.counter.tokens, self.completed
                    next_tick = t + self.tick_s
                    if self.on_tick is not None and self.on_tick(stats):
                        stopped_early, reason = True, "stopped by on_tick"
                        break
                if self.fatal is not None:
                    partial, reason = True, self.fatal
                    break
                if self.timeout_s is not None and t >= self.timeout_s:
                    partial, reason = True, f"timeout_s={self.timeout_s:g} s reached"
                    if self.plan.waiting_for_sends(t):
                        reason += (
                            f" while the measured window waited for {self.plan.min_measured} requests"
                            f" ({self.plan.measured_sent} sent in it): warm-up requests outlast the window"
                        )
                    break
                if self.plan.measure_end_s is not None and not self.measured_tasks:
                    break  # the window is over and every measured request has finished
                if all(d.done() for d in drivers) and not self.tasks:
                    break
        finally:
            self.plan.sending_stopped = True
            stop.set()
            for task in [*drivers, *self.tasks, *([self.probe] if self.probe else [])]:
                task.cancel()
            await asyncio.gather(*drivers, *list(self.tasks), return_exceptions=True)
            if self.exhausted and self.plan.measure_end_s is None:
                self.plan.end_measure(self.now())
        return stopped_early, reason, partial

    def phases(self, end_s: float) -> list[PhaseWindow]:
        """The phases as they ran: warm-up, the measured window (to its planned end), cool-down,
        and ``drain`` (no more sends, in-flight requests finishing) up to ``end_s``."""
        windows: list[PhaseWindow] = []
        start = self.phase_start.get("warmup")
        measure_start = self.phase_start.get("measure", self.plan.warmup_s)
        if start is not None:
            windows.append(PhaseWindow(name="warmup", start_s=start, end_s=measure_start,
                                       sent=self.phase_sent.get("warmup", 0)))
        measure_end = min(self.plan.measure_end_s if self.plan.measure_end_s is not None else end_s, end_s)
        if "measure" in self.phase_start:
            windows.append(PhaseWindow(name="measure", start_s=measure_start, end_s=measure_end,
                                       sent=self.phase_sent.get("measure", 0)))
        last = measure_end
        if "cooldown" in self.phase_start:
            last = min(measure_end + self.plan.cooldown_s, end_s)
            windows.append(PhaseWindow(name="cooldown", start_s=measure_end, end_s=last,
                                       sent=self.phase_sent.get("cooldown", 0)))
        if end_s > last:
            windows.append(PhaseWindow(name="drain", start_s=last, end_s=end_s, sent=0))
        return windows


def check_fits_server(url: str, workload: Workload) -> None:
    """Refuse, before any request, a workload whose longest request the server would reject: input +
    output beyond its ``context_length``, or an input beyond its ``max_req_input_len`` (SGLang's
    "The input (N tokens) is longer than the model's context length", ``sglang-reference.md`` §4.4;
    ``GET /get_server_info``, §5.2). Every request would fail, read as "no request completed". A
    server that cannot be asked is left to the load's own probe.

    Raises:
        LoadError: Naming the longest request, the server's limit and the fix.
    """
    from tuner.errors import TunerError
    from tuner.sglang.client import SGLangClient

    try:
        with SGLangClient(url) as client:
            info = client.server_info()
    except TunerError:
        return
    longest = workload.context_tokens
    output = getattr(workload.spec, "output_len", 0) or 0
    if info.context_length and longest > info.context_length:
        raise LoadError(f"the workload's longest request ({longest:,} tokens, input + output) exceeds the server's "
                        f"context length ({info.context_length:,} tokens)", hint=_SHORTEN)
    if info.max_req_input_len and longest - output > info.max_req_input_len:
        raise LoadError(f"the workload's longest prompt ({longest - output:,} tokens) exceeds the server's longest "
                        f"input ({info.max_req_input_len:,} tokens, max_req_input_len)", hint=_SHORTEN)


_SHORTEN = "shorten the prompts (--input-len, --first-input-len, --system-prompt-len, --longest-context) or the output"


def _validate(
    workload: Workload, concurrency: int | None, rate: float | None, duration_s: float | None,
    max_requests: int | None, request_timeout_s: float, timeout_s: float | None,
) -> None:
    if concurrency is not None and concurrency < 1:
        raise LoadError(f"concurrency={concurrency} is invalid", hint="use --concurrency N with N >= 1")
    if rate is not None and not rate > 0:
        raise LoadError(f"rate={rate} is invalid", hint="use --rate R with R > 0 requests/s")
    if concurrency is None and rate is None and not workload.has_arrivals:
        raise LoadError(
            f"no pacing for the {workload.kind} workload", hint="pass --concurrency N (closed loop) or --rate R (open loop)"
        )
    if duration_s is None and max_requests is None and workload.num_requests is None:
        raise LoadError(
            f"the {workload.kind} workload is endless and no stop was given",
            hint="pass --duration S or --max-requests N (or set num_requests)",
        )
    bad = [f"--{name} {value:g}" for name, value in (("request-timeout", request_timeout_s), ("timeout", timeout_s))
           if value is not None and not value > 0]
    if bad:
        raise LoadError(f"{', '.join(bad)} s: a timeout must be more than 0 seconds "
                        "(request_timeout_s / timeout_s)", hint="use timeouts > 0 seconds")


async def run_load(
    url: str,
    workload: Workload,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    burstiness: float = 1.0,
    warmup_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    cooldown_s: float = 0.0,
    min_measured: int | None = None,
    api: Api = "generate",
    slo: SLO | None = None,
    on_tick: Callable[[LiveStats], bool | None] | None = None,
    request_timeout_s: float = 600.0,
    timeout_s: float | None = None,
    seed: int = 0,
    model: str | None = None,
    tick_s: float = 1.0,
    check_timeout_s: float = 30.0,
    transport: Transport = "raw",
    ramp_s: float = 0.0,
) -> LoadResult:
    """Send ``workload`` to the server at ``url`` and measure it.

    Pacing: ``rate`` → open loop (gamma arrivals, ``burstiness``; ``concurrency`` then caps
    requests in flight); a trace workload without ``rate`` → its own arrival times; otherwise
    closed loop with ``concurrency`` workers. Stop: after ``warmup_s + duration_s`` and at least
    ``min_measured`` measured sends (plus the measured requests' completion), after ``max_requests`` measured sends, or when a one-pass
    workload runs out (a workload repeats with fresh prompts when ``duration_s`` or
    ``max_requests`` asks for more than one pass).

    Args:
        url: The server's base URL, e.g. ``http://127.0.0.1:30000``.
        workload: What to send (:func:`tuner.load.workloads.build_workload`).
        concurrency: Closed-loop workers, or the in-flight cap of an open loop.
        rate: Mean arrival rate, requests/s (open loop).
        burstiness: Gamma shape of the inter-arrival times (1.0 = Poisson).
        warmup_s: Seconds of load excluded from the summary at the start.
        duration_s: Length of the measured window (s).
        max_requests: Measured requests to send.
        cooldown_s: Seconds of extra (unmeasured) load while the measured requests finish.
        min_measured: Sends the measured window must hold before ``duration_s`` ends it (default:
            ``concurrency`` in a closed loop, 1 in an open one; 0 ends it on time alone). In a closed loop the warm-up's
            requests hold every worker until they finish, so a timed window shorter than one E2E
            latency would otherwise start none (bench_serving excludes warm-up requests, §6.1).
        api: ``generate`` (``/generate``) or ``completions`` (``/v1/completions``).
        slo: Latency limits for goodput, attainment and violations.
        on_tick: Called about every ``tick_s`` with :class:`LiveStats`; returning ``True`` stops
            the run at once (in-flight requests become ``incomplete``).
        request_timeout_s: Limit per request, send to end of stream.
        timeout_s: Limit for the whole run after the server check; hitting it marks the result
            ``partial`` (``stop_reason`` says when the window was still waiting for ``min_measured``).
        seed: Seed of the arrival process.
        model: ``model`` field for ``completions`` (default: asked from ``/v1/models``).
        tick_s: Interval between ``on_tick`` calls (s).
        check_timeout_s: Limit for the 1-token server check before the run.
        transport: ``raw`` (the client's own HTTP/1.1 connections, least CPU per token) or
            ``aiohttp``; ``https://`` URLs always use aiohttp (:class:`StreamClient`).
        ramp_s: Closed loop: the workers start staggered over this many seconds (worker ``i`` of
            ``concurrency`` at ``i × ramp_s / concurrency``), as sessions arrive one after another;
            0 starts them together. Put the ramp inside ``warmup_s`` to keep it out of the window
            (:mod:`tuner.load.steady` does).

    Returns:
        The :class:`LoadResult`; its ``summary`` covers the measured window only.

    Raises:
        LoadError: Bad arguments, or the server is down or not an SGLang server before the start
            (a crash during the run returns a ``partial`` result instead).
    """
    _validate(workload, concurrency, rate, duration_s, max_requests, request_timeout_s, timeout_s)
    if not ramp_s >= 0:
        raise LoadError(f"--ramp {ramp_s:g} s is out of range", hint="use --ramp >= 0 seconds")
    if min_measured is None:
        closed = rate is None and not workload.has_arrivals
        min_measured = (max(1, concurrency or 1) if closed else 1) if duration_s is not None else 0
    plan = PhasePlan(warmup_s=warmup_s, duration_s=duration_s, max_requests=max_requests, cooldown_s=cooldown_s,
                     min_measured=min_measured)
    one_pass = duration_s is None and max_requests is None
    async with StreamClient(
        url, api=api, max_connections=concurrency or 0, request_timeout_s=request_timeout_s, model=model,
        transport=transport,
    ) as client:
        await client.check(timeout_s=check_timeout_s)
        run = _Run(
            client, workload, plan, concurrency=concurrency, rate=rate, burstiness=burstiness, seed=seed,
            one_pass=one_pass, on_tick=on_tick, tick_s=tick_s, timeout_s=timeout_s, ramp_s=ramp_s,
        )
        stopped_early, reason, partial = await run.execute()
    records = sorted(run.records, key=lambda r: r.send_time_s)
    measured = [r for r in records if r.phase == "measure"]
    start = run.phase_start.get("measure", plan.warmup_s)
    ends = [r.end_time_s for r in measured if r.end_time_s is not None]
    end = max(ends) if ends else (plan.measure_end_s or run.now())
    return LoadResult(
        summary=summarize(measured, max(end - start, 0.0), slo),
        records=records,
        phases=run.phases(run.now()),
        live=run.live,
        workload=workload.describe(),
        settings={
            "url": client.base_url, "api": api, "concurrency": concurrency, "rate": rate, "burstiness": burstiness,
            "warmup_s": warmup_s, "ramp_s": ramp_s, "duration_s": duration_s, "max_requests": max_requests, "cooldown_s": cooldown_s,
            "min_measured": min_measured,
            "mode": "open" if rate else ("trace" if workload.has_arrivals else "closed"),
            "transport": client.transport,
            "t0_monotonic_s": run.t0,
            "slo": slo.model_dump() if slo is not None else None,
        },
        stopped_early=stopped_early,
        stop_reason=reason,
        partial=partial,
    )


_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_sync(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` in a new event loop: uvloop's when installed (cheaper per streamed chunk), else asyncio's.

    SIGINT and SIGTERM keep their meaning while the loop runs: the process's Python handlers (the
    session's, which raise ``KeyboardInterrupt`` so the service is restored) are called from the
    loop's own signal handling, not wherever the signal lands. Left to Python, a handler that
    raises inside a transport callback is taken by uvloop as that connection's error: the request
    fails and the load goes on, and a ``tuner run`` told to stop keeps tuning. The handlers are
    put back as they were when the loop ends.

    Raises:
        KeyboardInterrupt: From the process's handler of a signal received meanwhile.
    """
    box: list[T] = []
    main_thread = threading.current_thread() is threading.main_thread()  # signals reach only the main thread
    handlers = {signum: signal.getsignal(signum) for signum in _FORWARDED_SIGNALS} if main_thread else {}
    previous = {signum: handler for signum, handler in handlers.items() if callable(handler)}

    async def keep() -> None:
        loop = asyncio.get_running_loop()
        for signum, handler in previous.items():
            loop.add_signal_handler(signum, handler, signum, None)
        # The main task returns None: at shutdown Python 3.11 may repr() the main task, which
        # would format a whole LoadResult (seconds for a large run).
        box.append(await main)

    try:
        import uvloop
    except ImportError:
        runner: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(keep())
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return box[0]


def run_load_sync(url: str, workload: Workload, **kwargs: Any) -> LoadResult:
    """:func:`run_load` for callers without an event loop (same arguments, same errors)."""
    return run_sync(run_load(url, workload, **kwargs))
