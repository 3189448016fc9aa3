"""The wall-clock budget of a tuning run: parse it, estimate what a trial costs, decide what fits.

A trial on a production box costs a restart (minutes for a large model) plus its load phases, so
the run never starts a trial that cannot finish inside the budget. The cost of the next trial is
estimated from the study's own history (the durations of the trials already run, restarts and
load included); before any history exists, from the configured start timeout and load phases.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict

from tuner.errors import ConfigError

__all__ = ["parse_duration_s", "format_duration", "require_one_trial", "TrialCostEstimate", "Budget"]

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(h|m|s)", re.IGNORECASE)
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration_s(text: str | float | int, *, name: str = "--budget") -> float:
    """Parse a duration such as ``4h``, ``90m``, ``1h30m`` or ``45s``.

    A bare number (``3``) is an error, not seconds: ``--budget 3`` meant as hours or minutes would
    otherwise end the run before its first trial. A Python number is taken as seconds.

    Args:
        text: The duration text (case-insensitive units ``h``, ``m``, ``s``), or seconds.
        name: The option or key the text came from, named in the error.

    Returns:
        The duration in seconds (> 0).

    Raises:
        ConfigError: The text is not a duration (a bare number included), or is not positive.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        raw = str(text).strip().replace(" ", "")
        if re.fullmatch(r"\d+(?:\.\d+)?", raw):
            raise ConfigError(
                f"{name} {text!r} has no unit",
                hint=f"write {raw}h, {raw}m or {raw}s (e.g. 4h, 90m, 1h30m)",
            )
        parts = _DURATION_RE.findall(raw)
        if not parts or "".join(f"{n}{u}" for n, u in parts).lower() != raw.lower():
            raise ConfigError(
                f"{name} {text!r} is not a duration",
                hint="write it like 4h, 90m, 1h30m or 45s",
            )
        seconds = sum(float(n) * _UNIT_S[u.lower()] for n, u in parts)
    if seconds <= 0:
        raise ConfigError(f"{name} {text!r} must be longer than zero", hint="give e.g. 4h or 30m")
    return seconds


def format_duration(seconds: float) -> str:
    """Format seconds as ``1h05m``, ``4m30s`` or ``12s`` for progress lines."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def require_one_trial(total_s: float, cost_s: float, *, reserve_s: float = 0.0, name: str = "--budget") -> None:
    """Refuse a budget too short for even one trial (it would stop before doing anything).

    Args:
        total_s: The whole budget in seconds.
        cost_s: The estimated cost of one trial in seconds (see :meth:`Budget.estimate`).
        reserve_s: Seconds kept back for restoring the service.
        name: The option or key the budget came from, named in the error.

    Raises:
        ConfigError: ``total_s`` is below ``cost_s + reserve_s``; the message names the minimum,
            rounded up to whole minutes.
    """
    needed_s = cost_s + reserve_s
    if total_s >= needed_s:
        return
    minimum = f"{max(1, math.ceil(needed_s / 60.0))}m"
    raise ConfigError(
        f"{name} {format_duration(total_s)} is shorter than one trial (about {format_duration(needed_s)}: "
        "restart, warm-up, measure and stress phases)",
        hint=f"give at least {name} {minimum}",
    )


class TrialCostEstimate(BaseModel):
    """What the next trial is expected to cost.

    Attributes:
        seconds: Expected wall-clock seconds of one trial (restart, probe, load phases, record).
        source: ``history`` (from trials already run) or ``prior`` (from the configured timeouts).
        samples: How many past trials the estimate rests on.
    """

    model_config = ConfigDict(frozen=True)

    seconds: float
    source: str
    samples: int


class Budget:
    """A wall-clock budget that started when the run started.

    Args:
        total_s: The whole budget in seconds, or ``None`` for no time limit (``--trials`` only).
        reserve_s: Seconds kept back at the end for restoring the service.
        clock: A monotonic clock in seconds (injectable for tests).
    """

    def __init__(
        self,
        total_s: float | None,
        *,
        reserve_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_s = total_s
        self.reserve_s = reserve_s
        self._clock = clock
        self._started = clock()

    def elapsed_s(self) -> float:
        """Seconds since the run started."""
        return self._clock() - self._started

    def remaining_s(self) -> float:
        """Seconds left for trials (budget minus elapsed minus the restore reserve); inf if unbounded."""
        if self.total_s is None:
            return float("inf")
        return self.total_s - self.elapsed_s() - self.reserve_s

    @staticmethod
    def estimate(durations_s: Sequence[float], prior_s: float) -> TrialCostEstimate:
        """Estimate the cost of the next trial from past trial durations.

        Uses the upper of the median and the mean of the last five full trials, so one slow
        restart raises the estimate but one quick failure does not lower it much. A trial that
        failed at startup costs less than a measured one; those short ones are ignored once
        longer ones exist.

        Args:
            durations_s: Durations of finished trials in this study and this environment, in order.
            prior_s: The estimate to use with no history (start timeout share plus load phases).

        Returns:
            The estimate and its source.
        """
        usable = [d for d in durations_s if d and d > 0]
        if not usable:
            return TrialCostEstimate(seconds=prior_s, source="prior", samples=0)
        longest = max(usable)
        full = [d for d in usable if d >= 0.5 * longest][-5:]
        seconds = max(statistics.median(full), statistics.fmean(full))
        return TrialCostEstimate(seconds=seconds, source="history", samples=len(full))

    def fits(self, cost_s: float) -> bool:
        """Whether a trial expected to take ``cost_s`` seconds can finish inside the budget."""
        return cost_s <= self.remaining_s()

    def trials_left(self, cost_s: float) -> int | None:
        """About how many more trials of ``cost_s`` fit (``None`` when the budget is unbounded)."""
        remaining = self.remaining_s()
        if remaining == float("inf"):
            return None
        return max(0, int(remaining // max(cost_s, 1e-9)))
