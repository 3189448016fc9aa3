"""The simulated startup sequence: SGLang's log lines in each version's format, and its failures.

It prints what ``python -m sglang.launch_server`` prints while it starts (``shared/
sglang-reference.md`` §4.1 prefix, §4.2 memory lines in order, every TP rank with its ``TPn``
prefix, the scheduler line from rank 0, the HiCache host-pool line), waiting realistic delays
scaled by ``--sim-time-scale``, from the numbers of :func:`tuner.sim.memory.plan_memory`. A stage
that does not fit prints SGLang's failure text (§4.3): the exception inside
``Scheduler hit an exception: ...``, then the parent's SIGQUIT line; the caller then ends the
process like ``kill_process_tree`` does (SIGKILL, so the exit status reads 137 / ``9/KILL``).
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tuner.sim import speculative
from tuner.sim.args import PROG, ParsedArgs, parse_args
from tuner.sim.costmodel import CostInputs
from tuner.sim.engine import EngineSpec, torch_oom_text
from tuner.sim.errors import SimError
from tuner.sim.gpus import get_gpu
from tuner.sim.memory import (
    TORCH_DTYPE_NAMES,
    MemoryPlan,
    ServerConfig,
    StartupFailure,
    plan_memory,
    resolve_server_config,
)
from tuner.sim.models import GIB, load_model

__all__ = [
    "plan_from_argv",
    "SimLogger",
    "StartupDelays",
    "log_startup",
    "run_startup",
    "engine_spec",
    "kill_process_tree",
    "graph_failed_text",
    "cgroup_memory_max",
]


PREFILL_GRAPH_CAPTURE_S = 5.0
"""Realistic time to capture the piecewise / prefill graphs, seconds (simulator's)."""


def plan_from_argv(argv: Sequence[str], prog: str = PROG) -> tuple[ParsedArgs, MemoryPlan]:
    """Parse a command line and size the server on the simulated machine (no waiting, no output).

    Args:
        argv: ``python -m tuner.sim`` arguments (SGLang flags plus ``--sim-*``).
        prog: The program name in usage and error lines.

    Returns:
        The parsed command line and the memory ledger (``plan.config`` is the resolved config;
        ``plan.failure`` says where startup would stop).

    Raises:
        SimError: Bad input (unknown preset, config.json missing a field, bad value).
        SystemExit: argparse rejected a flag (status 2, as SGLang).
    """
    parsed = parse_args(argv, prog)
    gpu = get_gpu(parsed.sim.gpu)
    if parsed.sim.foreign_gib * 1024 >= gpu.memory_mib:  # review N15: "avail mem=-920.94 GB"
        raise SimError(f"--sim-foreign-gib {parsed.sim.foreign_gib:g} is not below the {gpu.name}'s "
                       f"{gpu.memory_mib / 1024:.1f} GiB; pass a smaller value.")
    cfg = resolve_server_config(parsed, gpu, load_model(parsed.server["model_path"]))
    plan = plan_memory(cfg, foreign_bytes=int(parsed.sim.foreign_gib * GIB),
                       host_memory_bytes=int(parsed.sim.host_memory_gib * GIB),
                       cgroup_max_bytes=_memory_max(parsed.sim.memory_max))
    return parsed, plan


def _memory_max(option: str) -> int | None:
    if option == "none":
        return None
    if option == "auto":
        return cgroup_memory_max()
    return int(float(option) * GIB)


_V1_UNLIMITED = 1 << 62
"""cgroup v1 prints ``memory.limit_in_bytes`` near 2^63 when unlimited."""


def cgroup_memory_max(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """This process's cgroup memory limit in bytes (a systemd unit's ``MemoryMax=``), or None.

    cgroup v2 ``memory.max``, else v1 ``memory.limit_in_bytes``; None when unlimited or
    unreadable. The pinned HiCache host pool is charged to this limit, while SGLang's own check
    reads the host's available memory (``psutil``), which ignores it (§7).
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and not controllers:
            text = _read(Path(root) / path.lstrip("/") / "memory.max")
            if text is not None and text.isdigit():
                return int(text)
    for _hierarchy, controllers, path in entries:
        if "memory" in controllers.split(","):
            text = _read(Path(root) / "memory" / path.lstrip("/") / "memory.limit_in_bytes")
            if text is not None and text.isdigit() and int(text) < _V1_UNLIMITED:
                return int(text)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


class SimLogger:
    """Writes SGLang-format log lines: ``[%Y-%m-%d %H:%M:%S TPn] message`` (§4.1).

    Args:
        stream: Where lines go (SGLang logs through ``logging`` to stderr).
        tp_size: The ``TPn`` prefix is printed only when tp > 1.
    """

    def __init__(self, stream: TextIO | None = None, tp_size: int = 1) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tp_size = tp_size

    def prefix(self, rank: int | None) -> str:
        """The bracketed timestamp and rank prefix."""
        now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        tag = f" TP{rank}" if rank is not None and self.tp_size > 1 else ""
        return f"[{now}{tag}]"

    def line(self, message: str, rank: int | None = 0) -> None:
        """Log one message (may span lines, like a traceback) as ``rank`` (None: no rank tag)."""
        self.stream.write(f"{self.prefix(rank)} {message}\n")
        self.stream.flush()

    def raw(self, text: str) -> None:
        """Write text without a prefix (uvicorn's lines, traceback continuation)."""
        self.stream.write(text + "\n")
        self.stream.flush()

    def all_ranks(self, message: Callable[[int], str | None]) -> None:
        """Log ``message(rank)`` from every rank (skipping None)."""
        for rank in range(self.tp_size):
            text = message(rank)
            if text is not None:
                self.line(text, rank)


@dataclass(frozen=True)
class StartupDelays:
    """Realistic durations of startup stages (seconds, before ``--sim-time-scale``; simulator's).

    Attributes:
        dist_init_s: torch.distributed / NCCL init (tp > 1 takes longer).
        load_gb_s: Aggregate checkpoint read speed, decimal GB/s (a 500 GB model: ~6 min).
        capture_s_per_graph_layer: CUDA-graph capture time per captured size and layer.
        warmup_s: The warm-up ``/generate`` and uvicorn start.
    """

    dist_init_s: float = 1.0
    dist_init_tp_s: float = 3.0
    load_gb_s: float = 1.5
    kv_alloc_s: float = 0.5
    capture_s_per_graph_layer: float = 0.006
    warmup_s: float = 1.0


def _gb(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def graph_failed_text(version: str, oom: str) -> str:
    """``Capture cuda graph failed`` with SGLang's ``Possible solutions`` (§4.3)."""
    new = version == "0.5.23"
    max_bs = "--cuda-graph-max-bs-decode" if new else "--cuda-graph-max-bs"
    disable = "--disable-decode-cuda-graph" if new else "--disable-cuda-graph"
    return (
        f"Exception: Capture cuda graph failed: {oom}\n"
        "Possible solutions:\n"
        "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
        f"2. set {max_bs} to a smaller value (e.g., 16)\n"
        "3. disable torch compile by not using --enable-torch-compile\n"
        f"4. disable CUDA graph by {disable}. (Not recommended. Huge performance loss)\n"
        "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose "
    )


_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/usr/local/lib/python3.12/dist-packages/sglang/srt/managers/scheduler.py", line 2730, '
    "in run_scheduler_process\n"
    "    scheduler = Scheduler(\n"
    "                ^^^^^^^^^^\n"
    '  File "/usr/local/lib/python3.12/dist-packages/sglang/srt/model_executor/model_runner.py", '
    "in {where}\n"
)


def _failure_exception(plan: MemoryPlan, f: StartupFailure) -> tuple[str, str]:
    """(function name for the traceback, the exception line(s)) of a startup failure (§4.3)."""
    cfg = plan.config
    version = cfg.version
    r = plan.ranks[f.rank]
    used = r.total - f.free_bytes
    if f.kind == "unbalanced":
        d = f.detail
        local = d["local_gpu_memory"]
        if plan.config.version == "0.5.5":  # model_runner.py: a ValueError naming min_per_gpu_memory
            return "init_torch_distributed", (
                "ValueError: The memory capacity is unbalanced. Some GPUs may be occupied by other processes. "
                f"min_per_gpu_memory={d['min_per_gpu_memory']!r}, local_gpu_memory={local!r}, "
                f"local_gpu_memory * 0.9={local * 0.9!r}"
            )
        # 0.5.10 (model_runner.py) and 0.5.23 (distributed/bootstrap.py): a RuntimeError naming
        # pre_model_load_memory (SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK defaults to on).
        return "init_torch_distributed", (
            "RuntimeError: The memory capacity is unbalanced. Some GPUs may be occupied by other processes. "
            f"pre_model_load_memory={d['min_per_gpu_memory']!r}, local_gpu_memory={local!r}, "
            f"local_gpu_memory * 0.9={local * 0.9!r}"
        )
    if f.kind in ("weight_oom", "draft_weight_oom", "draft_kv_oom", "pool_oom"):
        loading = f.kind in ("weight_oom", "draft_weight_oom")
        tried = min(f.requested_bytes, 1 * GIB) if loading else f.requested_bytes
        free = f.free_bytes % tried if loading else f.free_bytes
        where = "load_model" if loading else "init_memory_pool"
        return where, torch_oom_text(tried, f.rank, r.total, free, r.total - free - r.foreign)
    if f.kind == "kv_no_budget":
        d = f.detail
        minimum = 1 - d["available_gib"] / d["pre_gib"]
        return "profile_max_num_token", (
            "ValueError: Loaded weights leave no GPU memory for the KV cache under "
            f"--mem-fraction-static={d['mfs']}. Raise --mem-fraction-static above {minimum:.3f} "
            f"(minimum viable = 1 - available/pre = {minimum:.3f}). If using speculative decoding, "
            "draft weights are now counted."
        )
    if f.kind == "not_enough_memory":
        field = "self.server_args.mem_fraction_static" if version == "0.5.5" else "mem_fraction_static"
        return "init_memory_pool", (
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
            f"Current value: {field}={cfg.mem_fraction_static}"
        )
    if f.kind in ("graph_oom", "draft_graph_oom"):
        oom = torch_oom_text(min(f.requested_bytes, 448 * (1 << 20)) if f.free_bytes < 448 * (1 << 20)
                             else f.requested_bytes - f.free_bytes, f.rank, r.total, f.free_bytes, used)
        return "init_device_graphs", graph_failed_text(version, oom.replace("torch.OutOfMemoryError: ", ""))
    if f.kind == "tp_not_divisible":
        # sglang/srt/distributed/utils.py ensure_divisibility, raised from QKVParallelLinear.
        return "load_model", f"AssertionError: {f.detail['numerator']} is not divisible by {f.detail['denominator']}"
    if f.kind == "pool_too_small":
        return "TpModelWorker.__init__", "AssertionError: Memory pool size is too small"
    if f.kind == "host_memory":
        return "init_memory_pool_and_cache", (
            f"ValueError: Not enough host memory available. Requesting {f.requested_bytes / 1e9:.2f} GB but "
            f"only have {f.free_bytes / 1e9:.2f} GB free. Please reduce the size of the hierarchical cache."
        )
    if f.kind == "host_smaller_than_device":
        return "init_memory_pool_and_cache", (
            "AssertionError: The host memory should be larger than the device memory with the current protocol"
        )
    return "init", f"RuntimeError: startup failed ({f.kind})"


def _kv_line(plan: MemoryPlan, version: str) -> str:
    cfg = plan.config
    dtype = f"dtype: {TORCH_DTYPE_NAMES[cfg.kv_cache_dtype]}, " if version == "0.5.23" else ""
    head = f"KV Cache is allocated. {dtype}#tokens: {plan.max_total_num_tokens}, "
    if cfg.model.is_mla:
        return head + f"KV size: {_gb(plan.kv_bytes)} GB"
    return head + f"K size: {_gb(plan.k_bytes)} GB, V size: {_gb(plan.v_bytes)} GB"


def _draft_kv_line(plan: MemoryPlan, version: str) -> str:
    """The draft pool's ``KV Cache is allocated`` line: MLA when the draft is the model's MTP
    layers or a head at its geometry, else K/V halves (an MHA draft)."""
    cfg = plan.config
    dtype = f"dtype: {TORCH_DTYPE_NAMES[cfg.kv_cache_dtype]}, " if version == "0.5.23" else ""
    head = f"KV Cache is allocated. {dtype}#tokens: {plan.max_total_num_tokens}, "
    draft_mla = cfg.model.is_mla and cfg.draft is not None and cfg.draft.name in ("<mtp>", "<eagle-head>")
    if draft_mla:
        return head + f"KV size: {_gb(plan.draft_kv_bytes)} GB"
    return head + f"K size: {_gb(plan.draft_kv_bytes / 2)} GB, V size: {_gb(plan.draft_kv_bytes / 2)} GB"


def _load_end(version: str, cls: str, dtype: str, quant: str | None, avail: int, used: int, elapsed: float) -> str:
    if version == "0.5.5":
        return (f"Load weight end. type={cls}, dtype={dtype}, avail mem={_gb(avail)} GB, "
                f"mem usage={_gb(used)} GB.")
    q = f"quant={quant}, " if quant else ""
    return (f"Load weight end. elapsed={elapsed:.2f} s, type={cls}, {q}avail mem={_gb(avail)} GB, "
            f"mem usage={_gb(used)} GB.")


def _quant_str(cfg: ServerConfig) -> str | None:
    m = cfg.model.quant_method
    if m is None:
        return None
    return "fp8, fmt=e4m3" if m == "fp8" else m


def run_startup(  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
    plan: MemoryPlan,
    log: SimLogger,
    *,
    time_scale: float,
    delays: StartupDelays = StartupDelays(),
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Print the startup sequence up to the scheduler line, or up to the failure.

    Args:
        plan: The ledger of this startup.
        log: Where lines go.
        time_scale: Multiplier on :class:`StartupDelays` (0: no waiting).
        delays: Realistic stage durations.
        sleep: How to wait (seconds).

    Returns:
        True when the engine is up (the caller starts HTTP and the warm-up); False after a
        failure's lines were printed (the caller then kills the process, §4.3).
    """
    cfg = plan.config
    version, tp = cfg.version, cfg.tp_size
    ranks = plan.ranks
    fail = plan.failure

    def wait(seconds: float) -> float:
        if time_scale > 0 and seconds > 0:
            sleep(seconds * time_scale)
        return seconds * time_scale

    def die(where_rank: int | None = None) -> bool:
        assert fail is not None
        where, exc = _failure_exception(plan, fail)
        rank = fail.rank if where_rank is None else where_rank
        log.line("Scheduler hit an exception: " + _TRACEBACK.format(where=where) + exc, rank)
        log.line("Received sigquit from a child process. It usually means the child failed.", None)
        return False

    # 1. distributed init and the baseline (§1.1, §4.2 line 1).
    if version != "0.5.23":  # 0.5.23's bootstrap prints no begin line (srt/distributed/bootstrap.py)
        log.all_ranks(lambda r: "Init torch distributed begin.")
    t = wait(delays.dist_init_tp_s if tp > 1 else delays.dist_init_s)
    if fail and fail.kind == "unbalanced":
        return die()
    comm = _gb(plan.comm_bytes)
    if version == "0.5.5":
        log.all_ranks(lambda r: f"Init torch distributed ends. mem usage={comm} GB")
    elif version == "0.5.10":
        log.all_ranks(lambda r: f"Init torch distributed ends. elapsed={t:.2f} s, mem usage={comm} GB")
    else:
        log.all_ranks(lambda r: f"Init parallel ends. elapsed={t:.2f} s")
        log.all_ranks(lambda r: f"Memory baseline taken. mem usage={comm} GB")

    # 2. weights (§4.2 lines 2-3).
    draft = cfg.draft
    dtype = "torch." + ("bfloat16" if cfg.model.torch_dtype == "bfloat16" else cfg.model.torch_dtype)

    def load(label_cls: str, before: Callable[[int], int], nbytes: int, kind: str) -> bool:
        log.all_ranks(lambda r: f"Load weight begin. avail mem={_gb(before(r))} GB")
        if fail and fail.kind == "tp_not_divisible" and kind == "weight_oom":
            return die()  # the layers are built (and the split asserted) before any weight loads
        elapsed = wait(nbytes * tp / (delays.load_gb_s * 1e9))
        if fail and fail.kind == kind:
            return die()
        log.all_ranks(lambda r: _load_end(version, label_cls, dtype, _quant_str(cfg), before(r) - nbytes,
                                          nbytes, elapsed))
        return True

    if not load(cfg.model.model_class, lambda r: ranks[r].after_init, plan.weight_bytes, "weight_oom"):
        return False
    if draft and version == "0.5.23":
        if not load(draft.model_class, lambda r: ranks[r].after_init - plan.weight_bytes, draft.weight_bytes,
                    "weight_oom"):
            return False

    # 3. profile, caps, KV pool (§1.2-1.5, §4.2 lines 4-6).
    for w in plan.warnings:
        if w.startswith("max_total_tokens="):
            log.all_ranks(lambda r, w=w: w)
    if fail and fail.kind in ("kv_no_budget", "not_enough_memory", "pool_oom"):
        return die(0 if fail.kind != "pool_oom" else None)
    if version != "0.5.23":  # 0.5.23 prints the dtype in the KV line instead
        log.line(f"Using KV cache dtype: {TORCH_DTYPE_NAMES[cfg.kv_cache_dtype]}", 0)
    wait(delays.kv_alloc_s)
    log.all_ranks(lambda r: _kv_line(plan, version))
    if draft and version == "0.5.23":  # the draft's pool, at its own geometry (second KV line)
        log.all_ranks(lambda r: _draft_kv_line(plan, version))
    if fail and fail.kind == "draft_kv_oom" and version == "0.5.23":
        return die()
    log.all_ranks(lambda r: f"Memory pool end. avail mem={_gb(ranks[r].after_pool)} GB")
    for w in plan.warnings:
        if w.startswith("max_running_requests was reduced"):
            log.line(w, 0)

    # 4. CUDA graphs (§2.1, §4.2 line 7).
    if not _capture(plan, log, wait, delays, "target", lambda r: ranks[r].before_capture, plan.graph_bytes,
                    cfg.model.num_layers, "graph_oom"):
        return die()

    if draft and version == "0.5.23" and plan.draft_graph_bytes:
        if not _capture(plan, log, wait, delays, "draft", lambda r: ranks[r].after_capture,
                        plan.draft_graph_bytes, draft.num_layers, "draft_graph_oom"):
            return die()

    # 5. the draft worker of 0.5.5 / 0.5.10 (§1.5).
    if draft and version != "0.5.23":
        if not load(draft.model_class, lambda r: ranks[r].draft_before_weights, draft.weight_bytes,
                    "draft_weight_oom"):
            return False
        if fail and fail.kind == "draft_kv_oom":
            return die()
        log.all_ranks(lambda r: _draft_kv_line(plan, version))
        log.all_ranks(lambda r: f"Memory pool end. avail mem={_gb(ranks[r].draft_after_pool)} GB")
        if not _capture(plan, log, wait, delays, "draft", lambda r: ranks[r].draft_after_pool,
                        plan.draft_graph_bytes, draft.num_layers, "draft_graph_oom"):
            return die()

    if fail and fail.kind == "pool_too_small":
        return die(0)

    # 6. the scheduler line (§4.2 line 8, rank 0 only).
    chunk = cfg.chunked_prefill_size if cfg.chunked_prefill_size is not None else -1
    log.line(
        f"max_total_num_tokens={plan.reported_tokens}, chunked_prefill_size={chunk}, "
        f"max_prefill_tokens={cfg.max_prefill_tokens}, max_running_requests={plan.max_running_requests}, "
        f"context_len={cfg.context_len}, available_gpu_mem={_gb(_final_free(plan, 0))} GB",
        0,
    )

    # 7. HiCache host pool (§4.2 line 9, §7), per rank.
    if cfg.enable_hierarchical_cache:
        host_gb = plan.hicache_host_bytes / 1e9
        for r in range(tp):
            if fail and fail.kind in ("host_memory", "host_smaller_than_device") and r == fail.rank:
                return die()
            if fail and fail.kind == "host_oom_kill" and r == fail.rank:
                # The kernel's OOM killer: SIGKILL mid-allocation, no Python traceback (the caller's
                # kill_process_tree ends the process the same way, status 9/KILL).
                return False
            if version == "0.5.23":
                log.line(f"Allocating kv hierarchical KV host pool: {plan.hicache_host_tokens} tokens, "
                         f"{host_gb:.2f} GB host memory.", r)
            else:
                log.line(f"Allocating {host_gb:.2f} GB host memory for hierarchical KV cache.", r)
    return fail is None


def log_startup(parsed: ParsedArgs, plan: MemoryPlan, log: SimLogger, *, time_scale: float) -> bool:
    """Everything the server prints from its command line to the scheduler line (or a failure).

    The ``server_args=ServerArgs(...)`` echo, the config's warnings (flags accepted but not
    simulated), then :func:`run_startup`. ``python -m tuner.sim`` and
    :func:`tuner.sim.evaluate.size_server` both start here, so offline sizing prints what the
    server prints.

    Args:
        parsed: The parsed command line (from :func:`plan_from_argv`).
        plan: Its memory ledger (from :func:`plan_from_argv`).
        log: Where lines go.
        time_scale: Multiplier on the realistic stage delays (0: no waiting).

    Returns:
        True when the engine is up; False after a failure's lines (see :func:`run_startup`).
    """
    cfg = plan.config
    if cfg.version == "0.5.23":  # entrypoints/engine.py: server_args={resolved_dict()}
        log.line(f"server_args={dict(cfg.server_args)!r}", None)
    else:  # f"{server_args=}": the dataclass repr
        args_repr = ", ".join(f"{k}={v!r}" for k, v in cfg.server_args.items())
        log.line(f"server_args=ServerArgs({args_repr})", None)
    for warning in cfg.warnings:
        log.line(warning, None)
    return run_startup(plan, log, time_scale=time_scale)


def _final_free(plan: MemoryPlan, rank: int) -> int:
    return plan.ranks[rank].total - plan.used_bytes(rank)


def _capture(plan: MemoryPlan, log: SimLogger, wait: Callable[[float], float], delays: StartupDelays,
             runner: str, before: Callable[[int], int | None], nbytes: int, layers: int, kind: str) -> bool:
    """Print one runner's capture lines in the version's format; False if it fails (§4.2 line 7)."""
    cfg = plan.config
    if not plan.capture_bs:
        return not (plan.failure and plan.failure.kind == kind)
    version = cfg.version
    bs = list(plan.capture_bs)
    spec = cfg.speculative is not None and cfg.draft is not None
    phase = ("verify" if spec else "decode") if runner == "target" else "decode"
    if version == "0.5.23":
        per_req = cfg.speculative.num_draft_tokens if (spec and runner == "target") else 1
        # 0.5.23 lists the sizes on the end line only (cuda_graph_setup.py).
        log.all_ranks(lambda r: f"Capture {runner} {phase} CUDA graph begin. backend=full, "
                                f"num_tokens_per_req={per_req}, avail mem={_gb(before(r) or 0)} GB")
    else:
        if runner == "target":  # cuda_graph_runner.py __init__, log_info_on_rank0 (§2.1)
            log.line(f"Capture cuda graph bs {bs}", 0)
        log.all_ranks(lambda r: "Capture cuda graph begin. This can take up to several minutes. "
                                f"avail mem={_gb(before(r) or 0)} GB")
    t = wait(len(bs) * layers * delays.capture_s_per_graph_layer)
    if plan.failure and plan.failure.kind == kind:
        return False
    log.all_ranks(lambda r: _capture_end(version, f"{runner} {phase}", "cuda graph", t, nbytes,
                                         (before(r) or 0) - nbytes, bs))
    pg = plan.prefill_graph_bytes if runner == "target" else 0
    if pg:
        t = wait(PREFILL_GRAPH_CAPTURE_S)
        log.all_ranks(lambda r: _capture_end(version, "target prefill", "piecewise CUDA graph", t, pg,
                                             (before(r) or 0) - nbytes - pg))
    return True


def _capture_end(version: str, name_0523: str, name_old: str, elapsed_s: float, usage: int, avail: int,
                 bs: list[int] | None = None) -> str:
    """A ``Capture ... end`` line in the version's format (§4.2 line 7)."""
    if version == "0.5.23":
        sizes = f"bs={bs}, " if bs is not None else ""
        return (f"Capture {name_0523} CUDA graph end. {sizes}elapsed={elapsed_s:.2f} s, mem usage={_gb(usage)} GB, "
                f"avail mem={_gb(avail)} GB.")
    return (f"Capture {name_old} end. Time elapsed: {elapsed_s:.2f} s. mem usage={_gb(usage)} GB. "
            f"avail mem={_gb(avail)} GB.")


def kill_process_tree() -> None:
    """End this process as SGLang's ``kill_process_tree`` does: SIGKILL (status 137, ``9/KILL``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), 9)


def engine_spec(plan: MemoryPlan, seed: int = 0, scheduler: str = "0.5") -> EngineSpec:
    """The engine's settings from a successful startup: pool size, limits, headroom, cost inputs.

    Args:
        plan: A ledger without failure.
        seed: Seed of generated tokens.
        scheduler: Scheduler generation (``--sim-scheduler``, a key of
            :data:`tuner.sim.costmodel.SCHEDULER_CPU`): its CPU cost per step.
    """
    cfg = plan.config
    spec = cfg.speculative if cfg.draft is not None else None
    cost = CostInputs.from_specs(
        cfg.model, cfg.gpu, tp_size=cfg.tp_size, kv_cell_bytes=int(plan.target_cell_bytes),
        weight_bytes_per_gpu=plan.weight_bytes,
        spec_num_steps=spec.num_steps if spec else 0,
        spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
    ).with_parallel(dp_size=cfg.dp_size, dcp_size=cfg.dcp_size).with_scheduler(scheduler)
    if cfg.dsa is not None:
        cost = cost.with_dsa(index_cell_bytes=int(cfg.dsa.indexer_row_bytes * cfg.model.num_layers),
                             index_topk=cfg.model.index_topk or 0, index_n_heads=cfg.model.index_n_heads or 0,
                             index_head_dim=cfg.model.index_head_dim or 0)
    return EngineSpec(
        max_total_num_tokens=plan.logical_tokens,
        max_running_requests=plan.max_running_requests * cfg.dp_size,
        chunked_prefill_size=cfg.chunked_prefill_size,
        max_prefill_tokens=cfg.max_prefill_tokens,
        page_size=cfg.page_size,
        schedule_policy=cfg.schedule_policy,
        schedule_conservativeness=cfg.schedule_conservativeness,
        enable_mixed_chunk=cfg.enable_mixed_chunk,
        cuda_graph_max_bs=max(plan.capture_bs) if plan.capture_bs else 0,
        capture_bs=tuple(plan.capture_bs),
        cuda_graph_padding=not cfg.disable_cuda_graph_padding,
        disable_radix_cache=cfg.disable_radix_cache,
        context_len=min(cfg.context_len, plan.request_pool_tokens) if cfg.dp_size > 1 else cfg.context_len,
        hicache_host_tokens=plan.hicache_host_tokens if cfg.enable_hierarchical_cache else None,
        hicache_write_policy=cfg.hicache_write_policy,
        activation_headroom_bytes=plan.available_bytes,
        cost=cost,
        version=cfg.version,
        decode_log_interval=cfg.decode_log_interval,
        seed=seed,
        speculative=speculative.spec_model(plan),
        scheduler_recv_interval=int(cfg.server_args.get("scheduler_recv_interval") or 1),
        # 0.5.5 server_args.py: speculative decoding turns the overlap scheduler off
        overlap_schedule=not cfg.server_args.get("disable_overlap_schedule") and cfg.speculative is None,
    )
