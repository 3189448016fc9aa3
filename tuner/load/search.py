"""Highest load under an SLO: doubling then bisection on concurrency or rate, judged with a confidence interval.

Each level is a short :func:`tuner.load.runner.run_load` (warm-up + measured window). Its SLO
attainment (the share of finished requests meeting every per-request limit, see
:class:`tuner.load.metrics.SLO`) gets a Wilson score interval at ``confidence``:

* lower bound ≥ ``target_attainment`` → ``pass``;
* upper bound < ``target_attainment`` → ``fail``;
* otherwise ``indeterminate``: the window held too few requests for its attainment. The level
  is re-run once with a window long enough for the requests :func:`wilson_min_requests` says the
  interval needs (at least twice the first, at most what the budget leaves); if it still
  straddles the target it bounds the search, and is reported as such, naming the requests and
  the ``--duration`` a decision needs, rather than as a number the data do not support.

The arithmetic, two-sided at 95 % (z = 1.96): n requests that all meet the SLO give a Wilson
lower bound of n / (n + z²), so showing ≥ 90 % needs n ≥ 0.9·z² / 0.1 = 34.6, i.e. 35 requests;
23 of 23 gives [85.7 %, 100 %] and cannot be told from 90 % (nor can it one-sided: 89.5 %).

Open loop (``knob="rate"``) also watches for over-saturation: when the requests in flight grow
during the measured window faster than a fifth of the offered rate (the server serves under
~80 % of it), the level is ``saturated`` (a fail, stopped early when it is plain) whatever its
latencies. The whole search is bounded by ``time_budget_s``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from statistics import NormalDist
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tuner.errors import LoadError
from tuner.load.client import Api, Transport
from tuner.load.metrics import SLO, LoadSummary, slo_violations
from tuner.load.runner import LiveStats, LoadResult, run_load, run_sync
from tuner.load.steady import SteadyWindow
from tuner.load.workloads import MultiTurnSpec, RandomSpec, SharedPrefixSpec, TraceSpec, Workload, build_workload
from tuner.records import CapacityBasis, SloCapacity, SloStep

__all__ = [
    "Verdict",
    "SearchStep",
    "MaxLoadResult",
    "wilson_interval",
    "wilson_min_requests",
    "find_max_under_slo",
    "find_max_under_slo_async",
    "bisect_level",
    "bracket_level",
    "context_slo",
    "judge_contexts",
    "slo_capacity",
]

Verdict = Literal["pass", "fail", "indeterminate", "saturated", "aborted"]
_MIN_SATURATION_TICKS = 5
_GROWTH_SHARE = 0.2
_RERUN_MARGIN = 1.25  # the re-run window aims at this many times the requests the interval needs


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion.

    Args:
        successes: Requests that met the SLO.
        n: Requests judged (completed + errored).
        confidence: Two-sided confidence level, e.g. 0.95.

    Returns:
        ``(low, high)`` in [0, 1]; ``(0.0, 1.0)`` when ``n == 0``.
    """
    if n <= 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def wilson_min_requests(attainment: float, target: float, confidence: float = 0.95) -> int | None:
    """Fewest requests whose Wilson interval at ``attainment`` excludes ``target`` (or touches it).

    The Wilson interval holds every t with (p − t)² ≤ z²·t(1 − t)/n, so the target leaves it once
    n ≥ z²·t(1 − t)/(p − t)²; e.g. all requests meeting the SLO against a 90 % target at 95 %
    confidence needs 35.

    Args:
        attainment: Observed share of requests meeting the SLO, p in [0, 1].
        target: Target attainment t in (0, 1).
        confidence: Two-sided confidence level of the interval.

    Returns:
        The number of requests n, or ``None`` when ``attainment == target`` (no n decides).
    """
    if attainment == target:
        return None
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    return max(1, math.ceil(z * z * target * (1 - target) / (attainment - target) ** 2 - 1e-9))


def bisect_level(lo: float, hi: float, *, integer: bool = True, rtol: float = 0.1) -> float | None:
    """The search's next level between a passing ``lo`` and a failing ``hi`` (their midpoint,
    floored for a count), or ``None`` once the bracket is within ``rtol`` of ``lo`` (1 for a count)."""
    if hi - lo <= max(1.0 if integer else 0.0, rtol * lo):
        return None
    return float(math.floor((lo + hi) / 2)) if integer else (lo + hi) / 2


def bracket_level(met: int | None, broken: int, overshoot: float | None) -> int | None:
    """The next count of a bracketing step below a count that broke the SLO: the broken count
    scaled by its overshoot (latency taken as proportional to the requests in flight, as a queue
    of prefills or a decode batch makes it: ``broken / (1 + overshoot)``), kept strictly inside the
    bracket ``(met, broken)``; the bisection midpoint (:func:`bisect_level`) when the overshoot is
    unknown.

    Args:
        met: The largest count measured to meet the SLO (``None``: none yet; 0 is the floor).
        broken: The smallest count measured to break it (≥ 1).
        overshoot: The worst relative overshoot at ``broken`` (``measured / limit − 1`` > 0).

    Returns:
        The count to measure next, or ``None`` when no count lies between ``met`` and ``broken``.
    """
    low = met or 0
    if broken - low <= 1:
        return None
    if overshoot is None or overshoot <= 0:
        mid = bisect_level(float(low), float(broken), integer=True, rtol=0.0)
        return None if mid is None else int(mid)
    return max(low + 1, min(broken - 1, math.floor(broken / (1.0 + overshoot))))


def context_slo(slo: SLO) -> SLO | None:
    """The limits a load of longest-context requests is judged by: the SLO's TTFT, ITL and TPOT
    limits (per token or to the first one; an E2E limit depends on the output length, which the
    stress load keeps short), or ``None`` when it sets none of them."""
    kept = SLO(ttft_ms=slo.ttft_ms, itl_ms=slo.itl_ms, tpot_ms=slo.tpot_ms)
    return None if kept.is_empty() else kept


def judge_contexts(summary: LoadSummary, contexts: int, slo: SLO) -> SloStep:
    """One load judged against ``slo`` (:func:`context_slo`): a steady window of ``contexts``
    closed-loop sessions (:mod:`tuner.load.steady`) or a burst of ``contexts`` longest prompts.

    Met when every limit holds (:func:`tuner.load.metrics.slo_violations`), something completed and
    nothing errored. The step carries the p99 TTFT / ITL / TPOT, their 95 % intervals where the
    window bounds them, and the SLO attainment with its Wilson interval (:func:`wilson_interval`).
    """
    fields = summary.model_dump()
    violations = slo_violations(slo, fields)
    met = (summary.completed > 0 and summary.errored == 0
           and all(v is not None and v <= 0 for v in violations.values()))
    judged = summary.completed + summary.errored
    low, high = ((None, None) if not judged or summary.slo_attainment is None
                 else wilson_interval(round(summary.slo_attainment * judged), judged))
    return SloStep(contexts=contexts, completed=summary.completed, p99_ttft_ms=summary.p99_ttft_ms,
                   p99_itl_ms=summary.p99_itl_ms, p99_ttft_low_ms=summary.p99_ttft_low_ms,
                   p99_ttft_high_ms=summary.p99_ttft_high_ms, p99_itl_low_ms=summary.p99_itl_low_ms,
                   p99_itl_high_ms=summary.p99_itl_high_ms, p99_tpot_ms=summary.p99_tpot_ms,
                   attainment=summary.slo_attainment, attainment_low=low, attainment_high=high,
                   violations=violations, met=met)


def slo_capacity(steps: list[SloStep], slo: SLO, *, capped: bool, basis: CapacityBasis,
                 burst: SloStep | None = None) -> SloCapacity:
    """The SLO-safe capacity from the judged steady windows (the first at the OOM-safe capacity).

    Args:
        steps: Every judged steady window, in order (empty: none judged).
        slo: The limits judged (:func:`context_slo`).
        capped: The first window ran fewer sessions than the OOM-safe capacity (``[budget]
            max_concurrency``).
        basis: The capacity the study's objective uses (:data:`tuner.records.CapacityBasis`).
        burst: The burst admission (the stress load judged by ``slo``), reported beside.

    Returns:
        ``contexts``: the largest session count that met the limits (0 when none did, ``None``
        with no window); ``broken_at``: the smallest that broke them.
    """
    limits = {f"{key}_{metric}_ms": limit for metric, key, limit in slo.items()}
    if not steps:
        return SloCapacity(limits=limits, basis=basis, burst=burst, measure="steady")
    met = [s.contexts for s in steps if s.met]
    broken = [s.contexts for s in steps if not s.met]
    return SloCapacity(limits=limits, contexts=max(met) if met else 0, broken_at=min(broken) if broken else None,
                       at_least=capped and steps[0].met, steps=steps, basis=basis, burst=burst, measure="steady")


class SearchStep(BaseModel):
    """One measured level of the search.

    ``requests_needed`` is set on an ``indeterminate`` step: the requests one window must hold, at
    this attainment, for the interval to decide (:func:`wilson_min_requests`); ``note`` says why a
    level failed or was not decided (the most common error when requests errored).
    """

    model_config = ConfigDict(frozen=True)

    value: float
    verdict: Verdict
    judged: int
    met: int
    attainment: float | None
    ci_low: float
    ci_high: float
    request_throughput: float
    output_throughput: float
    p99_ttft_ms: float | None
    p99_itl_ms: float | None
    slo_met: bool | None
    duration_s: float
    requests_needed: int | None = None
    note: str | None = None

    def duration_needed_s(self) -> float | None:
        """Window (s) that would hold :attr:`requests_needed` at this step's pace, if known."""
        pace = self.judged / self.duration_s if self.duration_s > 0 else 0.0
        if self.requests_needed is None or pace <= 0:
            return None
        return self.requests_needed / pace


class MaxLoadResult(BaseModel):
    """The search's answer.

    Attributes:
        knob: ``concurrency`` or ``rate`` (requests/s).
        status: ``found`` (``value`` passed and a higher level did not), ``max_value`` (every level
            up to ``max_value`` passed), ``indeterminate`` (no level could be shown to pass or fail),
            ``none_pass`` (even ``start`` failed), ``budget`` (time ran out before any verdict),
            ``aborted`` (the server failed during a step).
        value: The highest level shown to meet the target, or ``None``.
        upper: The lowest level that did not pass (fail, saturated or indeterminate), if any.
        steps: Every level measured, in order.
        message: One line saying what was found.
    """

    model_config = ConfigDict(extra="forbid")

    knob: Literal["concurrency", "rate"]
    status: Literal["found", "max_value", "indeterminate", "none_pass", "budget", "aborted"]
    value: float | None = None
    upper: float | None = None
    target_attainment: float
    confidence: float
    slo: SLO
    steps: list[SearchStep] = Field(default_factory=list)
    elapsed_s: float = 0.0
    message: str = ""

    @property
    def answered(self) -> bool:
        """Whether the search reached an answer (``found`` or ``max_value``); ``tuner load`` exits 1 otherwise."""
        return self.status in ("found", "max_value")


class _SaturationWatch:
    """Tells over-saturation of an open-loop level: requests in flight growing with the arrivals.

    Stable, the requests in flight (+ those held by a cap) stay near ``rate × latency``; over
    capacity they grow at ``rate − capacity``. The level counts as saturated when, during the
    measured window, they grew faster than :data:`_GROWTH_SHARE` of the offered rate (so the server
    serves under ~80 % of it) over the last ticks or over the window's second half.
    """

    def __init__(self, rate: float, chained: Callable[[LiveStats], bool | None] | None) -> None:
        self.rate = rate
        self.chained = chained
        self.points: list[tuple[float, float]] = []
        self.saturated = False

    def _grew(self, first: tuple[float, float], last: tuple[float, float]) -> bool:
        growth = last[1] - first[1]
        return growth > max(8.0, _GROWTH_SHARE * self.rate * (last[0] - first[0]))

    def __call__(self, stats: LiveStats) -> bool:
        stop = bool(self.chained(stats)) if self.chained is not None else False
        if stats.phase != "measure":
            return stop
        self.points.append((stats.elapsed_s, float(stats.in_flight + stats.waiting)))
        recent = self.points[-_MIN_SATURATION_TICKS:]
        if len(recent) == _MIN_SATURATION_TICKS:
            rising = np.mean(np.diff([q for _, q in recent]) >= 0) >= 0.75
            if rising and self._grew(recent[0], recent[-1]):
                self.saturated = True
                return True
        return stop

    def saturated_at_end(self) -> bool:
        """Whether the second half of the window grew too fast (or an early stop said so)."""
        if self.saturated or len(self.points) < 3:
            return self.saturated
        return self._grew(self.points[len(self.points) // 2], self.points[-1])


def _undecided(step: SearchStep, knob: str, unit: str, target: float) -> str:
    """Why ``step`` (indeterminate) was not decided, and the ``--duration`` that would decide it."""
    text = (f"{knob} {step.value:g}{unit} met the SLO for {step.met} of {step.judged} requests "
            f"[{step.ci_low:.1%}, {step.ci_high:.1%}], which straddles {target:.0%}")
    wanted_s = step.duration_needed_s()
    if step.requests_needed is None or wanted_s is None:
        return text + "; its attainment equals the target, so no window length decides it"
    return (text + f"; the interval needs {step.requests_needed} requests in one window: "
            f"rerun with --duration {math.ceil(_RERUN_MARGIN * wanted_s)} or more (and a --time-budget several times that)")


def _judge(result: LoadResult, value: float, target: float, confidence: float, saturated: bool) -> SearchStep:
    s = result.summary
    judged = s.completed + s.errored
    met = round((s.slo_attainment or 0.0) * judged)
    low, high = wilson_interval(met, judged, confidence)
    note = None
    needed = None
    if s.top_errors:
        worst = s.top_errors[0]
        note = f"{s.errored} of {judged} requests errored, {worst.count} with: {worst.example}"
    if result.partial:
        verdict: Verdict = "aborted"
        note = result.stop_reason
    elif saturated:
        verdict = "saturated"
        note = f"requests in flight kept growing at {value:g} req/s offered (served {s.request_throughput:.3g} req/s)"
    elif judged == 0:
        verdict, note = "fail", "no request finished in the window"
    elif low >= target:
        verdict = "pass"
    elif high < target:
        verdict = "fail"
    else:
        verdict = "indeterminate"
        needed = wilson_min_requests(met / judged, target, confidence)
        note = (f"{judged} requests in the window; at {met / judged:.0%} the {confidence:.0%} interval "
                + (f"needs {needed} to tell it from {target:.0%}" if needed else f"cannot be told from {target:.0%}"))
    return SearchStep(
        value=value, verdict=verdict, judged=judged, met=met, attainment=s.slo_attainment, ci_low=low, ci_high=high,
        request_throughput=s.request_throughput, output_throughput=s.output_throughput, p99_ttft_ms=s.p99_ttft_ms,
        p99_itl_ms=s.p99_itl_ms, slo_met=s.slo_met, duration_s=s.duration, requests_needed=needed, note=note,
    )


async def find_max_under_slo_async(  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
    url: str,
    workload: Workload | RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec,
    slo: SLO,
    *,
    knob: Literal["concurrency", "rate"] = "concurrency",
    start: float = 1,
    max_value: float = 1024,
    step_duration_s: float = 30,
    warmup_s: float | None = None,
    time_budget_s: float = 600,
    target_attainment: float = 0.9,
    confidence: float = 0.95,
    rtol: float = 0.1,
    api: Api = "generate",
    seed: int = 0,
    request_timeout_s: float = 600.0,
    on_step: Callable[[SearchStep], None] | None = None,
    on_tick: Callable[[LiveStats], bool | None] | None = None,
    transport: Transport = "raw",
    ramp_s: float = 0.0,
) -> MaxLoadResult:
    """Find the highest concurrency (or rate) whose SLO attainment meets ``target_attainment``.

    Args:
        url: The server's base URL.
        workload: A built workload or a spec (built with ``seed``); an endless or repeatable one.
        slo: The latency limits; must not be empty.
        knob: ``concurrency`` (closed loop) or ``rate`` (open loop, requests/s).
        start: First level tried.
        max_value: Highest level tried.
        step_duration_s: Measured window per level (s).
        warmup_s: Warm-up per level (s); default ``min(5, step_duration_s / 5)``.
        time_budget_s: Limit for the whole search (s); a level that does not fit is not started.
        target_attainment: Share of requests that must meet the SLO (0-1).
        confidence: Confidence level of the Wilson interval.
        rtol: Bisection stops when the bracket is within ``rtol`` of the passing level.
        api: ``generate`` or ``completions``.
        seed: Seed of the workload (when a spec is given) and of the arrivals.
        request_timeout_s: Limit per request (s).
        on_step: Called after every level with its :class:`SearchStep`.
        on_tick: Passed to every level's run (live statistics; returning True stops that level).
        transport: The client transport (``raw`` or ``aiohttp``, see :class:`tuner.load.client.StreamClient`).
        ramp_s: ``concurrency``: each level's sessions start staggered over this many seconds
            before its warm-up, the steady window's ramp (:class:`tuner.load.steady.SteadyWindow`;
            at most ``step_duration_s``).

    Returns:
        The :class:`MaxLoadResult`.

    Raises:
        LoadError: Invalid arguments, an empty SLO, or a server down before the first level.
    """
    if slo.is_empty():
        raise LoadError("the search needs an SLO", hint='pass --slo "p99_ttft_ms=2000,p99_itl_ms=100"')
    if not (0 < target_attainment < 1) or not (0 < confidence < 1):
        raise LoadError(
            f"target_attainment={target_attainment}, confidence={confidence} must be in (0, 1)",
            hint="use e.g. --target-attainment 0.9 and a confidence of 0.95",
        )
    if not (0 < start <= max_value) or step_duration_s <= 0 or time_budget_s <= 0:
        raise LoadError(
            f"start={start}, max_value={max_value}, step_duration_s={step_duration_s} are invalid",
            hint="use 0 < start <= max_value and positive durations",
        )
    if ramp_s and knob != "concurrency":
        raise LoadError("--ramp staggers closed-loop sessions", hint="drop --ramp with --knob rate")
    window = SteadyWindow(duration_s=step_duration_s, ramp_s=ramp_s,
                          settle_s=min(5.0, step_duration_s / 5) if warmup_s is None else warmup_s).check()
    wl = workload if isinstance(workload, Workload) else build_workload(workload, seed=seed)
    warm = window.warmup_s
    integer = knob == "concurrency"
    began = time.monotonic()
    steps: list[SearchStep] = []

    def left() -> float:
        return time_budget_s - (time.monotonic() - began)

    async def measure(value: float, window_s: float) -> SearchStep | None:
        if left() < warm + window_s:  # a level cut by the budget's timeout gives no verdict
            return None
        watch = _SaturationWatch(value, on_tick) if knob == "rate" else None
        result = await run_load(
            url, wl,
            concurrency=int(value) if integer else None,
            rate=None if integer else value,
            warmup_s=warm, ramp_s=window.ramp, duration_s=window_s, api=api, slo=slo, seed=seed,
            cooldown_s=window.cooldown_s(request_timeout_s) if integer else 0.0,
            on_tick=watch if watch is not None else on_tick,
            request_timeout_s=request_timeout_s, timeout_s=max(left(), 1.0),
            tick_s=min(1.0, max(0.2, window_s / 10)), transport=transport,
        )
        step = _judge(result, value, target_attainment, confidence, watch is not None and watch.saturated_at_end())
        if step.verdict == "aborted" and "timeout_s" in (step.note or ""):
            return None  # the budget ran out mid-level: no verdict
        steps.append(step)
        if on_step is not None:
            on_step(step)
        return step

    async def judge(value: float) -> SearchStep | None:
        step = await measure(value, step_duration_s)
        if step is not None and step.verdict == "indeterminate":
            # Re-run once, long enough for the requests the interval needs; a window the budget
            # cannot hold would not decide either, so the first step then stands (and says why).
            wanted_s = step.duration_needed_s()
            window_s = max(2 * step_duration_s, _RERUN_MARGIN * wanted_s if wanted_s is not None else 0.0)
            again = await measure(value, window_s)
            return again or step
        return step

    lo: float | None = None
    hi: float | None = None
    hi_step: SearchStep | None = None
    status: Literal["found", "max_value", "indeterminate", "none_pass", "budget", "aborted"] | None = None
    value = float(int(start)) if integer else float(start)
    while status is None:  # doubling
        step = await judge(value)
        if step is None:
            status = "budget"
        elif step.verdict == "aborted":
            status = "aborted"
        elif step.verdict == "pass":
            lo = value
            if value >= max_value:
                status = "max_value"
            value = min(value * 2, float(max_value))
        else:
            hi, hi_step = value, step
            break
    while status is None and lo is not None and hi is not None:  # bisection
        mid = bisect_level(lo, hi, integer=integer, rtol=rtol)
        if mid is None:
            break
        step = await judge(mid)
        if step is None:
            break
        if step.verdict == "aborted":
            status = "aborted"
        elif step.verdict == "pass":
            lo = mid
        else:
            hi, hi_step = mid, step
    if status is None or (status == "budget" and lo is not None):
        if lo is not None:
            status = "found"
        elif hi_step is not None and hi_step.verdict == "indeterminate":
            status = "indeterminate"
        elif hi_step is not None:
            status = "none_pass"
        else:
            status = "budget"
    unit = "" if integer else " req/s"
    if status == "found":
        message = f"highest {knob} meeting the SLO for {target_attainment:.0%} of requests: {lo:g}{unit}"
        if hi is not None and hi_step is not None:
            message += f" ({hi:g}{unit}: {hi_step.verdict})"
            if hi_step.verdict == "indeterminate":
                message += f"; {_undecided(hi_step, knob, unit, target_attainment)}"
        else:
            message += " (the time budget ran out before a higher level was judged)"
    elif status == "max_value":
        message = f"every {knob} up to max_value {max_value:g}{unit} met the SLO"
    elif status == "indeterminate":
        assert hi_step is not None
        message = f"no level shown to pass: {_undecided(hi_step, knob, unit, target_attainment)}"
    elif status == "none_pass":
        assert hi_step is not None
        message = f"even {knob} {hi:g}{unit} misses the SLO ({hi_step.verdict}" + (
            f": {hi_step.note})" if hi_step.note else ")")
    elif status == "budget":
        message = (f"the time budget of {time_budget_s:g} s ran out before any level was judged; "
                   f"raise --time-budget or shorten --duration")
    else:
        message = f"the server failed during a level: {steps[-1].note if steps else 'unknown'}"
    return MaxLoadResult(
        knob=knob, status=status, value=lo if status in ("found", "max_value", "aborted") else None,
        upper=hi, target_attainment=target_attainment, confidence=confidence, slo=slo, steps=steps,
        elapsed_s=time.monotonic() - began, message=message,
    )


def find_max_under_slo(url: str, workload: Workload | RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec,
                       slo: SLO, **kwargs: object) -> MaxLoadResult:
    """:func:`find_max_under_slo_async` for callers without an event loop (same arguments)."""
    return run_sync(find_max_under_slo_async(url, workload, slo, **kwargs))  # type: ignore[arg-type]
