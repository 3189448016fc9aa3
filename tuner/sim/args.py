"""The simulator's command line: ``sglang.launch_server``'s flags for one mimicked version, plus ``--sim-*``.

The parser is built from the bundled flag tables (``tuner/data/flags-<version>.json``, read from SGLang's
own argparse, ``shared/sglang-flags/``), so every real flag of the mimicked version is accepted and
a flag that version lacks is an argparse error (exit 2). Prefix abbreviations behave as in SGLang
(argparse ``allow_abbrev``): ``--tp 8`` works, and in 0.5.23 ``--cuda-graph-max-bs`` is ambiguous
(``--cuda-graph-max-bs-decode`` / ``-prefill``), so the launch fails (§3.2 of
``shared/sglang-reference.md``). Flags that the simulator does not model are accepted and ignored
with a warning. Defaults that depend on the GPU are resolved in :mod:`tuner.sim.memory`.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from tuner.sim.answers import NumericsFault
from tuner.sim.costmodel import SCHEDULER_CPU
from tuner.sim.errors import SimError
from tuner.sim.gpus import GPUS

__all__ = [
    "VERSIONS",
    "SIMULATED_DESTS",
    "SimOptions",
    "ParsedArgs",
    "build_parser",
    "parse_args",
    "flag_table",
]

VERSIONS = {"0.5.5": "0.5.5.post3", "0.5.10": "0.5.10", "0.5.23": "0.5.23"}
"""Mimicked version (``--sim-version``) -> the release whose flag table and formats are used."""

SIMULATED_DESTS = frozenset(
    {
        "model_path", "tokenizer_path", "tp_size", "mem_fraction_static", "max_running_requests",
        "max_total_tokens", "chunked_prefill_size", "max_prefill_tokens", "enable_mixed_chunk",
        "schedule_policy", "schedule_conservativeness", "cuda_graph_max_bs", "cuda_graph_bs",
        "cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "disable_cuda_graph", "disable_cuda_graph_padding",
        "disable_decode_cuda_graph", "kv_cache_dtype", "page_size", "context_length",
        "enable_hierarchical_cache", "hicache_ratio", "hicache_size", "hicache_write_policy",
        "hicache_io_backend", "hicache_mem_layout", "disable_radix_cache", "speculative_algorithm",
        "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_num_draft_tokens", "enable_metrics", "enable_cache_report", "host", "port",
        "served_model_name", "decode_log_interval", "trust_remote_code", "skip_server_warmup", "stream_output",
        "incremental_streaming_output", "disable_piecewise_cuda_graph", "disable_prefill_cuda_graph",
        "hicache_host_memory_fraction", "enable_dp_attention", "dp_size", "dcp_size",
        "dsa_prefill_backend", "dsa_decode_backend", "scheduler_recv_interval",
        "disable_overlap_schedule",
    }
)
"""ServerArgs fields the simulator models (issue 2 §1); any other flag is accepted and ignored."""

_DEST_ALIASES = {
    "tensor_parallel_size": "tp_size",
    "data_parallel_size": "dp_size",
    "pipeline_parallel_size": "pp_size",
    "expert_parallel_size": "ep_size",
}
"""argparse dests that ``ServerArgs.from_cli_args`` renames (0.5.5/0.5.10 keep the long names)."""

_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def _human_readable_int(text: str) -> int:
    """SGLang's ``human_readable_int`` (0.5.10+, §3.2): ``128k`` = 128000, ``128Ki`` = 131072."""
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kKmMgG][iI]?)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid human-readable int: {text!r}")
    value = float(m.group(1)) * _SI[(m.group(2) or "").lower()] if m.group(2) else float(m.group(1))
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not an integer number of tokens: {text!r}")
    return int(value)


def _json_loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"invalid JSON: {err}") from None


def _nullable_str(text: str) -> str | None:
    return None if text.lower() in ("none", "null", "") else text


_TYPES: dict[str | None, Any] = {
    None: None,
    "str": str,
    "int": int,
    "float": float,
    "human_readable_int": _human_readable_int,
    "json_list_type": _json_loads,
    "loads": _json_loads,
    "nullable_str": _nullable_str,
    "parse_cuda_graph_backend_arg": str,
    "parse_cuda_graph_config_arg": _json_loads,
}


def flag_table(version: str) -> dict[str, Any]:
    """The bundled flag table of a mimicked version (``0.5.5``, ``0.5.10`` or ``0.5.23``).

    Raises:
        SimError: Unknown version.
    """
    if version not in VERSIONS:
        raise SimError(f"--sim-version {version!r} is not simulated; choose one of {', '.join(VERSIONS)}.")
    path = resources.files("tuner.data") / f"flags-{VERSIONS[version]}.json"  # the one copy, shared with tuner.sglang
    return json.loads(path.read_text())


@dataclass(frozen=True)
class SimOptions:
    """The ``--sim-*`` options: what the simulated machine is, and how fast time runs.

    Attributes:
        gpu: GPU preset name (``--sim-gpu``).
        host_memory_gib: Host RAM, GiB (``--sim-host-memory-gib``), for the HiCache host pool (§7).
        memory_max: ``--sim-memory-max``: the limit the pinned host pools are charged to, like a
            systemd unit's ``MemoryMax=``: ``none`` (default), ``auto`` (this process's real
            cgroup limit) or a size in GiB.
        version: Mimicked SGLang version (``--sim-version``).
        time_scale: Multiplier on realistic startup delays (``--sim-time-scale``); 0 = instant.
        foreign_gib: Memory held by a foreign process on GPU 0, GiB (``--sim-foreign-gib``).
        seed: Seed of generated output tokens (``--sim-seed``).
        numerics_fault: ``--sim-numerics-fault NAME=VALUE[,...][:NATS][@TOKEN]``: a launch that sets
            every named flag to its value answers badly (without a size: broken answers; with one:
            that much noise per token, nats, from answer token ``TOKEN``; :mod:`tuner.sim.answers`);
            empty: none.
        no_logprobs: ``--sim-no-logprobs``: ``/generate`` leaves ``meta_info.output_token_logprobs``
            out, as a proxy or an OpenAI-only gateway in front of SGLang does (the quality gate's
            "no logprobs" case).
        scheduler: ``--sim-scheduler``: the scheduler generation whose CPU cost per step the clock
            charges (:data:`tuner.sim.costmodel.SCHEDULER_CPU`): ``0.5`` (default) or ``pre-0.4``
            (SGLang 0.2-0.3, for replaying their published runs).
    """

    gpu: str = "H100-80GB"
    host_memory_gib: float = 512.0
    memory_max: str = "none"
    version: str = "0.5.5"
    time_scale: float = 0.05
    foreign_gib: float = 0.0
    seed: int = 0
    numerics_fault: str = ""
    scheduler: str = "0.5"
    no_logprobs: bool = False


@dataclass(frozen=True)
class ParsedArgs:
    """One parsed command line.

    Attributes:
        server: Every ServerArgs field of the mimicked version (flat, as ``/get_server_info``
            reports them), defaults included, nothing resolved yet.
        sim: The ``--sim-*`` options.
        given: The dests the user set explicitly.
        warnings: Lines to log at startup (flags accepted but not simulated).
    """

    server: dict[str, Any]
    sim: SimOptions
    given: frozenset[str]
    warnings: tuple[str, ...] = field(default=())


def _gpu_name(text: str) -> str:
    for key in GPUS:
        if key.lower() == text.strip().lower():
            return key
    raise argparse.ArgumentTypeError(f"unknown GPU preset {text!r}; choose one of {', '.join(GPUS)}")


PROG = "python -m tuner.sim"
"""The program name in usage and error lines; ``tuner sim serve`` passes its own."""


def _add_sim_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "simulator options", "What to simulate (these are the simulator's own; SGLang has none of them).")
    group.add_argument("--sim-gpu", type=_gpu_name, default=SimOptions.gpu,
                       help=f"GPU preset: {', '.join(GPUS)}")
    group.add_argument("--sim-host-memory-gib", type=float, default=SimOptions.host_memory_gib,
                       help="host RAM in GiB (HiCache host pool must fit, per rank)")
    group.add_argument("--sim-memory-max", default=SimOptions.memory_max,
                       help="limit the pinned HiCache pools are charged to (a unit's MemoryMax=): none, auto "
                            "(this process's cgroup memory.max) or GiB; crossing it is an OOM kill")
    group.add_argument("--sim-version", choices=list(VERSIONS), default=SimOptions.version,
                       help="SGLang version to mimic (flags, log formats, KV sizing)")
    group.add_argument("--sim-time-scale", type=float, default=SimOptions.time_scale,
                       help="multiplier on realistic startup delays (0.05: an 8B model starts in ~1-2 s)")
    group.add_argument("--sim-foreign-gib", type=float, default=SimOptions.foreign_gib,
                       help="GiB held by a foreign process on GPU 0 at startup")
    group.add_argument("--sim-seed", type=int, default=SimOptions.seed, help="seed of generated tokens")
    group.add_argument("--sim-numerics-fault", default=SimOptions.numerics_fault, metavar="NAME=VALUE[,...][:NATS][@TOKEN]",
                       help="plant a numerics fault: a launch setting these flags (e.g. kv_cache_dtype=fp8_e4m3) "
                            "gives broken greedy answers; ':NATS' makes it a noise of that many nats per token "
                            "(a graded fault), '@TOKEN' starts it at that answer token")
    group.add_argument("--sim-scheduler", choices=list(SCHEDULER_CPU), default=SimOptions.scheduler,
                       help="scheduler generation whose CPU cost per step the clock charges: 0.5 (every mimicked "
                            "version) or pre-0.4 (SGLang 0.2-0.3, no overlap, per-request Python work each step)")
    group.add_argument("--sim-no-logprobs", action="store_true",
                       help="answer /generate without meta_info.output_token_logprobs (a proxy in front of SGLang)")


def build_parser(version: str, prog: str = PROG) -> argparse.ArgumentParser:
    """An argparse parser with every flag of SGLang ``version`` and the ``--sim-*`` options.

    ``--help`` lists the simulator's own options first (with their meaning), then SGLang's flags of
    that version by name only: their meaning is SGLang's (``python -m sglang.launch_server --help``).

    Args:
        version: ``0.5.5``, ``0.5.10`` or ``0.5.23``.
        prog: The program name in usage and error lines.

    Raises:
        SimError: Unknown version.
    """
    table = flag_table(version)
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"Simulated sglang.launch_server (mimicking {VERSIONS[version]}).",
        usage=f"{prog} --model-path PATH [sglang flags] [--sim-* options]",
        allow_abbrev=True,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # "(default: ...)" on the options with help
    )
    _add_sim_options(parser)
    sglang = parser.add_argument_group(
        f"sglang.launch_server flags ({VERSIONS[version]})",
        "Accepted as SGLang accepts them (prefixes included); those the simulator does not model are "
        "accepted with a warning. Their meaning: `python -m sglang.launch_server --help` of that version, "
        "or SGLang's server arguments documentation.")
    for opt in table["options"]:
        flags, dest, action = opt["flags"], opt["dest"], opt["action"]
        if "--help" in flags or "-h" in flags:
            continue
        kwargs: dict[str, Any] = {"dest": dest, "default": opt["default"]}
        if action in ("_StoreTrueAction", "DeprecatedStoreTrueAction"):
            kwargs["action"] = "store_true"
            kwargs["default"] = bool(opt["default"])
        elif action == "BooleanOptionalAction":
            kwargs["action"] = argparse.BooleanOptionalAction
            flags = [f for f in flags if not f.startswith("--no-")]
        elif action == "DeprecatedAction":
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        elif action == "DeprecatedStoreConstAction":
            kwargs["nargs"] = "?"
            kwargs["const"] = (opt["choices"] or [True])[0]
            kwargs["choices"] = opt["choices"]
        else:
            kwargs["type"] = _TYPES.get(opt["type"], str)
            if opt["nargs"] is not None:
                kwargs["nargs"] = opt["nargs"]
            if opt["choices"]:
                kwargs["choices"] = opt["choices"]
        sglang.add_argument(*flags, **kwargs)
    return parser


def _pre_version(argv: Sequence[str], prog: str) -> str:
    pre = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    pre.add_argument("--sim-version", choices=list(VERSIONS), default=SimOptions.version)
    ns, _ = pre.parse_known_args(list(argv))
    return ns.sim_version


def parse_args(argv: Sequence[str], prog: str = PROG) -> ParsedArgs:
    """Parse a command line as SGLang ``--sim-version`` would.

    Args:
        argv: The arguments after the program name.
        prog: The program name in usage and error lines.

    Returns:
        The server fields, the sim options and which fields the user set.

    Raises:
        SystemExit: Status 2 with argparse's message for an unknown, ambiguous or malformed flag
            (as SGLang's parser does), status 0 for ``--help``.
        SimError: A value SGLang's server-args checks reject (negative fraction, bad page size).
    """
    version = _pre_version(argv, prog)
    parser = build_parser(version, prog)
    ns = parser.parse_args(list(argv))
    values = {_DEST_ALIASES.get(k, k): v for k, v in vars(ns).items()}
    defaults = {_DEST_ALIASES.get(a.dest, a.dest): a.default for a in parser._actions if a.dest != "help"}
    given = frozenset(d for d, v in values.items() if v != defaults.get(d))
    sim = SimOptions(
        gpu=values.pop("sim_gpu"),
        host_memory_gib=values.pop("sim_host_memory_gib"),
        memory_max=values.pop("sim_memory_max"),
        version=values.pop("sim_version"),
        time_scale=values.pop("sim_time_scale"),
        foreign_gib=values.pop("sim_foreign_gib"),
        seed=values.pop("sim_seed"),
        numerics_fault=values.pop("sim_numerics_fault"),
        scheduler=values.pop("sim_scheduler"),
        no_logprobs=values.pop("sim_no_logprobs"),
    )
    if values.get("model_path") is None:
        parser.error("the following arguments are required: --model-path")
    _check_values(values, sim)
    warnings = tuple(
        f"Flag --{d.replace('_', '-')} is accepted but not simulated; ignoring it."
        for d in sorted(given)
        if d not in SIMULATED_DESTS and not d.startswith("sim_")
    )
    return ParsedArgs(server=values, sim=sim, given=frozenset(g for g in given if not g.startswith("sim_")),
                      warnings=warnings)


def _check_values(v: dict[str, Any], sim: SimOptions) -> None:
    """SGLang's server-args checks the simulator reproduces, plus sanity of ``--sim-*`` values."""
    mfs = v.get("mem_fraction_static")
    if mfs is not None and not 0.0 < mfs <= 1.0:
        raise SimError(
            f"mem_fraction_static={mfs} is out of range; --mem-fraction-static must be in (0, 1] (e.g. 0.88)."
        )
    port = v.get("port")
    if port is not None and not 0 <= port <= 65535:
        raise SimError(f"port={port} is not a TCP port; fix --port (0-65535, e.g. 30000).")
    for dest in ("tp_size", "page_size", "max_running_requests", "max_total_tokens", "context_length"):
        val = v.get(dest)
        if val is not None and val <= 0:
            raise SimError(f"{dest}={val} must be positive; fix --{dest.replace('_', '-')}.")
    if (v.get("schedule_conservativeness") or 0) < 0:
        raise SimError("--schedule-conservativeness must be >= 0.")
    chunk, page = v.get("chunked_prefill_size"), v.get("page_size") or 1
    if chunk is not None and chunk > 0 and chunk % page != 0:
        raise SimError(
            f"chunked_prefill_size={chunk} must be divisible by page_size={page}; fix --chunked-prefill-size."
        )
    if v.get("enable_hierarchical_cache") and v.get("disable_radix_cache"):
        raise SimError(
            "The arguments enable-hierarchical-cache and disable-radix-cache are mutually exclusive "
            "and cannot be used at the same time. Please use only one of them."
        )
    if sim.memory_max not in ("none", "auto"):
        try:
            ok = float(sim.memory_max) > 0
        except ValueError:
            ok = False
        if not ok:
            raise SimError(f"--sim-memory-max {sim.memory_max!r} must be none, auto or a size in GiB above 0.")
    if sim.numerics_fault:
        try:
            NumericsFault(sim.numerics_fault)
        except ValueError as err:
            raise SimError(f"{err}.") from None
    if sim.time_scale < 0 or sim.foreign_gib < 0 or sim.host_memory_gib <= 0:
        raise SimError("--sim-time-scale and --sim-foreign-gib must be >= 0, --sim-host-memory-gib > 0.")
