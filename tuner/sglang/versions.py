"""SGLang release versions: parsing and comparison (PEP 440, via ``packaging``).

SGLang's behaviour changes by release (``shared/sglang-reference.md`` §0, §3.2, §1.5); every
version gate in :mod:`tuner.sglang` goes through :func:`parse_version` / :func:`at_least`.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from tuner.errors import FlagError

__all__ = ["parse_version", "at_least", "release"]


def parse_version(version: str) -> Version:
    """Parse an SGLang version string (``0.5.5.post3``, ``v0.5.10``, ``0.5.23.dev4+gabc``).

    Args:
        version: The version text, as ``sglang.__version__`` or ``/get_server_info`` reports it.

    Returns:
        A comparable :class:`packaging.version.Version`.

    Raises:
        FlagError: The text is not a version.
    """
    text = version.strip().lstrip("vV")
    try:
        return Version(text)
    except InvalidVersion as err:
        raise FlagError(
            f"SGLang version {version!r} is not a version number",
            hint="pass one like 0.5.5.post3 or 0.5.23 (python -c 'import sglang; print(sglang.__version__)')",
        ) from err


def release(version: str) -> tuple[int, int, int]:
    """The ``(major, minor, micro)`` release of a version, ignoring post/dev/local parts."""
    v = parse_version(version)
    return (v.major, v.minor, v.micro)


def at_least(version: str, minimum: str) -> bool:
    """True when ``version``'s release is ``minimum``'s or newer (``0.5.5.post3`` counts as 0.5.5).

    Args:
        version: The running version.
        minimum: The release that introduced a behaviour (``"0.5.16"``).
    """
    return release(version) >= release(minimum)
