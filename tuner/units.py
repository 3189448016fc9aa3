"""Units the config and the CLI share: durations (``4h``, ``90m``, ``1h30m``) and GiB.

Lowest layer with :mod:`tuner.errors`: it imports nothing else of the product.
"""

from __future__ import annotations

import re

from tuner.errors import ConfigError

__all__ = ["GIB", "parse_duration_s", "format_duration"]

GIB = float(2**30)
"""Bytes in a GiB (binary; SGLang logs memory in GB meaning GiB, ``sglang-reference.md`` §4.2)."""

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


