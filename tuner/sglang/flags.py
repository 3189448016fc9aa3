"""SGLang server flags by version: the option table, rendering candidates to argv, validation.

One concept: what ``python -m sglang.launch_server`` accepts in a given release. A
:class:`FlagTable` is SGLang's own argument parser, introspected (every action's option strings,
dest, action class, type, nargs, default, choices), either live in the unit's Python
(:meth:`FlagTable.from_python`) or from a bundled table (:meth:`FlagTable.for_version`; tables in
``tuner/data/`` for 0.5.5.post3, 0.5.10 and 0.5.23, ``shared/sglang-reference.md`` §3).

Callers speak SGLang field names (``mem_fraction_static``, ``cuda_graph_max_bs``,
``tp_size``); the table maps them to that version's spelling (§3.2: ``--cuda-graph-max-bs`` up to
0.5.16, ``--cuda-graph-max-bs-decode`` from 0.5.16 on; 0.5.5's ``tensor_parallel_size`` dest is
``tp_size`` in 0.5.23).
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import subprocess
from collections.abc import Mapping, Sequence
from decimal import Decimal
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict

from tuner.errors import FlagError
from tuner.sglang.versions import at_least, release

__all__ = [
    "flag_value",
    "server_args",
    "runs_simulator",
    "flag_int",
    "FlagOption",
    "FlagTable",
    "FIELD_ALIASES",
    "render",
    "replace_flags",
    "parse_argv",
    "validate",
    "unknown_flags",
    "parse_human_int",
    "check_bundled_series",
]

log = logging.getLogger(__name__)

FIELD_ALIASES: tuple[tuple[str, ...], ...] = (
    ("cuda_graph_max_bs", "cuda_graph_max_bs_decode"),
    ("cuda_graph_bs", "cuda_graph_bs_decode"),
    ("tp_size", "tensor_parallel_size"),
    ("dp_size", "data_parallel_size"),
    ("pp_size", "pipeline_parallel_size"),
)
"""Groups of field names that mean one knob across versions; the first is the canonical name
the tuner uses (§3.2)."""

_ALIAS_OF = {name: group for group in FIELD_ALIASES for name in group}
_ZERO_ARG_ACTIONS = {"_StoreTrueAction", "_StoreFalseAction", "_StoreConstAction", "_CountAction", "BooleanOptionalAction"}
_BUNDLED = ("0.5.5.post3", "0.5.10", "0.5.23")

# Runs in the unit's own Python: SGLang's parser, introspected as in shared/sglang-flags/.
_INTROSPECT = r"""
import argparse, json, sys
import sglang
try:
    from sglang.srt.server_args import ServerArgs
except Exception as err:
    sys.stderr.write("cannot import sglang.srt.server_args: %r\n" % (err,)); sys.exit(3)
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
def _name(t):
    return None if t is None else getattr(t, "__name__", type(t).__name__)
def _plain(v):
    try:
        json.dumps(v); return v
    except TypeError:
        return repr(v)
opts = []
for a in parser._actions:
    if not a.option_strings or a.dest == "help":
        continue
    opts.append({"flags": list(a.option_strings), "dest": a.dest, "action": type(a).__name__,
                 "type": _name(a.type), "nargs": a.nargs, "default": _plain(a.default),
                 "choices": list(a.choices) if a.choices is not None else None,
                 "deprecated": bool(getattr(a, "deprecated", False))})
print(json.dumps({"sglang_version": getattr(sglang, "__version__", None), "options": opts}))
"""


class FlagOption(BaseModel):
    """One option of SGLang's argument parser (the shape of ``shared/sglang-flags/*.json``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    flags: list[str]
    dest: str
    action: str
    type: str | None = None
    nargs: int | str | None = None
    default: Any = None
    choices: list[Any] | None = None
    deprecated: bool = False

    @property
    def takes_value(self) -> bool:
        """False for store_true-like actions (no value token)."""
        return not (self.action in _ZERO_ARG_ACTIONS or self.nargs == 0)

    @property
    def is_deprecated(self) -> bool:
        """Marked deprecated by SGLang (flag or a ``Deprecated*Action``)."""
        return self.deprecated or self.action.startswith("Deprecated")


class FlagTable:
    """The launch_server options of one SGLang version.

    Attributes:
        version: The SGLang version this table stands for (the installed or requested one).
        table_version: The version the options were read from (a bundled table may be older
            than ``version``: the nearest bundled table ≤ version).
        options: Every option.
    """

    def __init__(self, version: str, options: Sequence[FlagOption], *, table_version: str | None = None) -> None:
        self.version = version
        self.table_version = table_version or version
        self.options = list(options)
        self._by_dest = {o.dest: o for o in self.options}
        self._by_flag = {f: o for o in self.options for f in o.flags}

    def __repr__(self) -> str:
        return f"FlagTable(version={self.version!r}, table_version={self.table_version!r}, options={len(self.options)})"

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, version: str | None = None) -> FlagTable:
        """Build from the JSON shape of ``shared/sglang-flags/flags-<v>.json``.

        Raises:
            FlagError: The data has no ``options`` list.
        """
        if not isinstance(data.get("options"), list):
            raise FlagError("flag table has no 'options' list", hint="use the output of SGLang's parser introspection")
        table_version = str(data.get("sglang_version") or version or "0")
        return cls(version or table_version, [FlagOption(**o) for o in data["options"]], table_version=table_version)

    @classmethod
    def bundled_versions(cls) -> list[str]:
        """Versions of the bundled tables, oldest first."""
        return list(_BUNDLED)

    @classmethod
    def for_version(cls, version: str) -> FlagTable:
        """The nearest bundled table at or below ``version`` (the oldest when it is older).

        Args:
            version: The installed SGLang version (``0.5.16``, ``0.5.5.post3``).

        Returns:
            A table whose :attr:`version` is ``version`` and :attr:`table_version` the bundled one.

        Raises:
            FlagError: ``version`` is not a version number.
        """
        wanted = release(version)
        older = [v for v in _BUNDLED if release(v) <= wanted]
        chosen = older[-1] if older else _BUNDLED[0]
        if not older:
            log.warning("SGLang %s is older than every bundled flag table; using %s", version, chosen)
        text = resources.files("tuner.data").joinpath(f"flags-{chosen}.json").read_text()
        return cls.from_json(json.loads(text), version=version)

    @classmethod
    def from_python(cls, python: str, *, timeout_s: float = 120.0, env: Mapping[str, str] | None = None) -> FlagTable:
        """Ask the installed SGLang's own parser, in the interpreter the unit runs (§0, §3).

        Args:
            python: Path of that Python interpreter (the unit's ``ExecStart`` interpreter).
            timeout_s: Limit for importing SGLang and dumping its parser.
            env: Environment for the interpreter (default: inherited).

        Returns:
            The live table; :attr:`version` is ``sglang.__version__``.

        Raises:
            FlagError: The interpreter cannot run, ``sglang`` is not importable there, or the
                introspection timed out or printed something unreadable.
        """
        try:
            # The script on standard input: a program that is not Python (`--python /bin/ls`) then
            # says so about "-", not with the whole script in its error line.
            proc = subprocess.run(
                [python, "-"], input=_INTROSPECT, capture_output=True, text=True, timeout=timeout_s,
                env=dict(env) if env is not None else None, check=False,
            )
        except FileNotFoundError as err:
            raise FlagError(f"python interpreter {python} not found", hint="pass the interpreter of the unit's ExecStart") from err
        except subprocess.TimeoutExpired as err:
            raise FlagError(f"reading SGLang's flags with {python} took longer than {timeout_s:.0f} s", hint="raise the timeout or pass --sglang-version to use a bundled table") from err
        except OSError as err:
            raise FlagError(f"cannot run python interpreter {python}: {err.strerror}", hint="pass the interpreter of the unit's ExecStart") from err
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise FlagError(f"sglang is not importable with {python}: {last}", hint="pass the Python that runs the SGLang unit, or an SGLang version to use a bundled table")
        try:
            data = json.loads(proc.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError) as err:
            raise FlagError(f"SGLang parser introspection with {python} printed no JSON", hint="check that this interpreter runs SGLang") from err
        return cls.from_json(data)

    # -- lookups ------------------------------------------------------------------------------

    def has(self, flag_or_field: str) -> bool:
        """True when this version accepts ``--flag`` (exact spelling) or the field (any alias)."""
        if flag_or_field.startswith("-"):
            return flag_or_field in self._by_flag
        return self._resolve_dest(flag_or_field) is not None

    def _resolve_dest(self, field: str) -> str | None:
        if field in self._by_dest and not (self._by_dest[field].is_deprecated and self._alias_dest(field)):
            return field
        return self._alias_dest(field) or (field if field in self._by_dest else None)

    def _alias_dest(self, field: str) -> str | None:
        for name in _ALIAS_OF.get(field, ()):
            if name != field and name in self._by_dest and not self._by_dest[name].is_deprecated:
                return name
        return None

    def option(self, field: str) -> FlagOption:
        """The option for an SGLang field name (aliases resolved, non-deprecated spelling preferred).

        Raises:
            FlagError: This version has no such option; the message names the nearest spelling.
        """
        dest = self._resolve_dest(field)
        if dest is None:
            raise self._unknown(field)
        return self._by_dest[dest]

    def option_for_flag(self, flag: str) -> FlagOption | None:
        """The option an argv token ``--flag`` selects: the exact spelling, another version's
        spelling of the same knob (``--cuda-graph-max-bs`` ↔ ``--cuda-graph-max-bs-decode``), or
        argparse's unique-prefix match (``--tp`` → ``--tp-size``); ``None`` when unknown or
        ambiguous."""
        if flag in self._by_flag:
            return self._by_flag[flag]
        field = flag[2:].replace("-", "_")
        if field in _ALIAS_OF and (dest := self._resolve_dest(field)) is not None:
            return self._by_dest[dest]  # an older or newer spelling of one knob (§3.2)
        matches = {o.dest: o for f, o in self._by_flag.items() if f.startswith(flag) and flag.startswith("--")}
        return next(iter(matches.values())) if len(matches) == 1 else None

    def _unknown(self, name: str) -> FlagError:
        flag = name if name.startswith("-") else "--" + name.replace("_", "-")
        near = difflib.get_close_matches(flag, list(self._by_flag), n=1, cutoff=0.6)
        hint = f"the nearest spelling in {self.version} is {near[0]}" if near else f"check `python -m sglang.launch_server --help` of {self.version}"
        return FlagError(f"SGLang {self.version} has no flag {flag}", hint=hint)

    def canonical(self, dest: str) -> str:
        """The tuner's field name for a version-specific dest (``tensor_parallel_size`` → ``tp_size``)."""
        return _ALIAS_OF.get(dest, (dest,))[0]


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------

_HUMAN = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")
_HUMAN_SCALE = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def check_bundled_series(version: str, *, name: str, fix: str) -> None:
    """Refuse a version outside the release series of the bundled flag tables (``9.9.9``,
    ``0.6.0``): nothing bundled says what its flags or defaults are, and :meth:`FlagTable.for_version`
    would read it with the newest table. A newer patch release of a bundled series (``0.5.24``) is
    read with the series' newest table. The one rule of ``tuner upgrade-check --version`` and
    ``[service] sglang_version``.

    Args:
        version: The version given.
        name: The option or key it came from (``--version``, ``[service] sglang_version``).
        fix: What to do instead (the error's hint).

    Raises:
        FlagError: Naming ``name``, the version and the bundled tables; or ``version`` is not a
            version number.
    """
    bundled = FlagTable.bundled_versions()
    if release(version)[:2] not in {release(v)[:2] for v in bundled}:
        raise FlagError(f"{name} {version} is outside the bundled flag tables' series ({', '.join(bundled)})",
                        hint=fix)


def server_args(argv: Sequence[str], marker: str) -> list[str] | None:
    """The words after the program that reads the server's flags in a command line.

    ``marker`` is the module (``"sglang.launch_server"`` or ``"tuner.sim"``): ``-m MODULE``, a
    path ending in it, or its CLI form (``sglang serve``, ``tuner sim serve``).

    Returns:
        The flags after it; ``None`` when the command does not run ``marker`` (a wrapper's own
        flags, ``docker run --gpus``, are not the server's).
    """
    words = list(argv)
    for i, word in enumerate(words):
        if word == marker or word.endswith("/" + marker):
            return words[i + 1:]
        if word == "serve" and i and words[i - 1].rsplit("/", 1)[-1] in (marker.split(".")[0], "sim"):
            return words[i + 1:]
    return None


def runs_simulator(argv: Sequence[str]) -> bool:
    """Whether a service command runs this project's SGLang simulator (:mod:`tuner.sim`:
    ``python -m tuner.sim ...`` or ``tuner sim serve ...``), the one rule every reader uses."""
    return server_args(argv, "tuner.sim") is not None


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The value a server command line gives a flag, read as argparse reads it, without a flag table.

    ``--flag value`` or ``--flag=value``, under any of ``names`` (one option's spellings, e.g.
    ``"--tp-size", "--tp", "--tensor-parallel-size"``); the last occurrence wins, as for the
    store actions of SGLang's and the simulator's parsers. Only the exact spellings given are
    read: argparse's unique prefixes and another version's spelling need the version's table,
    and :func:`parse_argv` reads a whole command that way, typed.

    Args:
        argv: The command (``ExecStart``'s words, or only its flags).
        names: The flag's spellings, each with its leading ``--``.

    Returns:
        The value as written, or ``None`` when no spelling is given one (absent, or the last
        word with nothing after it).
    """
    value = None
    for i, word in enumerate(argv):
        for name in names:
            if word == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif word.startswith(name + "="):
                value = word.split("=", 1)[1]
    return value


def flag_int(argv: Sequence[str], *names: str) -> int | None:
    """:func:`flag_value` as an integer, as SGLang's ``type=int`` options read it (``--page-size
    64``, ``--tp=4``).

    Returns:
        The integer, or ``None`` when the flag has no value or one that is not an integer (a
        command SGLang refuses to start with).
    """
    value = flag_value(argv, *names)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def parse_human_int(text: str) -> int:
    """Parse SGLang's ``human_readable_int`` exactly as SGLang does (§3.2; ``srt/utils/common.py``
    of 0.5.10 and 0.5.23): SI suffixes ``k M G T`` and IEC suffixes ``Ki Mi Gi Ti``, case-sensitive
    (``16K`` is rejected), decimals with SI suffixes only (``25.6k``), else a plain integer.

    Raises:
        ValueError: Not such a number.
    """
    value = text.strip()
    m = _HUMAN.fullmatch(value)
    if m:
        number, suffix = m.groups()
        if suffix.endswith("i") and "." in number:
            raise ValueError(f"not a human-readable int: {text!r} (decimals are not allowed with IEC suffixes)")
        if suffix.endswith("i"):
            return int(number) * _HUMAN_SCALE[suffix]
        return int(Decimal(number) * _HUMAN_SCALE[suffix])
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"not a human-readable int: {text!r} (suffixes are case-sensitive: 1k, 1M, 1Ki, 1Mi)") from None


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        text = f"{value:.6f}".rstrip("0").rstrip(".")
        return text if text not in ("", "-0") else "0"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _convert(opt: FlagOption, raw: str) -> Any:
    try:
        if opt.type == "int":
            return int(raw)
        if opt.type == "float":
            return float(raw)
        if opt.type == "human_readable_int":
            return parse_human_int(raw)
        if opt.type in ("loads", "json_list_type"):
            return json.loads(raw)
    except ValueError:
        return raw
    return raw


def _render_one(opt: FlagOption, value: Any, field: str, version: str) -> list[str]:
    flag = opt.flags[0]
    if opt.action == "BooleanOptionalAction":
        positive = next(f for f in opt.flags if not f.startswith("--no-"))
        return [positive] if value else ["--no-" + positive[2:]]
    if not opt.takes_value:
        if value in (True, 1):
            return [flag]
        if value in (False, 0, None):
            return []
        raise FlagError(f"{flag} is a switch in SGLang {version}, got {value!r} for {field}", hint="use true or false")
    if opt.nargs in ("+", "*") or isinstance(opt.nargs, int):
        values = value if isinstance(value, (list, tuple)) else [value]
        return [flag, *(_format(v) for v in values)]
    if opt.choices is not None and _format(value) not in [str(c) for c in opt.choices]:
        raise FlagError(
            f"{flag} {_format(value)} is not accepted by SGLang {version}",
            hint=f"use one of {', '.join(str(c) for c in opt.choices)}",
        )
    return [flag, _format(value)]


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def render(params: Mapping[str, Any], table: FlagTable) -> list[str]:
    """Render SGLang field values into argv with this version's spellings.

    ``None`` values are left out (SGLang's default applies); store_true fields render as the bare
    flag when true and nothing when false; ``chunked_prefill_size=-1`` disables chunked prefill
    (§2.1); lists render as ``nargs='+'`` values.

    Args:
        params: Field name → value, e.g. ``{"mem_fraction_static": 0.88, "cuda_graph_max_bs": 256}``.
        table: The target version's table.

    Returns:
        argv fragment, e.g. ``["--mem-fraction-static", "0.88", "--cuda-graph-max-bs-decode", "256"]``.

    Raises:
        FlagError: A field this version lacks (naming the nearest spelling) or a value outside
            the option's choices.
    """
    argv: list[str] = []
    for field, value in params.items():
        if value is None:
            continue
        argv += _render_one(table.option(field), value, field, table.version)
    return argv


def _tokens(argv: Sequence[str], table: FlagTable) -> list[tuple[FlagOption | None, list[str], Any]]:
    """Split argv into (option or None, tokens, parsed value) groups, argparse-style."""
    groups: list[tuple[FlagOption | None, list[str], Any]] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or tok == "--":
            groups.append((None, [tok], None))
            i += 1
            continue
        name, eq, inline = tok.partition("=")
        opt = table.option_for_flag(name)
        if opt is None:
            groups.append((None, [tok], None))
            i += 1
            continue
        if opt.action == "BooleanOptionalAction":
            groups.append((opt, [tok], not name.startswith("--no-")))
            i += 1
            continue
        if not opt.takes_value:
            groups.append((opt, [tok], True))
            i += 1
            continue
        if eq:
            groups.append((opt, [tok], _convert(opt, inline)))
            i += 1
            continue
        j = i + 1
        values: list[str] = []
        limit = opt.nargs if isinstance(opt.nargs, int) else (1 if opt.nargs in (None, "?") else len(argv))
        while j < len(argv) and len(values) < limit and not (argv[j].startswith("-") and not _is_number(argv[j])):
            values.append(argv[j])
            j += 1
        if opt.nargs in ("+", "*") or isinstance(opt.nargs, int):
            value: Any = [_convert(opt, v) for v in values]
        else:
            value = _convert(opt, values[0]) if values else True
        groups.append((opt, argv[i:j], value))
        i = j
    return groups


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_argv(argv: Sequence[str], table: FlagTable) -> dict[str, Any]:
    """The server args a command line sets, by canonical field name (for baselines).

    Args:
        argv: A full command (``python -m sglang.launch_server --model-path M --tp 8 ...``) or
            only its flags. ``--flag=value``, argparse prefixes (``--tp``) and aliases are read.
        table: The version's table.

    Returns:
        ``{"model_path": "M", "tp_size": 8, ...}``; typed by the option's type (int, float,
        human-readable ints, JSON); store_true flags are ``True``. Unknown flags are skipped.
    """
    out: dict[str, Any] = {}
    for opt, _toks, value in _tokens(argv, table):
        if opt is not None:
            out[table.canonical(opt.dest)] = value
    return out


def replace_flags(argv: Sequence[str], params: Mapping[str, Any], table: FlagTable) -> list[str]:
    """Replace only the tuned flags in an existing command; keep everything else intact.

    Each tuned field's existing occurrences (any alias or spelling: ``--tp`` / ``--tp-size`` /
    ``--tensor-parallel-size``, ``--flag=value``) are removed; its new rendering goes where the
    first occurrence was, or at the end. A ``None`` or ``False`` value removes the flag.

    Args:
        argv: The unit's command, e.g. from ``ExecStart``.
        params: Tuned field → value.
        table: The version's table.

    Returns:
        The new argv.

    Raises:
        FlagError: A tuned field this version lacks, or a value outside its choices.
    """
    params = {k: v for k, v in params.items() if v is not None or table.has(k)}  # None + unknown: nothing to do
    tuned: dict[str, str] = {}
    for key in params:
        spec = table.option(key)
        for name in {key, spec.dest, *_ALIAS_OF.get(key, ()), *_ALIAS_OF.get(spec.dest, ())}:
            tuned[name] = key
    out: list[str] = []
    placed: set[str] = set()
    for opt, toks, _value in _tokens(argv, table):
        field = tuned.get(opt.dest) if opt is not None else None
        if field is None:
            out += toks
            continue
        if field not in placed:
            placed.add(field)
            out += render({field: params[field]}, table)
    for field, value in params.items():
        if field not in placed:
            out += render({field: value}, table)
    return out


def unknown_flags(argv: Sequence[str], table: FlagTable) -> list[str]:
    """Flags of a command that this SGLang version would reject (unknown or ambiguous prefix).

    A spelling of another version (``--cuda-graph-max-bs`` on 0.5.23, §3.2) is reported with the
    version's own spelling; :func:`replace_flags` rewrites it when that knob is tuned.

    Args:
        argv: The unit's command.
        table: The version's table.

    Returns:
        One sentence per rejected flag, naming the replacement where one exists.
    """
    reasons = []
    for tok in argv:
        if not tok.startswith("--") or tok == "--":
            continue
        name = tok.partition("=")[0]
        if name in table._by_flag:
            continue
        prefixed = {o.dest for f, o in table._by_flag.items() if f.startswith(name)}
        if len(prefixed) == 1:
            continue
        opt = table.option_for_flag(name)
        if opt is not None:
            reasons.append(f"SGLang {table.version} has no flag {name}; its spelling is {opt.flags[0]}")
        else:
            reasons.append(str(table._unknown(name)))
    return reasons


def validate(params: Mapping[str, Any], table: FlagTable) -> list[str]:
    """Reasons SGLang would reject this combination; empty when it is accepted.

    Checks: every field exists in this version; values are within choices; mem_fraction_static
    in (0, 1); max_running_requests ≥ 1; port in 1-65535; ``--enable-hierarchical-cache`` with ``--disable-radix-cache`` (§7, "mutually
    exclusive"); before 0.5.16 the host pool must be larger than the device pool, i.e.
    ``hicache_ratio > 1`` when no ``hicache_size`` is given (§7, §4.3);
    ``chunked_prefill_size % page_size == 0`` (§2.1).

    Args:
        params: Field → value (``None`` = SGLang's default).
        table: The version's table.

    Returns:
        One sentence per problem, naming the fields.
    """
    reasons: list[str] = []
    for field, value in params.items():
        if value is None:
            continue
        try:
            _render_one(table.option(field), value, field, table.version)
        except FlagError as err:
            reasons.append(str(err))
    mfs = params.get("mem_fraction_static")
    if mfs is not None and not 0.0 < float(mfs) < 1.0:
        reasons.append(f"mem_fraction_static={mfs} is outside (0, 1)")
    mrr = params.get("max_running_requests")
    if mrr is not None and int(mrr) < 1:
        reasons.append(f"max_running_requests={mrr} must be at least 1")
    port = params.get("port")
    if port is not None and not 1 <= int(port) <= 65535:
        reasons.append(f"port={port} is outside 1-65535")
    hicache = bool(params.get("enable_hierarchical_cache"))
    if hicache and params.get("disable_radix_cache"):
        reasons.append("enable_hierarchical_cache and disable_radix_cache are mutually exclusive (§7)")
    ratio = params.get("hicache_ratio")
    if hicache and not at_least(table.version, "0.5.16") and not params.get("hicache_size") and ratio is not None and float(ratio) <= 1.0:
        reasons.append(
            f"hicache_ratio={ratio}: before SGLang 0.5.16 the host pool must be larger than the device pool "
            "(ratio > 1; the docs recommend ≥ 2) (§7)"
        )
    chunk = params.get("chunked_prefill_size")
    page = params.get("page_size") or 1
    if chunk is not None and int(chunk) > 0 and int(chunk) % int(page) != 0:
        reasons.append(f"chunked_prefill_size={chunk} is not a multiple of page_size={page} (§2.1)")
    return reasons
