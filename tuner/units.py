"""Units the config and the CLI share: durations (``4h``, ``90m``, ``1h30m``), GiB, a daily window
of local time (``[service] window``), and the non-empty text every string key and option takes.

Lowest layer with :mod:`tuner.errors`: it imports nothing else of the product.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated

from pydantic import AfterValidator

from tuner.errors import ConfigError

__all__ = ["GIB", "parse_duration_s", "format_duration", "MaintenanceWindow", "non_empty", "NonEmptyStr", "EMPTY_TEXT"]

GIB = float(2**30)
"""Bytes in a GiB (binary; SGLang logs memory in GB meaning GiB, ``sglang-reference.md`` §4.2)."""

EMPTY_TEXT = "is empty (give a value, or leave it out for its default)"
"""What :func:`non_empty` says of an empty value; the config and the CLI put the key's or the
option's name before it."""


def non_empty(value: str) -> str:
    """A string key's or option's value, refused when empty or only whitespace: ``--budget ''``,
    ``[storage] url = ""`` or ``--systemctl ''`` were read as "not given" (the default used, exit 0)
    or ran as an empty command. The one rule of :data:`NonEmptyStr` (the config's string keys) and
    of the CLI's string options (typer's ``parser=``, :mod:`tuner.cli.common`).

    Returns:
        ``value`` unchanged.

    Raises:
        ValueError: The value is empty, or holds a NUL character (pydantic and click name the key
            or option before it).
    """
    if not value.strip():
        raise ValueError(EMPTY_TEXT)
    if "\x00" in value:  # no path, argument or URL holds one (a ValueError deep in open() or exec)
        raise ValueError("holds a NUL character (\\x00), which no path, argument or URL can hold")
    return value


NonEmptyStr = Annotated[str, AfterValidator(non_empty)]
"""A config string that may not be empty or blank (:func:`non_empty`)."""

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


_SPAN = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


@dataclass(frozen=True)
class MaintenanceWindow:
    """A daily window of local time (``02:00-05:00``; ``22:00-04:00`` wraps midnight) in which the
    tuner restarts the service: a trial starts only when it and the final restore fit before it
    closes (:class:`tuner.study.stops.Window`).

    Attributes:
        start_min: Its first minute of the day (0-1439).
        end_min: The minute it closes (exclusive; equal to ``start_min``: the whole day).
        text: As written.
    """

    start_min: int
    end_min: int
    text: str

    @classmethod
    def parse(cls, text: str) -> MaintenanceWindow:
        """``"HH:MM-HH:MM"``; ``"00:00-24:00"`` is the whole day.

        Raises:
            ValueError: Not two times of day joined by ``-``, or the same time twice (an empty
                window; the config names the key).
        """
        m = _SPAN.match(text)
        if m is None:
            raise ValueError(f"{text!r} is not HH:MM-HH:MM (e.g. \"02:00-05:00\")")
        h1, m1, h2, m2 = (int(g) for g in m.groups())
        if h1 > 23 or h2 > 24 or m1 > 59 or m2 > 59 or (h2 == 24 and m2 != 0):
            raise ValueError(f"{text!r} holds a time that is not a time of day (00:00-24:00)")
        if (h1, m1) == (h2 % 24, m2) and (h1, m1, h2) != (0, 0, 24):  # "00:00-24:00" is the whole day
            raise ValueError(f"{text!r} opens and closes at the same time: an empty window (write \"00:00-24:00\" "
                             "for the whole day, or leave window out)")
        return cls(start_min=h1 * 60 + m1, end_min=(h2 * 60 + m2) % 1440, text=text.strip())

    def contains(self, when: datetime) -> bool:
        """Whether a restart may start at ``when`` (local time)."""
        minute = when.hour * 60 + when.minute
        if self.start_min == self.end_min:
            return True
        if self.start_min < self.end_min:
            return self.start_min <= minute < self.end_min
        return minute >= self.start_min or minute < self.end_min

    def seconds_until_close(self, when: datetime) -> float:
        """Seconds from ``when`` until the window closes (0 when it is closed; ``inf`` for a window
        of the whole day)."""
        if not self.contains(when):
            return 0.0
        if self.start_min == self.end_min:
            return float("inf")
        closes = when.replace(hour=self.end_min // 60, minute=self.end_min % 60, second=0, microsecond=0)
        if closes <= when:
            closes += timedelta(days=1)
        return (closes - when).total_seconds()

    def length_s(self) -> float:
        """How long the window is open each day, seconds."""
        return float(((self.end_min - self.start_min) % 1440 or 1440) * 60)

    def seconds_since_close(self, when: datetime) -> float:
        """Seconds from the window's last close until ``when`` (0 while it is open)."""
        if self.contains(when):
            return 0.0
        closed = when.replace(hour=self.end_min // 60, minute=self.end_min % 60, second=0, microsecond=0)
        if closed > when:
            closed -= timedelta(days=1)
        return (when - closed).total_seconds()

    def seconds_until_open(self, when: datetime) -> float:
        """Seconds from ``when`` until the window is open (0 when it is)."""
        if self.contains(when):
            return 0.0
        opens = when.replace(hour=self.start_min // 60, minute=self.start_min % 60, second=0, microsecond=0)
        if opens <= when:
            opens += timedelta(days=1)
        return (opens - when).total_seconds()
