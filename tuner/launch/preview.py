"""A trial preview (``tuner launch --set FLAG=VALUE``): settings checked against SGLang's flag table.

Each ``FLAG=VALUE`` names a ``launch_server`` flag of the unit's SGLang version (with or without
the leading ``--``; ``mem-fraction-static`` or ``mem_fraction_static``). The value is read by the
option's own type (int, float, human-readable int, JSON, switch), checked against its choices
and the ranges :func:`tuner.sglang.flags.validate` knows (``mem_fraction_static`` in (0, 1),
``max_running_requests`` ≥ 1, ...), and put into the service's command with
:func:`tuner.sglang.flags.replace_flags`, as a trial would. Nothing is started or written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from tuner.errors import ConfigError, FlagError
from tuner.launch.base import Launcher
from tuner.sglang.flags import (
    FlagOption,
    FlagTable,
    parse_human_int,
    replace_flags,
    validate,
)

__all__ = ["parse_settings", "preview"]

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _typed(opt: FlagOption, flag: str, raw: str) -> Any:
    """``raw`` as the value ``opt`` takes; FlagError naming the flag and the expected kind."""
    if opt.action == "BooleanOptionalAction" or not opt.takes_value:
        if raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise FlagError(f"{flag} is a switch, not {raw!r}", hint=f"write {flag.lstrip('-')}=true or =false")
    if not raw:  # `--set host=` would render `--host ''`, which SGLang takes as a value
        raise FlagError(f"{flag} is given no value", hint=f"write {flag.lstrip('-')}=VALUE, or leave the flag out")
    readers: dict[str, tuple[Callable[[str], Any], str]] = {"int": (int, "an integer"), "float": (float, "a number"),
               "human_readable_int": (parse_human_int, "an integer such as 4096 or 128k"),
               "loads": (json.loads, "JSON"), "json_list_type": (json.loads, "a JSON list")}
    read, kind = readers.get(opt.type or "", (str, "text"))
    words = raw.split() if opt.nargs in ("+", "*") or isinstance(opt.nargs, int) else [raw]
    try:
        values = [read(word) for word in words]
    except ValueError:
        raise FlagError(f"{flag} {raw!r} is not {kind}", hint=f"give {flag.lstrip('-')} {kind}") from None
    return values if len(words) != 1 or opt.nargs in ("+", "*") else values[0]


def parse_settings(items: Sequence[str], table: FlagTable) -> dict[str, Any]:
    """``FLAG=VALUE`` strings as typed SGLang field values, checked for this version.

    Args:
        items: E.g. ``["mem-fraction-static=0.8", "--max-running-requests=64"]``.
        table: The service's SGLang flag table.

    Returns:
        Canonical field → value, e.g. ``{"mem_fraction_static": 0.8, "max_running_requests": 64}``.

    Raises:
        ConfigError: An item is not ``FLAG=VALUE``.
        FlagError: The flag is unknown to this version (naming the nearest spelling), given twice,
            or its value is not of the option's type or choices, or outside its range (one line,
            the first problem).
    """
    params: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().lstrip("-")
        if not sep or not name:
            raise ConfigError(f"--set {item!r} is not FLAG=VALUE", hint="write --set mem-fraction-static=0.8")
        flag = "--" + name.replace("_", "-")
        opt = table.option_for_flag(flag) or table.option(name.replace("-", "_"))  # option() raises, naming the nearest
        field = table.canonical(opt.dest)
        if field in params:
            raise FlagError(f"--set names {flag} twice ({item!r} after {field}={params[field]!r})",
                            hint="give each flag once")
        params[field] = _typed(opt, flag, raw.strip())
    reasons = validate(params, table)
    if reasons:
        raise FlagError(f"--set: {reasons[0]}", hint=f"give a value SGLang {table.version} accepts")
    return params


def preview(launcher: Launcher, items: Sequence[str], table: FlagTable) -> str:
    """What a trial with the ``FLAG=VALUE`` settings would change, as the launcher's dry-run text.

    Args:
        launcher: The service's launcher (only read).
        items: ``FLAG=VALUE`` strings (see :func:`parse_settings`).
        table: The service's SGLang flag table.

    Returns:
        :meth:`Launcher.dry_run` of the service's command with the settings replaced.

    Raises:
        ConfigError: See :func:`parse_settings`.
        FlagError: See :func:`parse_settings`.
        LaunchError: The service's command cannot be read.
    """
    params = parse_settings(items, table)
    return launcher.dry_run(replace_flags(launcher.current_argv(), params, table))
