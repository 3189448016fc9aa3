"""The simulator's injectable clock: real monotonic time, or virtual time that advances instantly.

The engine never reads time itself: its caller passes ``now_s`` into every step and waits out the
returned step duration on a clock. Behind the HTTP server that is :class:`RealClock` (the step
really takes that long); the offline evaluation uses :class:`VirtualClock`, which jumps ahead, so a
whole workload runs at CPU speed with the same step sequence.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "RealClock", "VirtualClock"]


class Clock(Protocol):
    """What the engine's driver needs from a clock."""

    def now_s(self) -> float:
        """Current time in seconds (arbitrary origin, monotonic)."""
        ...

    def sleep(self, duration_s: float) -> None:
        """Let ``duration_s`` seconds pass (negative values are treated as 0)."""
        ...

    async def sleep_async(self, duration_s: float) -> None:
        """Like :meth:`sleep`, for an asyncio driver."""
        ...


class RealClock:
    """Monotonic wall-clock time (``time.monotonic``); sleeping really waits."""

    def now_s(self) -> float:
        """Seconds from ``time.monotonic()``."""
        return time.monotonic()

    def sleep(self, duration_s: float) -> None:
        """Block for ``duration_s`` seconds."""
        if duration_s > 0:
            time.sleep(duration_s)

    async def sleep_async(self, duration_s: float) -> None:
        """Await ``asyncio.sleep(duration_s)``."""
        if duration_s > 0:
            await asyncio.sleep(duration_s)


class VirtualClock:
    """Simulated time: starts at ``start_s`` and moves only when told to, without waiting.

    Args:
        start_s: Initial reading, seconds.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = float(start_s)

    def now_s(self) -> float:
        """The current virtual time, seconds."""
        return self._now_s

    def sleep(self, duration_s: float) -> None:
        """Advance the virtual time by ``duration_s`` seconds at once."""
        if duration_s > 0:
            self._now_s += duration_s

    async def sleep_async(self, duration_s: float) -> None:
        """Advance like :meth:`sleep`, then yield once to the event loop."""
        self.sleep(duration_s)
        await asyncio.sleep(0)

    def advance_to(self, t_s: float) -> None:
        """Jump forward to ``t_s`` seconds (no-op if that is in the past)."""
        if t_s > self._now_s:
            self._now_s = t_s
