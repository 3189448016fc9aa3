"""Arrivals: when requests are sent, and which phase of a run (warm-up, measured window, cool-down) they belong to.

Three ways to pace a run:

* closed loop — ``concurrency`` workers, each sends its next request when its last one finished
  (bench_serving's ``--max-concurrency`` with ``--request-rate inf``, §6.1);
* open loop — arrivals of a gamma process with mean rate ``rate`` requests/s; ``burstiness`` 1.0
  is Poisson, lower is burstier, higher steadier (bench_serving's ``--request-rate`` and
  ``--burstiness``); an optional ``concurrency`` caps requests in flight;
* trace replay — each request's own ``arrival_s``.

A :class:`PhasePlan` labels every send: ``warmup`` before ``warmup_s``, then ``measure`` until the
window ends (after ``duration_s``, after ``max_requests`` measured sends, or when the workload runs
out), then ``cooldown``: load continues, excluded from the summary, for at most ``cooldown_s``
while the measured requests finish.

A window that ends by time also waits for ``min_measured`` sends inside it. Requests sent in
warm-up stay excluded from the summary (bench_serving's definition, §6.1), and in a closed loop
they hold every worker until they finish: with E2E latency longer than ``duration_s``, a purely
timed window would start no request at all. Extending the window until it holds ``min_measured``
sends (the concurrency, as GuideLLM's constant-concurrency benchmarks count requests per worker)
keeps every measured window measurable; the run's ``timeout_s`` bounds the wait.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal

import numpy as np

from tuner.errors import LoadError

__all__ = ["Phase", "arrival_offsets_s", "PhasePlan"]

Phase = Literal["warmup", "measure", "cooldown"]


def arrival_offsets_s(rate: float, *, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Send times (s from the start) of an open-loop arrival process, without end.

    Intervals are gamma distributed with shape ``burstiness`` and mean ``1/rate`` (Poisson when
    ``burstiness == 1``), as bench_serving draws them (§6.1). ``rate == inf`` sends everything at 0.

    Args:
        rate: Mean requests per second, > 0.
        burstiness: Gamma shape, > 0.
        seed: Seed of the draws.

    Raises:
        LoadError: ``rate`` or ``burstiness`` not > 0.
    """
    if not rate > 0 or not burstiness > 0:
        raise LoadError(
            f"rate {rate} / burstiness {burstiness} must both be > 0",
            hint="pass --rate R with R > 0 (requests/s) and --burstiness B with B > 0",
        )
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = np.random.default_rng([seed, 7])
    scale = 1.0 / (rate * burstiness)
    t = 0.0
    while True:
        for interval in rng.gamma(burstiness, scale, size=1024).tolist():
            yield t
            t += interval


class PhasePlan:
    """The phase state machine of one run; times are seconds from the run's start.

    Args:
        warmup_s: Sends before this time are ``warmup``.
        duration_s: Length of the measured window, or ``None`` (ends by count or exhaustion).
        max_requests: Measured sends after which the window ends, or ``None``.
        cooldown_s: How long sending continues after the window while measured requests finish.
        min_measured: Sends the window must hold before ``duration_s`` can end it (0: end on
            time alone).

    Raises:
        LoadError: A negative time or ``min_measured``, ``max_requests < 1``, or ``duration_s <= 0``.
    """

    def __init__(
        self,
        *,
        warmup_s: float = 0.0,
        duration_s: float | None = None,
        max_requests: int | None = None,
        cooldown_s: float = 0.0,
        min_measured: int = 0,
    ) -> None:
        bad = [f"--{name} {value:g}" for name, value, ok in (
            ("warmup", warmup_s, warmup_s >= 0), ("duration", duration_s, duration_s is None or duration_s > 0),
            ("cooldown", cooldown_s, cooldown_s >= 0)) if not ok and value is not None]
        if bad:
            raise LoadError(
                f"{', '.join(bad)} s {'is' if len(bad) == 1 else 'are'} out of range (the load window, "
                "warmup_s / duration_s / cooldown_s)",
                hint="use --warmup/--cooldown >= 0 and --duration > 0 seconds",
            )
        if max_requests is not None and max_requests < 1:
            raise LoadError(f"max_requests={max_requests} is invalid", hint="use --max-requests >= 1")
        if min_measured < 0:
            raise LoadError(f"min_measured={min_measured} is invalid", hint="use min_measured >= 0 requests")
        self.warmup_s = warmup_s
        self.duration_s = duration_s
        self.max_requests = max_requests
        self.cooldown_s = cooldown_s
        self.min_measured = min_measured
        self.measured_sent = 0
        self.measure_end_s: float | None = None
        self.sending_stopped = False

    def end_measure(self, t: float) -> None:
        """End the measured window at ``t`` (no-op when it has ended)."""
        if self.measure_end_s is None:
            self.measure_end_s = max(t, self.warmup_s)

    def waiting_for_sends(self, t: float) -> bool:
        """Whether at ``t`` the window's time is up but it holds fewer than ``min_measured`` sends."""
        return self.measure_end_s is None and self._time_up(t) and self.measured_sent < self.min_measured

    def _time_up(self, t: float) -> bool:
        return self.duration_s is not None and t >= self.warmup_s + self.duration_s

    def advance(self, t: float) -> None:
        """Apply the time-based ends: the window after ``duration_s`` (once it holds
        ``min_measured`` sends), sending after cool-down."""
        if self.measure_end_s is None and self._time_up(t) and self.measured_sent >= self.min_measured:
            # The sends were there in time (a late one ends the window itself, in phase_for_send).
            self.end_measure(self.warmup_s + self.duration_s)  # type: ignore[operator]
        if self.measure_end_s is not None and t >= self.measure_end_s + self.cooldown_s:
            self.sending_stopped = True

    def phase_for_send(self, t: float) -> Phase | None:
        """The phase of a request sent now (and count it), or ``None`` when sending is over."""
        self.advance(t)
        if self.sending_stopped:
            return None
        if self.measure_end_s is None:
            if t < self.warmup_s:
                return "warmup"
            self.measured_sent += 1
            if (self.max_requests is not None and self.measured_sent >= self.max_requests) or (
                self._time_up(t) and self.measured_sent >= self.min_measured
            ):
                self.end_measure(t)
            return "measure"
        return "cooldown"

    def current(self, t: float) -> str:
        """The phase at time ``t`` for live statistics (``drain`` once sending stopped)."""
        if self.sending_stopped:
            return "drain"
        if self.measure_end_s is None:
            return "warmup" if t < self.warmup_s else "measure"
        return "cooldown"
