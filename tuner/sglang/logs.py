"""SGLang server log parsing: memory accounting per rank, scheduler facts, runtime events, failures.

One concept: turn SGLang's own output (a file, a ``journalctl`` stream or a live pipe) into a typed
:class:`LogReport`. The parser reads every format of ``shared/sglang-reference.md`` §4 (0.5.5,
0.5.10, 0.5.16, 0.5.23) and tolerates what real logs carry: journald prefixes (``short`` and
``short-iso``), ANSI colour, rank prefixes (``[ts TP3]``, ``[ts DP0 TP0]``), interleaved ranks,
truncated lines and unrelated lines, which are ignored. A number that is not in the log is
``None``, never 0.

Failures are classified into :class:`~tuner.sglang.failures.FailureClass` from their evidence line
(§4.3, §4.4, §1.1); the most specific evidence wins (a ``Capture cuda graph failed: CUDA out of
memory`` beats the ``Scheduler hit an exception`` that follows it). A generic CUDA OOM is classed by
where it was raised: the innermost known frame of its traceback, else the startup phase reached.
"""

from __future__ import annotations

import gzip
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from tuner.errors import LogError
from tuner.sglang.failures import Failure, FailureClass
from tuner.sglang.phases import FORWARD_FRAMES, SERVING, UNKNOWN, failure_phase, startup_frame
from tuner.sglang.wrapped import CAPTURE_FAILED, capture_cause

__all__ = [
    "log_error_line",
    "LineFormat",
    "LINE_FORMATS",
    "match_format",
    "matching_formats",
    "RankMemory",
    "SchedulerInfo",
    "Retraction",
    "BatchLine",
    "BatchSummary",
    "InputRejection",
    "OOMDetail",
    "LogReport",
    "AllocatorRetry",
    "LogWatcher",
    "parse_log",
    "read_log",
    "classify",
    "clean_line",
    "outcome_of",
    "non_memory_fatal",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
_MAX_BATCH_LINES = 2000
_MAX_LOGGED_LINES = 200
_NUM = r"(-?\d+(?:\.\d+)?)"

# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


class RankMemory(BaseModel):
    """GPU memory accounting of one rank, in startup order (§4.2). GiB = 2^30 bytes (§0 Units).

    Every field is ``None`` when its line is absent from the log.

    Attributes:
        rank: The rank prefix (``"TP3"``, ``"DP0 TP0"``), ``None`` without a prefix (tp = 1).
        baseline_gib: ``mem usage=`` of ``Init torch distributed ends`` (0.5.5/0.5.10) or
            ``Memory baseline taken`` (0.5.23): memory taken by distributed init (§4.2 item 1).
        load_begin_avail_gib: ``Load weight begin. avail mem=``: free memory at the baseline,
            the ``B`` of the capacity model (§8).
        weight_gib: ``Load weight end ... mem usage=``: weights ``W`` (§4.2 item 3).
        weight_end_avail_gib: ``Load weight end ... avail mem=``.
        model_class: ``type=`` of the weight line (``DeepseekV3ForCausalLM``).
        weight_dtype: ``dtype=`` (0.5.5) or the ``quant=`` part (0.5.10+).
        kv_tokens: ``KV Cache is allocated. #tokens:``: ``max_total_num_tokens`` (§4.2 item 5).
        k_size_gib, v_size_gib: MHA pools; kv_size_gib: MLA / single-buffer pools.
        kv_dtype: ``dtype:`` of the KV line (0.5.16+) or ``Using KV cache dtype:``.
        memory_pool_end_avail_gib: ``Memory pool end. avail mem=`` (§4.2 item 6).
        graph_begin_avail_gib: ``avail mem=`` of the first graph-capture begin line.
        graph_gib: sum of ``mem usage=`` over every capture end line (§4.2 item 7).
        graph_end_avail_gib: ``avail mem=`` of the last capture end line.
        graph_capture_s: summed capture time in seconds.
        graph_bs: the captured decode batch sizes, when the log lists them (0.5.23).
        verify_graph_gib: ``mem usage=`` of the speculative verify capture lines (0.5.23 ``Capture
            target verify CUDA graph end``): the part of ``graph_gib`` that holds
            ``num_draft_tokens`` tokens a request.
        swa_tokens, swa_pool_gib: ``SWAKVPool mem usage: X GB, swa size: A, full size: B`` of
            hybrid SWA models (``kv_tokens`` is then the full pool B unless a KV line says more).
        mamba_cache_gib: ``conv_state + ssm_state`` of ``Mamba Cache is allocated`` (hybrid models).
        draft: the draft model's own lines with speculative decoding (§4.1), else ``None``.
    """

    model_config = _FROZEN

    rank: str | None = None
    baseline_gib: float | None = None
    load_begin_avail_gib: float | None = None
    weight_gib: float | None = None
    weight_end_avail_gib: float | None = None
    model_class: str | None = None
    weight_dtype: str | None = None
    kv_tokens: int | None = None
    k_size_gib: float | None = None
    v_size_gib: float | None = None
    kv_size_gib: float | None = None
    kv_dtype: str | None = None
    memory_pool_end_avail_gib: float | None = None
    graph_begin_avail_gib: float | None = None
    graph_gib: float | None = None
    graph_end_avail_gib: float | None = None
    graph_capture_s: float | None = None
    graph_bs: list[int] | None = None
    verify_graph_gib: float | None = None
    swa_tokens: int | None = None
    swa_pool_gib: float | None = None
    mamba_cache_gib: float | None = None
    draft: RankMemory | None = None

    @property
    def kv_pool_gib(self) -> float | None:
        """KV pool size in GiB: ``KV size`` or ``K size + V size``; for hybrid SWA models the
        ``SWAKVPool mem usage`` total of both parts; ``None`` when not logged."""
        if self.swa_pool_gib is not None:
            return self.swa_pool_gib
        if self.kv_size_gib is not None:
            return self.kv_size_gib
        if self.k_size_gib is not None and self.v_size_gib is not None:
            return self.k_size_gib + self.v_size_gib
        return None

    @property
    def kv_pool_consumed_gib(self) -> float | None:
        """Drop of free memory from ``Load weight end`` to ``Memory pool end`` (KV + req_to_token)."""
        if self.weight_end_avail_gib is None or self.memory_pool_end_avail_gib is None:
            return None
        return round(self.weight_end_avail_gib - self.memory_pool_end_avail_gib, 2)

    @property
    def cuda_graph_max_bs(self) -> int | None:
        """Largest captured decode batch size, when the log lists the sizes (case-21)."""
        return max(self.graph_bs) if self.graph_bs else None


class SchedulerInfo(BaseModel):
    """The scheduler line ``max_total_num_tokens=..., available_gpu_mem=...`` (§4.2 item 8).

    ``max_running_requests`` is the *effective* value (§2.3); ``available_gpu_mem_gib`` is the
    free memory after graphs, the runtime headroom (§8). ``max_total_num_tokens`` is always one
    rank's pool: since sglang#32730 a DCP server prints the logical count with the per-rank math,
    ``max_total_num_tokens=26462720 (3307840 per rank * dcp_size 8)``; then ``max_total_num_tokens``
    is 3,307,840, ``logical_tokens`` 26,462,720 and ``dcp_size`` 8. From 0.5.21 a DCP server prints
    the logical count with no math (:data:`tuner.sglang.levers.DCP_LOGICAL_REPORT_SINCE`): it is read
    as such where it is one rank's KV line × the logged ``dcp_size`` (:func:`_scheduler_info`).
    ``None`` on a per-rank line.
    """

    model_config = _FROZEN

    max_total_num_tokens: int | None = None
    logical_tokens: int | None = None
    dcp_size: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int | None = None
    max_running_requests: int | None = None
    context_len: int | None = None
    available_gpu_mem_gib: float | None = None


class Retraction(BaseModel):
    """``KV cache pool is full. Retract requests.`` (§4.4): the soft capacity signal."""

    model_config = _FROZEN

    retracted_reqs: int
    new_tokens_gained: int | None = None
    new_token_ratio_before: float | None = None
    new_token_ratio_after: float | None = None
    timestamp: str | None = None
    rank: str | None = None
    running_req_before: int | None = None
    """``#running-req`` of the rank's last decode line before this retraction (§4.5)."""
    num_token_before: int | None = None
    """``#token`` (KV tokens held by running requests) of that decode line."""
    token_usage_before: float | None = None
    """``token usage`` of that decode line."""


class AllocatorRetry(BaseModel):
    """torch's ``CUDACachingAllocator`` warning ``memory allocation failed with OOM on device D while
    trying to allocate N bytes (free: F, total: T)``: the allocator freed its cached blocks and
    retried. A warning of thin headroom, not a failure and not the KV allocator. Bytes as printed."""

    model_config = _FROZEN

    count: int
    device: int
    tried_bytes: int
    free_bytes: int | None = None
    total_bytes: int | None = None


class BatchLine(BaseModel):
    """One ``Prefill batch`` / ``Decode batch`` line (§4.5). Absent fields are ``None``."""

    model_config = _FROZEN

    kind: Literal["prefill", "decode"]
    timestamp: str | None = None
    rank: str | None = None
    new_seq: int | None = None
    new_token: int | None = None
    cached_token: int | None = None
    running_req: int | None = None
    queue_req: int | None = None
    num_token: int | None = None
    """``#token`` (decode) or ``#full token`` (hybrid SWA): KV tokens held by running requests."""
    token_usage: float | None = None
    full_token_usage: float | None = None
    swa_token_usage: float | None = None
    cuda_graph: bool | None = None
    gen_throughput_tok_s: float | None = None
    input_throughput_tok_s: float | None = None
    accept_len: float | None = None
    cache_hit_rate_pct: float | None = None


class BatchSummary(BaseModel):
    """Summary over every batch line of the log (the kept ``batches`` list is bounded)."""

    model_config = _FROZEN

    prefill_lines: int = 0
    decode_lines: int = 0
    max_running_req: int | None = None
    max_token_usage: float | None = None
    decode_lines_without_cuda_graph: int = 0
    max_running_req_without_cuda_graph: int | None = None


class InputRejection(BaseModel):
    """A request rejected as too long (§1.4, §4.4); the server stays up."""

    model_config = _FROZEN

    input_tokens: int
    max_allowed_tokens: int
    limit: Literal["max_req_input_len", "context_length"]
    rank: str | None = None


class LoggedValue(BaseModel):
    """One number of a recognised line, as SGLang printed it (``value`` in ``unit``; a list for
    ``bs=[...]``-style lists). GB in SGLang's GPU lines is GiB (§0 Units)."""

    model_config = _FROZEN

    value: float | int | list[int]
    unit: str | None = None


class LoggedLine(BaseModel):
    """Every number of one recognised SGLang line (``tuner explain``'s ``logged`` block).

    Attributes:
        line: What the line is: ``load_weight_begin``, ``load_weight_end``, ``kv_cache_allocated``,
            ``memory_pool_end``, ``capture_begin``, ``capture_end``, ``capture_progress``,
            ``scheduler``, ``oom``, ``kv_allocator``, ``retraction``, ``prefill_batch``, ... .
        role: ``target`` or ``draft`` for lines speculative decoding prints twice, else ``None``.
        values: Name as printed (``avail mem``, ``#tokens``, ``K size``) → value and unit.
        text: The line itself (prefixes stripped, at most 300 characters).
    """

    model_config = _FROZEN

    line: str
    role: str | None = None
    values: dict[str, LoggedValue]
    text: str


class KVShortfall(BaseModel):
    """The KV allocator's ``Prefill/Decode out of memory. Try to lower your batch size.`` message
    and its continuation lines (§4.4; ``mem_cache/common.py`` 0.5.5/0.5.10, ``allocation.py``
    0.5.23; older releases print ``Avaliable tokens:`` and ``available_size()=``). Token counts.
    """

    model_config = _FROZEN

    kind: Literal["prefill", "decode", "allocator"]
    requested_tokens: int | None = None
    available_tokens: int | None = None
    available_size: int | None = None
    evictable_size: int | None = None


class OOMDetail(BaseModel):
    """Numbers of torch's ``CUDA out of memory. Tried to allocate X. GPU n has a total capacity of Y``."""

    model_config = _FROZEN

    tried_to_allocate_mib: float | None = None
    vendor: Literal["cuda", "hip"] | None = None
    """``HIP out of memory`` (ROCm) or ``CUDA out of memory``."""
    gpu_index: int | None = None
    total_capacity_gib: float | None = None
    free_mib: float | None = None
    """``of which X MiB is free``: free memory on that GPU when the allocation failed."""


class LogReport(BaseModel):
    """Everything one SGLang log says about memory, capacity, events and failure.

    Attributes:
        version_format: Newest §4 log format recognized (``"0.5.5"``, ``"0.5.10"``,
            ``"0.5.16"``, ``"0.5.23"``), ``None`` when no version-specific line was seen.
        ranks: Memory accounting per rank prefix (``""`` for lines without one).
        scheduler: The scheduler line, if logged.
        host_pool_gb: HiCache host pool per rank in decimal GB (§7, §4.2 item 9).
        host_pool_tokens: HiCache host pool in tokens (0.5.23 line only).
        host_pool_ranks: The ranks that logged a host-pool allocation (each allocates its own, §7).
        ready: ``The server is fired up and ready to roll!`` was seen.
        retractions: Every retraction line.
        batches: The last batch lines (bounded); ``batch_summary`` covers all of them.
        failure: The classified failure, with its evidence, if any.
        failure_site: The traceback frame the failure was raised in (``init_memory_pool``,
            ``load_model``, ``capture``), when the log holds its traceback.
        warnings: What the parser noticed and the reader should know (missing lines, caps).
        kv_cache_dtype: ``Using KV cache dtype: torch.bfloat16`` → ``"torch.bfloat16"``.
        max_total_tokens_requested / max_total_tokens_profiled: the ``max_total_tokens=X is
            larger than the profiled value Y`` warning (§1.4).
        max_running_requests_reset_for_speculative: the ``reset to 48`` warning was seen (§1.5).
        max_running_requests_requested / max_running_requests_reduced_to: the 0.5.16+ reduction
            warning (§2.3).
        input_rejections: Too-long requests (case-26).
        oom: Numbers of a CUDA OOM message, if any.
        req_slots_available / req_slots_requested: ``alloc_req_slots`` numbers (case-29).
        server_args: ``key=value`` pairs of a logged ``server_args=ServerArgs(...)`` (0.5.5, 0.5.10) or
            ``server_args={...}`` (0.5.23, a dict) line and
            flags of a logged launch command, as strings.
        exit_status: The process exit status, when a systemd line reports it.
        sglang_lines: How many lines were recognized as SGLang output.
        soft_failure: A diagnosis of a server that kept running (``retraction_storm``), never a
            launch failure (``failure`` stays ``None`` for it).
        kv_shortfall: The KV allocator's page shortfall numbers, if its message was logged.
        logged: Every number of every recognised line, per rank prefix (``""`` without one), in
            log order, plus the last prefill and decode batch line of each rank (bounded).
        capture_progress_avail_gib: ``avail_mem`` of the last ``Capturing batches (bs=.. avail_mem=..)``
            progress line: free memory while capture was still running.
        weights_committed_after_capture: 0.5.23 ``--startup-weight-load-mode overlap`` printed
            ``Load weight end. Committed real weights ...``: its weight line has no memory numbers.
        last_phase: The last startup phase line seen (see :attr:`LogWatcher.phase`).
    """

    model_config = _FROZEN

    version_format: str | None = None
    ranks: dict[str, RankMemory] = Field(default_factory=dict)
    scheduler: SchedulerInfo | None = None
    host_pool_gb: float | None = None
    host_pool_tokens: int | None = None
    host_pool_ranks: list[str] = Field(default_factory=list)
    ready: bool = False
    retractions: list[Retraction] = Field(default_factory=list)
    batches: list[BatchLine] = Field(default_factory=list)
    batch_summary: BatchSummary = Field(default_factory=BatchSummary)
    failure: Failure | None = None
    failure_site: str | None = None
    warnings: list[str] = Field(default_factory=list)
    kv_cache_dtype: str | None = None
    max_total_tokens_requested: int | None = None
    max_total_tokens_profiled: int | None = None
    max_running_requests_reset_for_speculative: bool = False
    max_running_requests_requested: int | None = None
    max_running_requests_reduced_to: int | None = None
    input_rejections: list[InputRejection] = Field(default_factory=list)
    oom: OOMDetail | None = None
    server_args: dict[str, str] = Field(default_factory=dict)
    req_slots_available: int | None = None
    req_slots_requested: int | None = None
    exit_status: int | None = None
    sglang_lines: int = 0
    soft_failure: Failure | None = None
    kv_shortfall: KVShortfall | None = None
    logged: dict[str, list[LoggedLine]] = Field(default_factory=dict)
    capture_progress_avail_gib: float | None = None
    weights_committed_after_capture: bool = False
    last_phase: str | None = None
    allocator_retry: AllocatorRetry | None = None
    transformers_fallback: str | None = None
    """The ``... falling back to Transformers implementation`` line: the architecture has no native
    SGLang class, so its memory and kernels are not SGLang's own."""

    def primary(self) -> RankMemory | None:
        """The binding rank, as SGLang takes it: both of its memory readings are a MIN over ranks
        (§1.1), so the rank with the least free memory after weights; among the ranks that printed
        the KV line when some did (a rank that printed nothing of the pool, e.g. TP0 in a cut
        excerpt, is never preferred, case-41), then the least free memory after the pool; else
        TP0, else the first rank seen."""
        if not self.ranks:
            return None
        ranks = list(self.ranks.values())
        with_kv = [r for r in ranks if r.kv_tokens is not None]
        pool = with_kv or ranks
        for attr in ("weight_end_avail_gib", "memory_pool_end_avail_gib"):
            with_avail = [r for r in pool if getattr(r, attr) is not None]
            if with_avail:
                return min(with_avail, key=lambda r: getattr(r, attr))
        if with_kv:
            return with_kv[0]
        for key in ("TP0", "DP0 TP0", ""):
            if key in self.ranks:
                return self.ranks[key]
        return ranks[0]

    @property
    def cuda_graph_max_bs(self) -> int | None:
        """Largest captured decode batch size on any rank (0.5.5 logs the list on rank 0 only)."""
        sizes = [r.cuda_graph_max_bs for r in self.ranks.values() if r.cuda_graph_max_bs is not None]
        return max(sizes) if sizes else None

    @property
    def diagnosis(self) -> Failure | None:
        """The failure, else the soft diagnosis of a server that kept running."""
        return self.failure or self.soft_failure

    @property
    def max_total_num_tokens(self) -> int | None:
        """Effective ``max_total_num_tokens``: the scheduler line, else the KV line of the primary rank."""
        if self.scheduler and self.scheduler.max_total_num_tokens is not None:
            return self.scheduler.max_total_num_tokens
        prim = self.primary()
        return prim.kv_tokens if prim else None


def _scheduler_info(line: dict[str, Any], ranks: Mapping[str, RankMemory], server_args: Mapping[str, str]) -> SchedulerInfo:
    """The scheduler line's fields, its count as one rank's pool: a plain count that is one rank's
    KV-line rows × ``dcp_size`` is the logical count a DCP server prints from 0.5.21
    (``levers.DCP_LOGICAL_REPORT_SINCE``; the KV line's ``#tokens`` is one rank's rows in every
    version). ``dcp_size`` comes from the logged server args; without them (a cut log) an exact
    multiple of at least 2 of the KV line's rows is read the same way (a scheduler never reports
    more tokens than its pool otherwise)."""
    info = dict(line)
    tokens = info.get("max_total_num_tokens")
    rows = next((r.kv_tokens for r in ranks.values() if r.kv_tokens), None)
    dcp = server_args.get("dcp_size")
    dcp_size = int(dcp) if dcp is not None and str(dcp).isdigit() else None
    if info.get("dcp_size") is None and tokens and rows and tokens > rows and tokens % rows == 0:
        if (dcp_size is None and "dcp_size" not in server_args) or tokens == rows * (dcp_size or 1):
            info.update(max_total_num_tokens=rows, logical_tokens=tokens, dcp_size=tokens // rows)
    return SchedulerInfo(**info)


# ---------------------------------------------------------------------------------------------
# Line cleaning: journald prefixes, ANSI colour, SGLang's [timestamp rank] prefix
# ---------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
_JOURNAL_SHORT = re.compile(
    r"^[A-Z][a-z]{2} [ \d]?\d \d\d:\d\d:\d\d(?:\.\d+)? \S+ (?P<ident>[^\s\[:]+)(?:\[\d+\])?: "
)
_JOURNAL_ISO = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)? \S+ (?P<ident>[^\s\[:]+)(?:\[\d+\])?: "
)
_JOURNAL_NUMERIC = re.compile(r"^\[?\s*\d+\.\d+\]? \S+ (?P<ident>[^\s\[:]+)(?:\[\d+\])?: ")
"""``journalctl -o short-unix`` / ``short-monotonic`` prefixes."""
_GLUED = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[^\]]{0,60}\] ")
_HEAD = re.compile(r"^\[?(?P<head>[^\[\]]{0,120})\]\s?")
_TIME = re.compile(r"(?:\d{4}-\d\d-\d\d[ T])?\d\d:\d\d:\d\d(?:[.,]\d+)?")
_RANK_TOKEN = re.compile(r"\b(?:ATTN_CP|ATTN_DP|ATTN_TP|MOE_DP|MOE_EP|DP|PP|TP|EP|CP)\d+\b")
"""Rank-prefix tokens (0.5.23 adds ``ATTN_CP`` and ``MOE_DP``: ``scheduler.py`` builds the prefix)."""
_SYSTEMD_EXIT = re.compile(r"Main process exited, code=(?P<code>\w+), status=(?P<status>\d+)")


def clean_line(raw: str) -> tuple[str, str | None, str | None, str | None]:
    """Strip ANSI colour, a journald prefix and SGLang's ``[timestamp rank]`` prefix (§4.1).

    Args:
        raw: One line as read (may end in a newline, may be truncated).

    Returns:
        ``(message, rank, timestamp, journal_ident)``: ``rank`` like ``"TP3"`` or ``"DP0 TP0"``
        (``None`` without one), ``timestamp`` the SGLang timestamp text, ``journal_ident`` the
        journald identifier (``python``, ``systemd``) when a journald prefix was present.
    """
    line = raw.rstrip("\r\n")
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if "\x00" in line:
        line = line.replace("\x00", "")
    if "\r" in line:  # tqdm progress bars redraw with \r; the last segment is what stays on screen
        line = line.rsplit("\r", 1)[-1]
    glued = _GLUED.search(line, 1) if line.find("[20", 1) != -1 else None
    if glued:  # an SGLang line glued after a progress bar: "  0%| | 0/13 [..][2025-03-08 12:29:21 TP1] Capture ..."
        line = line[glued.start():]
    ident = None
    if line[:1] != "[" or line[1:2] == " ":  # SGLang's own prefix starts "[2"; journald's do not
        for pat in (_JOURNAL_SHORT, _JOURNAL_ISO, _JOURNAL_NUMERIC):
            m = pat.match(line)
            if m:
                ident = m.group("ident")
                line = line[m.end():]
                break
    rank = ts = None
    m = _HEAD.match(line)
    if m:
        head = m.group("head")
        ranks = _RANK_TOKEN.findall(head)
        tm = _TIME.search(head)
        if tm or ranks or head.startswith("gpu="):
            ts = tm.group(0) if tm else None
            rank = " ".join(ranks) if ranks else None
            line = line[m.end():]
    return line.strip(), rank, ts, ident


# ---------------------------------------------------------------------------------------------
# Patterns
# ---------------------------------------------------------------------------------------------

_DCP_LOGICAL = re.compile(r"\s*\((\d+) per rank \* dcp_size (\d+)\)")
"""The per-rank math after a logical ``max_total_num_tokens`` on a DCP server (sglang#32730)."""

_P = {
    "dist_begin": re.compile(r"^Init torch distributed begin\."),
    "parallel_end": re.compile(r"^Init parallel ends\. elapsed=" + _NUM + " s"),
    "dist_end": re.compile(r"Init torch distributed ends\.(?:.*?elapsed=" + _NUM + r" s,)?.*?mem usage=" + _NUM + " GB"),
    "baseline": re.compile(r"Memory baseline taken\..*?mem usage=" + _NUM + " GB"),
    "load_begin": re.compile(r"Load weight begin\..*?avail mem=" + _NUM + " GB"),
    "load_end_committed": re.compile(r"Load weight end\. Committed real weights"),
    "load_end": re.compile(r"Load weight end\.(?P<body>.*?)avail mem=" + _NUM + r" GB(?:, mem usage=" + _NUM + " GB)?"),
    "kv_dtype": re.compile(r"Using KV cache dtype: (\S+)"),
    "kv_alloc": re.compile(
        r"KV Cache (?:is allocated|VA upper bound)\.\s*(?:dtype: (?P<dtype>[\w.]+), )?#tokens: (?P<tokens>-?\d+)"
        r"(?: \((?P<per_rank>\d+) per rank \* dcp_size (?P<dcp>\d+)\))?"
        r"(?:, K size: (?P<k>" + _NUM[1:-1] + r") GB, V size: (?P<v>" + _NUM[1:-1] + r") GB"
        r"|, KV size: (?P<kv>" + _NUM[1:-1] + r") GB)?"
    ),
    "post_capture": re.compile(r"Post-capture KV sizing: KV cache allocated\.\s*(?:dtype: (?P<dtype>[\w.]+), )?#tokens: (?P<tokens>\d+), KV size: " + _NUM + " GB"),
    "mamba": re.compile(r"Mamba Cache is allocated\..*?conv_state size: " + _NUM + r" ?GB, ssm_state size: " + _NUM + r" ?GB"),
    "swa_pool": re.compile(r"SWAKVPool mem usage: " + _NUM + r" GB, swa size: (\d+), full size: (\d+)"),
    "pool_end": re.compile(r"Memory pool end\..*?avail mem=" + _NUM + " GB"),
    "cap_progress": re.compile(r"Capturing (?:batches \(bs=(?P<bs>\d+)|num tokens \(num_tokens=(?P<nt>\d+)) avail_mem=(?P<avail>" + _NUM[1:-1] + r") GB\)"),
    "cap_bs_list": re.compile(r"Capture cuda graph bs \[([\d,\s]*)\]"),
    "cap_begin": re.compile(r"Capture (?P<name>.*?) begin\.(?P<body>.*)"),
    "cap_end": re.compile(r"Capture (?P<name>.*?) end\.(?P<body>.*)"),
    "scheduler": re.compile(r"max_total_num_tokens=(?P<tokens>-?\d+)(?P<rest>.*)"),
    "host_pool_old": re.compile(r"Allocating " + _NUM + r" GB host memory for hierarchical KV cache"),
    "host_pool_new": re.compile(r"Allocating (?:.*?)hierarchical KV host pool: (\d+) tokens, " + _NUM + " GB host memory"),
    "ready": re.compile(r"The server is fired up and ready to roll"),
    "retract": re.compile(r"(?:KV cache pool is full\. Retract requests\.|Decode out of memory happened\.)\s*#retracted_reqs: (\d+)"
                          r"(?:, #new_tokens_gained: (\d+))?(?:, #mamba_num_gained: \d+)?(?:, #new_token_ratio: " + _NUM + r" -> " + _NUM + ")?"),
    "batch": re.compile(r"(?P<kind>Prefill|Decode) batch(?: \[\d+\])?[.,]\s*(?P<body>.*)"),
    "mtt_larger": re.compile(r"max_total_tokens=(-?\d+) is larger than the profiled value (-?\d+)"),
    "mrr_spec": re.compile(r"Max running requests is reset to (\d+) for speculative decoding"),
    "mrr_reduced": re.compile(r"max_running_requests was reduced from the requested (\d+) to (\d+)"),
    "input_long": re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)"),
    "input_ctx": re.compile(r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)"),
    "server_args": re.compile(r"server_args=(?:ServerArgs\((?P<obj>.*)\)?|(?P<dict>\{.*))"),
    "req_slots": re.compile(r"req_to_token_pool\.available_size\(\)=(\d+)(?:, num_reqs=(\d+))?"),
    "alloc_try": re.compile(r"^Try to allocate (\d+) tokens"),
    "alloc_avail": re.compile(r"^Ava(?:ila|lia)ble (?:full )?tokens: (\d+)(?: \((?:full_)?available_size=(\d+) \+ (?:full_)?evictable_size=(\d+)\))?"),
    "alloc_avail_old": re.compile(r"token_to_kv_pool(?:_allocator)?\.available_size\(\)=(\d+)"),
    "alloc_evict_old": re.compile(r"tree_cache\.evictable_size\(\)=(\d+)"),
    "serving": re.compile(r"\"(?:POST|GET) /\S+ HTTP/1\.[01]\" \d{3}|sglang\.bench_serving|bench_serving\.py"),
    "oom_tried": re.compile(r"Tried to allocate " + _NUM + r" ?(MiB|GiB|KiB|B)"),
    "oom_gpu": re.compile(r"GPU (\d+) has a total capacity of " + _NUM),
    "oom_free": re.compile(r"of which " + _NUM + r" (MiB|GiB|KiB|B) is free"),
    "alloc_retry": re.compile(r"memory allocation failed with OOM on device (\d+) while trying to allocate (\d+) bytes"
                              r"(?: \(free: (\d+), total: (\d+)\))?"),
    "transformers_fallback": re.compile(r"(?i)^(?!.*\bvllm\b).*falling back to (?:the )?Transformers implementation"),
    "command": re.compile(r"(?:^|[\s$>#])(?:python3?\s+-m\s+sglang\.launch_server|sglang\s+serve)(?:\s+\\?\s*$|\s+(?:\S+\s+)*?--[a-z])"),
    "flag_line": re.compile(r"^--[a-z][\w-]*(?:[ =]\S+)?$"),
    "frame": re.compile(r'^File "(?P<file>[^"]*)", (?:line \d+, )?in (?P<func>[\w<>.]+)'),
}

_BATCH_RUNNING = re.compile(r"#running-req: (\d+)")
_BATCH_USAGE = re.compile(r"(?<!swa )token usage: ([\d.]+)")
_BATCH_FIELDS = {
    "#new-seq": ("new_seq", int),
    "#new-token": ("new_token", int),
    "#cached-token": ("cached_token", int),
    "#running-req": ("running_req", int),
    "#queue-req": ("queue_req", int),
    "#token": ("num_token", int),
    "#full token": ("num_token", int),
    "token usage": ("token_usage", float),
    "full token usage": ("full_token_usage", float),
    "swa token usage": ("swa_token_usage", float),
    "cuda graph": ("cuda_graph", bool),
    "gen throughput (token/s)": ("gen_throughput_tok_s", float),
    "input throughput (token/s)": ("input_throughput_tok_s", float),
    "accept len": ("accept_len", float),
    "cache hit rate": ("cache_hit_rate_pct", float),
}

# Version markers (§4.2): the newest one seen names the format.
_VERSION_MARKERS: list[tuple[str, re.Pattern[str]]] = [
    ("0.5.23", re.compile(r"Memory baseline taken|Init parallel ends|Capture (?:target|draft) \w+ CUDA graph|hierarchical KV host pool:|Post-capture KV sizing")),
    ("0.5.16", re.compile(r"KV Cache is allocated\. dtype:|Capture \S+ \S+ end\. elapsed=")),
    ("0.5.10", re.compile(r"Init torch distributed ends\. elapsed=|Load weight end\. elapsed=|Capture piecewise CUDA graph|#new_tokens_gained")),
    ("0.5.5", re.compile(r"Init torch distributed ends\. mem usage|Load weight end\. type=.*dtype=|Capture cuda graph end\. Time elapsed")),
]


# Where a generic CUDA OOM was raised, by the function or file of a traceback frame (§4.3, §4.4,
# SGLang's model_runner.py / cuda_graph_runner.py / scheduler.py); the innermost match wins.
# "reserve": allocated after the KV pool is sized, from the (1 - mfs) reserve (§1.2, §1.6): the
# req_to_token table and the KV pool in init_memory_pool, graphs, a 0.5.5/0.5.10 draft worker.
_OOM_SITES: list[tuple[str, re.Pattern[str]]] = [
    ("graphs", re.compile(r"capture|cuda_graph|graph_runner|init_device_graphs")),
    ("batch", re.compile(r"^(?:event_loop_\w+|run_batch|forward_batch_generation|forward_thread_func_?|process_batch_result\w*)$")),
    ("forward", re.compile(FORWARD_FRAMES)),
    ("pool", re.compile(r"init_memory_pool|profile_max_num_token|_profile_available_bytes|memory_pool|kv_cache_configurator"
                        r"|pool_configurator|ReqToTokenPool|TokenToKVPool|_create_buffers")),
    ("weights", re.compile(r"^(?:load_model|load_weights\w*|get_model|load_weight\w*|weight_loader)$|model_loader")),
]


def _vkey(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


# Failure evidence, most specific first: (priority, class, pattern). Generic CUDA OOM text is
# classified by the startup phase it occurred in (see LogWatcher._oom_class).
_FAILURES: list[tuple[int, FailureClass | None, re.Pattern[str]]] = [
    (90, FailureClass.STARTUP_KV_OOM, re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static")),
    (90, FailureClass.STARTUP_KV_OOM, re.compile(r"Loaded weights leave no GPU memory for the KV cache")),
    (90, FailureClass.STARTUP_KV_OOM, re.compile(r"Memory pool size is too small")),
    (90, FailureClass.HOST_MEMORY, re.compile(r"Not enough host memory available")),
    (90, FailureClass.HOST_MEMORY, re.compile(r"The host memory should be larger than the device memory")),
    (90, FailureClass.UNBALANCED_MEMORY, re.compile(r"The memory capacity is unbalanced")),
    (90, FailureClass.REQUEST_SLOT_EXHAUSTION, re.compile(r"alloc_req_slots runs out of memory")),
    # Fatal and not memory: a kernel built without an image for this GPU's architecture (raised by
    # the first launch, e.g. at graph capture on a new GPU), a Triton kernel over the hardware's
    # shared memory. Specific evidence: they beat the scheduler's exception line that follows.
    (88, FailureClass.CRASH, re.compile(r"no kernel image is available for execution on the device")),
    (88, FailureClass.CRASH, re.compile(r"OutOfResources: out of resource: ")),
    (85, FailureClass.INVALID_ARGUMENTS, re.compile(r"(?:launch_server(?:\.py)?|sglang(?: serve)?|\S+\.py): error: |error: unrecognized arguments|error: ambiguous option|error: argument --")),
    (80, FailureClass.KV_PAGE_SHORTFALL, re.compile(r"(?:Prefill|Decode)? ?[Oo]ut of memory\. Try to lower your batch size"
                                                           r"|^(?:RuntimeError: )?memory allocation failed with OOM\s*$")),
    (70, None, re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA OOM|HIP out of memory|(?:CUDA|HIP) error: out of memory"
                          r"|hipErrorOutOfMemory|cudaErrorMemoryAllocation")),
    # Fatal CUDA/HIP/NCCL errors that are not memory (an illegal access, a device assert): below a
    # CUDA OOM of the same traceback, above the scheduler's exception line. Generic text, so like
    # the OOM row it counts only as program output (_PROGRAM_OUTPUT).
    (60, FailureClass.CRASH, re.compile(r"(?:CUDA|HIP) error: (?!out of memory)|illegal memory access was encountered|device-side assert triggered"
                                        r"|NCCL error|ncclUnhandledCudaError|ncclSystemError")),
    (20, FailureClass.CRASH, re.compile(r"Scheduler hit an exception|Received sigquit from a child|SIGQUIT received|[Ss]cheduler is dead|Initialization failed|Watchdog timeout")),
]


def non_memory_fatal(evidence: str) -> bool:
    """The evidence is a fatal line that is not about memory (no kernel image for the GPU, a Triton
    kernel over the shared-memory limit, an illegal access, a device assert, NCCL): no memory knob
    can help, whatever else the log shows (case-45, case-54).

    Args:
        evidence: A failure's evidence line.

    Returns:
        Whether one of the non-memory crash rows of the failure table matches it.
    """
    return any(cls is FailureClass.CRASH and prio >= 60 and pat.search(evidence) for prio, cls, pat in _FAILURES)


_GENERIC_PRIORITIES = frozenset({60, 70})
"""The rows of :data:`_FAILURES` whose text any program (or a person) may write: torch's OOM and
CUDA/HIP/NCCL errors, not SGLang's own wording."""

_PROGRAM_OUTPUT = re.compile(
    r"[>`*\s-]*(?:[\w.]*(?:Error|Exception)\b|(?:CUDA|HIP|NCCL) (?:out of memory|error)|(?:hip|cuda|nccl)\w*Error|CUDA OOM|OutOfMemoryError)"
    r"|.*Tried to allocate \d"
)
"""A generic OOM line without a log prefix counts as evidence only when it is program output: it
starts with an exception name or torch's own ``CUDA out of memory`` / ``HIP error`` text (a
markdown quote allowed), or carries torch's ``Tried to allocate N``. Prose that names the error in
a sentence is not a log line (``tuner explain`` refuses a text of such lines)."""

_STARTUP_WORDS = re.compile(r"Init |Load weight|KV Cache|Capture|Memory baseline|host pool|new_tokens_gained|Post-capture")
"""Lines that can carry a version marker (a cheap gate before the marker patterns)."""
_FAILURE_WORDS = re.compile(
    r"[Mm]emory|[Ff]ailed|error|OOM|unbalanced|alloc_req_slots|exception|sigquit|SIGQUIT|dead|Initialization|Watchdog"
    r"|profiled value|capacity|Tried to allocate|kernel image|out of resource"
)
"""Every failure pattern contains one of these words (a cheap gate before the failure patterns)."""


_UNITS = r"GB|GiB|MiB|MB|KiB|KB|B|s|ms|%|tokens"
_NUMBER = re.compile(r"(?<![\w.\-])(-?\d+(?:\.\d+)?)(?![\w.]*\w)(?:\s?(" + _UNITS + r")\b)?")
_LIST = re.compile(r"(?P<key>[\w#]+)(?:=| )\[(?P<items>[\d,\s]*)\]")
_KEY_STOP = re.compile(r".*(?:[,;(|]|\.\s|^)")


def _numbers(msg: str) -> dict[str, dict[str, Any]]:
    """Every number of one line, named by the words before it (``avail mem=274.42 GB`` →
    ``{"avail mem": {"value": 274.42, "unit": "GB"}}``), as printed; ``key=[1, 2, 4]`` lists give
    an integer list; ``a -> b`` gives ``key`` and ``key (after)``; a name seen twice gets `` #2``."""
    out: dict[str, dict[str, Any]] = {}

    def put(key: str, value: Any, unit: str | None) -> str:
        key = key.strip(" =:.+").strip() or "value"
        name, n = key, 2
        while name in out:
            name, n = f"{key} #{n}", n + 1
        out[name] = {"value": value, "unit": unit}
        return key

    text = msg.replace("()", "  ")
    for m in _LIST.finditer(text):
        items = [int(x) for x in m.group("items").replace(" ", "").split(",") if x]
        put(m.group("key"), items, None)
        text = text[:m.start()] + " " * (m.end() - m.start()) + text[m.end():]
    last_key, last_end = None, 0
    for m in _NUMBER.finditer(text):
        before = text[last_end:m.start()]
        last_end = m.end()
        if before.strip() == "->" and last_key is not None:
            put(last_key + " (after)", float(m.group(1)), m.group(2))
            continue
        head = _KEY_STOP.match(before)
        key = (before[head.end():] if head else before).strip()
        if len(key) > 48:
            key = key[-48:].split(" ", 1)[-1]
        raw = m.group(1)
        last_key = put(key, float(raw) if "." in raw else int(raw), m.group(2))
    return out


def _float(x: str | None) -> float | None:
    return None if x is None else float(x)


def _int(x: str | None) -> int | None:
    return None if x is None else int(x)


# ---------------------------------------------------------------------------------------------
# The incremental parser
# ---------------------------------------------------------------------------------------------


@dataclass
class _Marks:
    """What the stream has shown so far, for the reading of later lines (one object, so that the
    watcher's own state does not grow a flag per mark).

    Attributes:
        prefixed: The current line carried a journal/rank/timestamp prefix (SGLang's own line).
        launch_seen: A startup line was read (server args, the command, a distributed-init line):
            a failure after it happened while the server was being built.
        capture_cause_pending: ``Capture cuda graph failed`` was read without its wrapped cause;
            the next lines may carry it.
    """

    prefixed: bool = False
    launch_seen: bool = False
    capture_cause_pending: bool = False


class LogWatcher:
    """Incremental SGLang log parser, for a launcher watching a live server or a whole file.

    Feed lines one at a time; :attr:`ready` and :attr:`failure` are current after each line
    (the failure is set as soon as the first failure line arrives and upgraded when more
    specific evidence follows). :meth:`report` freezes what was seen into a :class:`LogReport`.
    Holds no global state; one watcher per server start. ``feed`` and ``report`` may be called
    from different threads (a reader thread and a poller).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        """Forget everything seen (a new start begins)."""
        self.ready: bool = False
        self.failure: Failure | None = None
        self._failure_prio = -1
        self._ranks: dict[str, dict[str, Any]] = {}
        self._scheduler: dict[str, Any] | None = None
        self._version: str | None = None
        self._phase = "init"
        self._serving = False
        self._fields: dict[str, Any] = {}
        self._retractions: list[Retraction] = []
        self._batches: deque[list[Any]] = deque(maxlen=_MAX_BATCH_LINES)
        self._summary: dict[str, Any] = {"prefill_lines": 0, "decode_lines": 0, "decode_lines_without_cuda_graph": 0}
        self._rejections: list[InputRejection] = []
        self._oom: OOMDetail | None = None
        self._server_args: dict[str, str] = {}
        self._warnings: list[str] = []
        self._exit_status: int | None = None
        self._last_sglang_line: str | None = None
        self._sglang_lines = 0
        self._frames: deque[tuple[str, str]] = deque(maxlen=64)
        self._failure_site: str | None = None
        self._logged: dict[str, list[LoggedLine]] = {}
        self._last_batch: dict[tuple[str, str], str] = {}
        self._shortfall: dict[str, Any] | None = None
        self._progress_avail: float | None = None
        self._committed = False
        self._soft: Failure | None = None
        self._marks = _Marks()

    def _log(self, rank: str | None, line: str, msg: str, role: str | None = None) -> None:
        """Keep every number of a recognised line for the ``logged`` block (bounded per rank)."""
        key = rank or ""
        lines = self._logged.setdefault(key, [])
        if len(lines) >= _MAX_LOGGED_LINES:
            return
        values = _numbers(msg)
        if not values:
            return
        entry = LoggedLine.model_validate({"line": line, "role": role, "values": values, "text": msg[:300]})
        if lines and lines[-1] == entry:
            return
        lines.append(entry)

    # -- public ---------------------------------------------------------------------------------

    def feed(self, line: str) -> None:
        """Parse one line (any prefix, colour, or truncation); unknown lines are ignored."""
        msg, rank, ts, ident = clean_line(line)
        if not msg:
            return
        with self._lock:
            if ident == "systemd" or "Main process exited" in msg:
                m = _SYSTEMD_EXIT.search(msg)
                if m:
                    status = int(m.group("status"))
                    self._exit_status = 128 + status if m.group("code") in ("killed", "dumped") else status
                return
            self._marks.prefixed = bool(rank or ts or ident)
            if self._parse(msg, rank, ts):
                self._sglang_lines += 1
                self._last_sglang_line = msg

    @property
    def last_line(self) -> str | None:
        """The last SGLang line seen (prefixes and colour stripped), e.g. ``Load weight end. ...``;
        what a progress line shows while a server starts."""
        return self._last_sglang_line

    @property
    def phase(self) -> str:
        """The startup phase reached: ``init``, ``weights``, ``after_weights``, ``kv_pool``,
        ``after_pool``, ``capture``, ``after_capture``, ``host_pool``, ``serving``."""
        return self._phase

    def timeout_failure(self, timeout_s: float) -> Failure:
        """A ``startup_timeout`` failure for a start that produced no ready line in ``timeout_s``,
        with the phase it hung in and the last SGLang line as evidence (a launcher's wait ran out)."""
        return Failure(
            failure_class=FailureClass.STARTUP_TIMEOUT,
            evidence=f"no ready line after {timeout_s:.0f} s (phase {self._phase}); {self._last_line_evidence()}",
        )

    def feed_many(self, lines: Iterable[str]) -> None:
        """Feed every line of an iterable (a file, a list, a pipe)."""
        for line in lines:
            self.feed(line)

    def report(self, *, exit_status: int | None = None) -> LogReport:
        """Freeze what was seen so far.

        Args:
            exit_status: The process exit status if known; with no failure line, a non-zero
                status still yields a failure (see :func:`classify`).

        Returns:
            The :class:`LogReport`.
        """
        with self._lock:
            return self._report(exit_status)

    def _report(self, exit_status: int | None) -> LogReport:
        status = exit_status if exit_status is not None else self._exit_status
        failure = self.failure
        if failure is not None and status is not None and failure.exit_status is None:
            failure = failure.model_copy(update={"exit_status": status})
        if failure is None and status not in (None, 0):
            failure = self._failure_from_exit(status)
        failure, oom = self._joined_allocator_oom(failure)
        if failure is not None and failure.phase == UNKNOWN:  # the traceback's frames follow the line that raised it
            failure = failure.model_copy(update={"phase": self._failure_phase()})
        ranks = {key: self._freeze_rank(key, d) for key, d in self._ranks.items()}
        warnings = list(self._warnings)
        if ranks and not self._scheduler and self._sglang_lines:
            missing = {"weights": "the weight-end, KV, pool, graph and scheduler lines", "after_weights": "the KV, pool, graph and scheduler lines",
                       "kv_pool": "the 'Memory pool end', graph and scheduler lines", "after_pool": "the graph and scheduler lines",
                       "capture": "the rest of graph capture and the scheduler line", "after_capture": "the scheduler line"}.get(self._phase)
            warnings.append("no scheduler line (max_total_num_tokens=...): the start did not finish or the log is partial"
                            + (f"; it ends in phase {self._phase}, so {missing} are missing (not guessed)" if missing and failure is None else ""))
        if self.ready is False and self._scheduler and failure is None:
            warnings.append("no ready line: the log ends before 'The server is fired up and ready to roll!'")
        summary = dict(self._summary)
        usage = summary.get("max_token_usage")
        if usage is not None and usage >= 0.9:
            warnings.append(
                f"KV pool nearly full: token usage reached {usage:.2f}; expect retractions and slow decode "
                "(who held the pool decides the lever: a handful of long requests, cap their length; many, admit fewer; "
                "in between, more KV)"
            )
        return LogReport(
            version_format=self._version,
            ranks=ranks,
            scheduler=_scheduler_info(self._scheduler, ranks, self._server_args) if self._scheduler else None,
            host_pool_gb=self._fields.get("host_pool_gb"),
            host_pool_tokens=self._fields.get("host_pool_tokens"),
            host_pool_ranks=list(self._fields.get("host_pool_ranks", [])),
            ready=self.ready,
            retractions=list(self._retractions),
            batches=self._batch_lines(),
            batch_summary=BatchSummary(**summary),
            failure=failure,
            failure_site=self._failure_site if self.failure is not None else None,
            warnings=warnings,
            kv_cache_dtype=self._fields.get("kv_cache_dtype"),
            max_total_tokens_requested=self._fields.get("mtt_requested"),
            max_total_tokens_profiled=self._fields.get("mtt_profiled"),
            max_running_requests_reset_for_speculative=bool(self._fields.get("mrr_spec")),
            max_running_requests_requested=self._fields.get("mrr_requested"),
            max_running_requests_reduced_to=self._fields.get("mrr_reduced"),
            input_rejections=list(self._rejections),
            oom=oom,
            req_slots_available=self._fields.get("req_slots_available"),
            req_slots_requested=self._fields.get("req_slots_requested"),
            server_args=dict(self._server_args),
            exit_status=status,
            sglang_lines=self._sglang_lines,
            soft_failure=self._soft,
            kv_shortfall=KVShortfall(**self._shortfall) if self._shortfall else None,
            logged=self._logged_with_batches(),
            capture_progress_avail_gib=self._progress_avail,
            weights_committed_after_capture=self._committed,
            last_phase=self._phase,
            allocator_retry=AllocatorRetry(**{k: v for k, v in self._fields["allocator_retry"].items() if k not in ("line", "rank")})
            if self._fields.get("allocator_retry") else None,
            transformers_fallback=self._fields.get("transformers_fallback"),
        )

    def _logged_with_batches(self) -> dict[str, list[LoggedLine]]:
        out = {k: list(v) for k, v in self._logged.items()}
        for (rank, kind), msg in self._last_batch.items():
            out.setdefault(rank, []).append(
                LoggedLine.model_validate({"line": f"last_{kind}_batch", "values": _numbers(msg), "text": msg[:300]})
            )
        return out

    # -- parsing --------------------------------------------------------------------------------

    def _rank(self, rank: str | None) -> dict[str, Any]:
        key = rank or ""
        if key not in self._ranks:
            self._ranks[key] = {"rank": rank, "draft": None}
        return self._ranks[key]

    def _target_or_draft(self, rank: str | None, field: str) -> dict[str, Any]:
        """The target's dict, or the draft's once the target already has ``field``: with
        speculative decoding the draft ModelRunner prints a second set of lines (§4.1)."""
        d = self._rank(rank)
        if d.get(field) is None:
            return d
        if d["draft"] is None:
            d["draft"] = {"rank": rank, "draft": None}
        return d["draft"]

    def _new_start(self, rank: str | None) -> bool:
        """Start over when a line opens a new server start in the same log (a journal over several
        starts); the report covers the last start. ``rank="*"``: a ``server_args`` echo, printed
        once per launch, after any rank loaded weights. Otherwise a distributed-init line of a rank
        that loaded weights: a new start once the previous one finished (scheduler line, ready
        line, failure) or already had a draft; else it is the draft ModelRunner's own init
        (speculative decoding, §4.1), and nothing is reset.

        Returns:
            True when the state was reset.
        """
        if rank == "*":
            restart = any(d.get("weight_gib") is not None or d.get("kv_tokens") is not None for d in self._ranks.values())
        else:
            d = self._ranks.get(rank or "")
            if d is None or d.get("weight_gib") is None:
                return False
            draft = d.get("draft") or {}
            restart = bool(self._scheduler or self.ready or self.failure is not None or draft.get("weight_gib") is not None)
        if not restart:
            return False
        warnings = [*self._warnings, "the log holds more than one server start; the report covers the last one"]
        self._reset()
        self._warnings = list(dict.fromkeys(warnings))
        return True

    def _parse(self, msg: str, rank: str | None, ts: str | None) -> bool:
        """One cleaned line: traceback bookkeeping, the version markers, the failure table, then the
        one line format of :data:`LINE_FORMATS` it is (see :func:`match_format`) and its handler.

        Returns:
            Whether the line is SGLang output (a recognised format or failure evidence).
        """
        if msg.startswith('File "') and (m := _P["frame"].match(msg)):  # a traceback frame
            self._frames.append((m.group("file"), m.group("func")))
            return False
        if "Traceback (most recent call last)" in msg:
            self._frames.clear()
        if _STARTUP_WORDS.search(msg):
            for version, pat in _VERSION_MARKERS:
                if pat.search(msg) and (self._version is None or _vkey(version) > _vkey(self._version)):
                    self._version = version
        hit = match_format(msg)
        known = False
        if hit is None or hit[0].evidence:
            known = self._parse_failure(msg, rank)
        if hit is None:
            return known
        fmt, m = hit
        counted = fmt.handler(self, m, msg, rank, ts)
        return counted is not False or known

    # -- one handler per line format (LINE_FORMATS): each fills typed facts from its match -------

    def _on_batch(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        kind = m.group("kind").lower()
        self._batch(kind, m.group("body"), rank, ts)
        self._last_batch[(rank or "", kind)] = m.group("body")

    def _on_server_args(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._new_start("*")
        self._marks.launch_seen = True
        if m.group("dict") is not None:  # 0.5.23: server_args={...} from resolved_dict()
            pairs = re.findall(r"['\"](\w+)['\"]:\s*('[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{[^}]*\}|[^,{}]+)", m.group("dict"))
        else:
            pairs = re.findall(r"(\w+)=('[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{[^}]*\}|[^,()]+)", m.group("obj"))
        for k, v in pairs:
            self._server_args.setdefault(k, v.strip().strip("'\""))

    def _on_dist_begin(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        """Nothing to read; a startup line all the same."""
        self._marks.launch_seen = True

    def _on_parallel_end(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._marks.launch_seen = True
        self._log(rank, "init_parallel_end", msg)  # 0.5.23: the baseline line follows

    def _on_dist_end(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._new_start(rank)
        self._marks.launch_seen = True
        d = self._target_or_draft(rank, "baseline_gib")
        d["baseline_gib"] = float(m.groups()[-1])
        self._log(rank, "distributed_init", msg, self._role(rank, d))

    def _on_load_begin(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._phase = "weights"
        d = self._target_or_draft(rank, "load_begin_avail_gib")
        d["load_begin_avail_gib"] = float(m.group(1))
        self._log(rank, "load_weight_begin", msg, self._role(rank, d))

    def _on_load_end_committed(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._phase = "after_weights" if self._phase in ("init", "weights") else self._phase
        self._committed = True
        self._log(rank, "load_weight_end_committed", msg)

    def _on_load_end(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._phase = "after_weights"
        d = self._target_or_draft(rank, "weight_end_avail_gib")
        self._log(rank, "load_weight_end", msg, self._role(rank, d))
        body = m.group("body")
        d["weight_end_avail_gib"] = float(m.group(2))
        d["weight_gib"] = _float(m.group(3))
        if t := re.search(r"type=([\w.]+)", body):
            d["model_class"] = t.group(1)
        if t := re.search(r"dtype=([\w.]+)", body):
            d["weight_dtype"] = t.group(1)
        elif t := re.search(r"quant=([\w.\-]+)", body):
            d["weight_dtype"] = t.group(1)

    def _on_kv_dtype(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._fields["kv_cache_dtype"] = m.group(1)
        self._log(rank, "kv_cache_dtype", msg)

    def _on_post_capture_kv(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        d = self._rank(rank)  # 0.5.23, SGLANG_ENABLE_POST_CAPTURE_KV_SIZING (§1.7)
        d.update(kv_tokens=int(m.group("tokens")), kv_size_gib=float(m.group(3)), k_size_gib=None, v_size_gib=None)
        if m.group("dtype"):
            d["kv_dtype"] = m.group("dtype")
        self._log(rank, "post_capture_kv_sizing", msg)

    def _on_mamba(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._rank(rank)["mamba_cache_gib"] = round(sum(float(x) for x in m.groups()), 4)  # carved out first (§1.2)
        self._log(rank, "mamba_cache_allocated", msg)

    def _on_swa_pool(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._log(rank, "swa_kv_pool", msg)
        self._swa_pool(rank, float(m.group(1)), int(m.group(2)), int(m.group(3)))

    def _on_kv_alloc(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._phase = "kv_pool"
        d = self._target_or_draft(rank, "kv_tokens")
        self._log(rank, "kv_cache_allocated", msg, self._role(rank, d))
        d["kv_tokens"] = int(m.group("per_rank") or m.group("tokens"))  # one rank's pool (sglang#32730 form)
        d["k_size_gib"] = _float(m.group("k"))
        d["v_size_gib"] = _float(m.group("v"))
        d["kv_size_gib"] = _float(m.group("kv"))
        if m.group("dtype"):
            d["kv_dtype"] = m.group("dtype")

    def _on_pool_end(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._phase = "after_pool"
        d = self._target_or_draft(rank, "memory_pool_end_avail_gib")
        d["memory_pool_end_avail_gib"] = float(m.group(1))
        self._log(rank, "memory_pool_end", msg, self._role(rank, d))

    def _on_cap_progress(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._phase = "capture"  # tqdm progress of graph capture (rank 0's stderr)
        self._progress_avail = float(m.group("avail"))
        self._log(rank, "capture_progress", m.group(0))

    def _on_cap_bs_list(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        sizes = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]  # 0.5.5, rank 0
        if sizes:
            self._rank(rank)["graph_bs"] = sizes
        self._log(rank, "capture_bs_list", msg)

    def _on_cap_end(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._log(rank, "capture_end", msg.split("max_total_num_tokens=")[0])
        self._capture(rank, m.group("name"), m.group("body"), end=True)
        self._phase = "after_capture"
        if sched := _P["scheduler"].search(msg):  # some logs glue the scheduler line on (case-21)
            self._scheduler_line(int(sched.group("tokens")), sched.group("rest"))
            self._log(rank, "scheduler", sched.group(0))

    def _on_cap_begin(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._phase = "capture"
        self._log(rank, "capture_begin", msg)
        self._capture(rank, m.group("name"), m.group("body"), end=False)

    def _on_scheduler(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._scheduler_line(int(m.group("tokens")), m.group("rest"))
        self._log(rank, "scheduler", msg)

    def _on_host_pool_old(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._log(rank, "host_pool", msg)
        self._phase = "host_pool"
        self._fields.setdefault("host_pool_gb", float(m.group(1)))
        self._host_rank(rank)

    def _on_host_pool_new(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._log(rank, "host_pool", msg)
        self._phase = "host_pool"
        self._fields.setdefault("host_pool_tokens", int(m.group(1)))
        self._fields.setdefault("host_pool_gb", float(m.group(2)))
        self._host_rank(rank)

    def _on_ready(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self.ready = True
        self._serving = True
        self._phase = "serving"

    def _on_retract(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._serving = True
        self._log(rank, "retraction", msg)
        if self._soft is None:
            self._soft = Failure(failure_class=FailureClass.RETRACTION_STORM, evidence=msg[:500], rank=rank, phase="serving")
        before = self._batch_values(self._last_batch.get((rank or "", "decode"), ""))
        self._retractions.append(Retraction(
            retracted_reqs=int(m.group(1)), new_tokens_gained=_int(m.group(2)),
            new_token_ratio_before=_float(m.group(3)), new_token_ratio_after=_float(m.group(4)),
            timestamp=ts, rank=rank, running_req_before=before.get("running_req"),
            num_token_before=before.get("num_token"), token_usage_before=before.get("token_usage", before.get("full_token_usage")),
        ))

    def _on_mtt_larger(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._log(rank, "max_total_tokens_larger_than_profiled", msg)
        self._fields["mtt_requested"] = int(m.group(1))
        self._fields["mtt_profiled"] = int(m.group(2))

    def _on_mrr_spec(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._log(rank, "max_running_requests_reset_for_speculative", msg)
        self._fields["mrr_spec"] = int(m.group(1))

    def _on_mrr_reduced(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._log(rank, "max_running_requests_reduced", msg)
        self._fields["mrr_requested"] = int(m.group(1))
        self._fields["mrr_reduced"] = int(m.group(2))

    def _on_input_too_long(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        limit: Literal["max_req_input_len", "context_length"] = "max_req_input_len" if m.re is _P["input_long"] else "context_length"
        rej = InputRejection(input_tokens=int(m.group(1)), max_allowed_tokens=int(m.group(2)), limit=limit, rank=rank)
        self._log(rank, "input_too_long", msg)
        if rej not in self._rejections:
            self._rejections.append(rej)
        self._serving = True

    def _on_alloc_continuation(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> bool:
        """The continuation lines of the KV allocator's message (``Try to allocate N tokens.``,
        ``Available tokens: X (available_size=A + evictable_size=E)``, the older ``Avaliable
        tokens: X`` / ``...available_size()=A`` / ``...evictable_size()=E``); SGLang's only after
        its first line (:attr:`_shortfall` open)."""
        sf = self._shortfall
        if sf is None:
            return False
        if m.re is _P["alloc_try"]:
            sf.setdefault("requested_tokens", int(m.group(1)))
        elif m.re is _P["alloc_avail"]:
            sf.setdefault("available_tokens", int(m.group(1)))
            if m.group(2) is not None:
                sf.setdefault("available_size", int(m.group(2)))
                sf.setdefault("evictable_size", int(m.group(3)))
        elif m.re is _P["alloc_avail_old"]:
            sf.setdefault("available_size", int(m.group(1)))
        else:
            sf.setdefault("evictable_size", int(m.group(1)))
        self._log(rank, "kv_allocator", msg)
        return True

    def _on_http_request(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> bool:
        self._serving = True  # an HTTP request or a benchmark client: the server was serving
        return False

    def _on_worker_exception(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        """0.4.x ``TpModelWorkerClient hit an exception: {traceback}`` (``forward_thread_func``): the
        overlap scheduler's worker thread, which only runs batches (warm-up included), raised. A
        crash unless more specific evidence follows; a CUDA OOM under it is a runtime OOM (§4.4)."""
        self._serving = True
        self._raise(20, FailureClass.CRASH, msg, rank)

    def _on_alloc_retry(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._allocator_retry(m, rank, msg)

    def _on_transformers_fallback(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._fields["transformers_fallback"] = msg[:300]

    def _on_command(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        self._marks.launch_seen = True
        self._command_flags(msg)

    def _on_capture_failed(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> None:
        """``Capture cuda graph failed: {e}``: SGLang wraps every capture exception in this line with
        memory advice (:mod:`tuner.sglang.wrapped`), so ``e`` decides: memory → ``cuda_graph_oom``;
        a readable other text → the failure table's row for it (no kernel image, NCCL, ...) or a
        ``crash``; no readable ``e`` → a ``crash`` whose cause is unknown, taken over by an OOM line
        that follows (torch's own message on the next line)."""
        cause = capture_cause(msg)
        if cause == "memory":
            self._oom_numbers(msg)
            self._log(rank, "oom", msg)
            self._raise(90, FailureClass.CUDA_GRAPH_OOM, msg, rank)
        elif cause == "other" and not self._parse_failure(m.group("cause"), rank):
            self._log(rank, "fatal", msg)
            self._raise(88, FailureClass.CRASH, msg, rank)
        elif cause == "unknown":
            self._marks.capture_cause_pending = True  # the wrapped text may follow on the next line
            self._raise(65, FailureClass.CRASH, msg, rank)

    def _on_flag_line(self, m: re.Match[str], msg: str, rank: str | None, ts: str | None) -> bool:
        self._command_flags(msg)  # a continuation line of a multi-line launch command
        return False

    def _swa_pool(self, rank: str | None, total_gib: float, swa_tokens: int, full_tokens: int) -> None:
        """``SWAKVPool mem usage: X GB, swa size: A, full size: B``: ``SWAKVPool.__init__`` builds its
        sliding-window pool, then its full-attention pool (each prints its own ``KV Cache is
        allocated`` line), then this total of both. A second KV line on the rank before it is that
        full-attention part, not a draft model's pool (a draft's lines start with its own weights,
        §4.1): it is folded back, and ``X`` is the rank's whole KV pool (the parts are not added again)."""
        d = self._rank(rank)
        draft = d.get("draft")
        if draft is not None and draft.get("weight_gib") is None and draft.get("load_begin_avail_gib") is None and draft.get("kv_tokens") is not None:
            d["draft"] = None
        d.update(swa_pool_gib=total_gib, swa_tokens=swa_tokens)
        if d.get("kv_tokens") is None:
            d["kv_tokens"] = full_tokens
        lines = self._logged.get(rank or "", [])
        parts = [i for i, e in enumerate(lines) if e.line == "kv_cache_allocated"][-2:]
        if len(parts) == 2:  # one part only (a cut excerpt): which one it is is not known
            for i, role in zip(parts, ("swa", "full"), strict=True):
                lines[i] = lines[i].model_copy(update={"role": role})

    def _role(self, rank: str | None, d: dict[str, Any]) -> str | None:
        """``draft`` when ``d`` is the draft's dict of ``rank``, ``target`` when a draft exists, else None."""
        top = self._ranks.get(rank or "")
        if top is None or top.get("draft") is None:
            return None
        return "target" if d is top else "draft"

    def _allocator_retry(self, m: re.Match[str], rank: str | None, msg: str) -> None:
        """``CUDACachingAllocator.cpp: memory allocation failed with OOM on device D while trying to
        allocate N bytes (free: F, total: T)``: torch's allocator missed, freed its cached blocks and
        retried (a warning; a hard failure raises ``CUDA out of memory``). Not the KV allocator."""
        prev = self._fields.get("allocator_retry") or {"count": 0}
        self._fields["allocator_retry"] = {
            "count": prev["count"] + 1, "device": int(m.group(1)), "tried_bytes": int(m.group(2)),
            "free_bytes": _int(m.group(3)), "total_bytes": _int(m.group(4)), "line": msg, "rank": rank,
        }
        self._log(rank, "allocator_retry", msg)

    def _host_rank(self, rank: str | None) -> None:
        ranks = self._fields.setdefault("host_pool_ranks", [])
        if (rank or "") not in ranks:
            ranks.append(rank or "")

    def _capture(self, rank: str | None, name: str, body: str, *, end: bool) -> None:
        lname = name.lower()
        d = self._rank(rank)
        if "draft" in lname or ("target" not in lname and d.get("draft") is not None):
            if d["draft"] is None:
                d["draft"] = {"rank": rank, "draft": None}
            d = d["draft"]
        bs = re.search(r"bs=\[([\d,\s]*)\]", body)
        if bs and not ("prefill" in name.lower() or "verify" in name.lower()):
            sizes = [int(x) for x in bs.group(1).replace(" ", "").split(",") if x]
            if sizes:
                d["graph_bs"] = sizes
        avail = re.search(r"avail mem=" + _NUM + " GB", body)
        if not end:
            if avail and d.get("graph_begin_avail_gib") is None:
                d["graph_begin_avail_gib"] = float(avail.group(1))
            return
        usage = re.search(r"mem usage=" + _NUM + " GB", body)
        elapsed = re.search(r"(?:Time elapsed: |elapsed=)" + _NUM + " ?s", body)
        if usage:
            d["graph_gib"] = round((d.get("graph_gib") or 0.0) + float(usage.group(1)), 4)
            if "verify" in lname:
                d["verify_graph_gib"] = round((d.get("verify_graph_gib") or 0.0) + float(usage.group(1)), 4)
        if avail:
            d["graph_end_avail_gib"] = float(avail.group(1))
        if elapsed:
            d["graph_capture_s"] = round((d.get("graph_capture_s") or 0.0) + float(elapsed.group(1)), 4)

    def _scheduler_line(self, tokens: int, rest: str) -> None:
        info: dict[str, Any] = {"max_total_num_tokens": tokens}
        if m := _DCP_LOGICAL.match(rest):  # sglang#32730: "26462720 (3307840 per rank * dcp_size 8)"
            info.update(max_total_num_tokens=int(m.group(1)), logical_tokens=tokens, dcp_size=int(m.group(2)))
        for key in ("chunked_prefill_size", "max_prefill_tokens", "max_running_requests", "context_len"):
            if m := re.search(key + r"=(-?\d+)", rest):
                info[key] = int(m.group(1))
        if m := re.search(r"available_[gc]pu_mem=" + _NUM + " GB", rest):  # "available_cpu_mem" on CPU servers
            info["available_gpu_mem_gib"] = float(m.group(1))
        self._scheduler = info

    def _batch(self, kind: str, body: str, rank: str | None, ts: str | None) -> None:
        """One batch line: the summary from three C-level searches; the full fields are parsed
        lazily, only for the kept (last :data:`_MAX_BATCH_LINES`) lines, at :meth:`report` time."""
        self._serving = True
        self._batches.append([kind, ts, rank, body, None])
        s = self._summary
        s[f"{kind}_lines"] += 1
        m = _BATCH_RUNNING.search(body)
        running = int(m.group(1)) if m else None
        if running is not None and running > (s.get("max_running_req") or 0):
            s["max_running_req"] = running
        if m := _BATCH_USAGE.search(body):
            try:
                usage = float(m.group(1))
            except ValueError:
                usage = None  # truncated value
            if usage is not None and usage > (s.get("max_token_usage") or 0.0):
                s["max_token_usage"] = usage
        if kind == "decode" and "cuda graph: False" in body:
            s["decode_lines_without_cuda_graph"] += 1
            if running is not None:
                s["max_running_req_without_cuda_graph"] = max(s.get("max_running_req_without_cuda_graph") or 0, running)

    @staticmethod
    def _batch_values(body: str) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for part in body.split(","):
            if ":" not in part:
                continue
            key, _, raw = part.partition(":")
            key, raw = key.strip(), raw.strip().rstrip("%").strip()
            spec = _BATCH_FIELDS.get(key)
            if spec is None:
                continue
            name, typ = spec
            try:
                values[name] = raw == "True" if typ is bool else typ(raw)
            except ValueError:
                continue  # truncated value
            if raw not in ("True", "False") and typ is bool:
                values.pop(name)
        return values

    def _batch_lines(self) -> list[BatchLine]:
        out = []
        for entry in self._batches:
            if entry[4] is None:
                kind, ts, rank, body, _ = entry
                entry[4] = BatchLine(kind=kind, timestamp=ts, rank=rank, **self._batch_values(body))
            out.append(entry[4])
        return out

    def _command_flags(self, msg: str) -> None:
        tokens = msg.split()
        for i, tok in enumerate(tokens):
            if not tok.startswith("--") or len(tok) < 3:
                continue
            if "=" in tok:
                k, v = tok[2:].split("=", 1)
            elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                k, v = tok[2:], tokens[i + 1]
            else:
                k, v = tok[2:], "True"
            self._server_args.setdefault(k.replace("-", "_"), v)

    # -- failures -------------------------------------------------------------------------------

    def _parse_failure(self, msg: str, rank: str | None) -> bool:
        if not _FAILURE_WORDS.search(msg):
            return False
        for prio, cls, pat in _FAILURES:
            if not pat.search(msg):
                continue
            if prio in _GENERIC_PRIORITIES and not self._marks.prefixed and not _PROGRAM_OUTPUT.match(msg):
                return False  # a sentence that names the error ("it crashes with CUDA out of memory"), not the error
            if cls is None:
                cls = self._oom_class(msg)
            if self._oom_numbers(msg):
                self._log(rank, "oom", msg)
            elif cls is FailureClass.CRASH:
                self._log(rank, "fatal", msg)
            if cls is FailureClass.KV_PAGE_SHORTFALL and self._shortfall is None:
                kind = "prefill" if "Prefill" in msg else "decode" if "Decode" in msg else "allocator"
                self._shortfall = {"kind": kind}
            if m := _P["req_slots"].search(msg):
                self._fields["req_slots_available"] = int(m.group(1))
                self._fields["req_slots_requested"] = _int(m.group(2))
                self._log(rank, "alloc_req_slots", msg)
            self._raise(prio, cls, msg, rank)
            return True
        if m := _P["mtt_larger"].search(msg):
            if int(m.group(2)) <= 0:
                self._raise(90, FailureClass.STARTUP_KV_OOM, msg, rank)
            return False
        if self.failure is not None and self._oom_numbers(msg):
            self._log(rank, "oom", msg)
        return False

    def _raise(self, prio: int, cls: FailureClass, msg: str, rank: str | None) -> None:
        """Take ``msg`` as the failure's evidence when it is more specific (``prio``, as in
        :data:`_FAILURES`) than the evidence seen so far; a tie keeps the first."""
        if prio <= self._failure_prio:
            return
        self._failure_prio = prio
        self.failure = Failure(failure_class=cls, evidence=msg[:500], rank=rank, phase=self._failure_phase())
        site = self._oom_site()
        self._failure_site = site[1] if site else None

    def _failure_phase(self) -> str:
        """The phase a failure now is stated in: only what the log shows (:func:`~tuner.sglang.phases.failure_phase`)."""
        return failure_phase(self._phase, startup_seen=self._marks.launch_seen or self._phase != "init", serving=self._serving,
                             in_construction=any(startup_frame(file, func) for file, func in self._frames))

    def _oom_site(self) -> tuple[str, str] | None:
        """Where the current traceback was raised: ``(site, frame)`` of the innermost frame that
        names a known site (``graphs``, ``batch``, ``pool``, ``weights``, see ``_OOM_SITES``),
        e.g. ``("pool", "init_memory_pool")``, else ``None``."""
        for file, func in reversed(self._frames):
            for site, pat in _OOM_SITES:
                if pat.search(func):
                    return site, func
                if site != "batch" and pat.search(file):
                    return site, f"{func} ({file.rsplit('/', 1)[-1]})"
        return None

    def _frames_hold(self, site: str) -> bool:
        """Some frame of the current traceback names ``site`` (see ``_OOM_SITES``)."""
        pat = dict(_OOM_SITES)[site]
        return any(pat.search(func) for _file, func in self._frames)

    def _target_pool_allocated(self) -> bool:
        """Some rank's target KV pool exists: weights loaded now are a draft's, from the reserve (§1.5)."""
        return any(d.get("kv_tokens") is not None for d in self._ranks.values())

    def _oom_class(self, msg: str) -> FailureClass:
        """Class of a generic CUDA OOM by where it was raised (§4.3 startup vs §4.4 runtime).

        While serving (a ready line, batch lines, HTTP request lines, a benchmark client) it is a
        runtime OOM. Before ready, the
        traceback's innermost known frame decides, else the startup phase reached: loading the
        target's weights (or earlier) → weight-load OOM; anything allocated after the KV pool is
        sized (``init_memory_pool``'s req_to_token table and KV pool, CUDA graphs, a draft worker
        loaded after the target's pool, §1.2, §1.5, §1.6) → CUDA-graph OOM, the class of "the
        ``(1 − mem_fraction_static)`` reserve was too small"; the warm-up batch → runtime OOM. A
        log that shows neither a phase line, a known frame nor anything of serving (an excerpt
        with the error alone, e.g. a HIP OOM in an attention backend's init) gives
        ``startup_oom``: before ready, phase unknown.
        """
        site = self._oom_site()
        if "capture" in msg.lower() or "cuda_graph" in msg or self._marks.capture_cause_pending:
            return FailureClass.CUDA_GRAPH_OOM
        if self._serving:
            return FailureClass.RUNTIME_OOM
        kind = site[0] if site else None
        if kind != "graphs" and not self._frames_hold("graphs") and (self._frames_hold("batch") or self._frames_hold("forward")):
            # A scheduler frame anywhere in the stack (event_loop, run_batch, the worker thread's
            # forward): the OOM was raised running a batch, whatever kernel (attention, indexer,
            # KV-buffer write in memory_pool) is innermost.
            return FailureClass.RUNTIME_OOM
        if kind == "batch":
            return FailureClass.RUNTIME_OOM
        if kind in ("graphs", "pool"):
            return FailureClass.CUDA_GRAPH_OOM
        if kind == "weights" or self._phase in ("init", "weights"):
            if self._target_pool_allocated():
                return FailureClass.CUDA_GRAPH_OOM
            if kind == "weights" or self._ranks or self._server_args:
                return FailureClass.WEIGHT_LOAD_OOM
            return FailureClass.STARTUP_OOM
        return FailureClass.CUDA_GRAPH_OOM

    def _oom_numbers(self, msg: str) -> bool:
        """Merge the numbers of torch's OOM message into :attr:`_oom` (the message may span lines:
        ``Tried to allocate X.`` then ``GPU n has a total capacity of Y of which Z is free``).
        Returns whether the line held one of them."""
        tried = _P["oom_tried"].search(msg)
        gpu = _P["oom_gpu"].search(msg)
        free = _P["oom_free"].search(msg)
        vendor = "hip" if "HIP" in msg or "hipError" in msg else "cuda" if "CUDA" in msg or "cudaError" in msg else None
        if not (tried or gpu or free):
            if vendor and self._oom is not None and self._oom.vendor is None:
                self._oom = self._oom.model_copy(update={"vendor": vendor})
            return False
        scale = {"MiB": 1.0, "GiB": 1024.0, "KiB": 1 / 1024, "B": 1 / 2**20}
        new: dict[str, Any] = {"vendor": vendor}
        if tried:
            new["tried_to_allocate_mib"] = float(tried.group(1)) * scale[tried.group(2)]
        if free:
            new["free_mib"] = float(free.group(1)) * scale[free.group(2)]
        if gpu:
            new["gpu_index"], new["total_capacity_gib"] = int(gpu.group(1)), float(gpu.group(2))
        old = self._oom.model_dump() if self._oom else {}
        merged = {**old, **{k: v for k, v in new.items() if old.get(k) is None}}
        self._oom = OOMDetail(**merged)
        return True

    def _joined_allocator_oom(self, failure: Failure | None) -> tuple[Failure | None, OOMDetail | None]:
        """A generic exception (``Scheduler hit an exception``, an exit) after torch's allocator warning
        ``CUDACachingAllocator.cpp: memory allocation failed with OOM on device D while trying to
        allocate N bytes (free: F, total: T)`` with no more specific evidence between them is that
        allocation failing: an OOM, classed like torch's own OOM line (by the traceback's frames and
        the phase, :meth:`_oom_class`) with the allocator's numbers (case-39: the draft pool in
        ``Scheduler.__init__ → init_model_worker``). The allocator line is the evidence.

        Returns:
            ``(failure, oom)``: the failure (joined or as it was) and the OOM numbers to report."""
        retry = self._fields.get("allocator_retry")
        if failure is None or retry is None or failure.failure_class is not FailureClass.CRASH or self._failure_prio > 20:
            return failure, self._oom
        oom = self._oom
        if oom is None or oom.tried_to_allocate_mib is None:
            mib = float(2**20)
            oom = OOMDetail(vendor="cuda", tried_to_allocate_mib=retry["tried_bytes"] / mib,
                            free_mib=retry["free_bytes"] / mib if retry["free_bytes"] is not None else None,
                            total_capacity_gib=retry["total_bytes"] / mib / 1024 if retry["total_bytes"] is not None else None,
                            gpu_index=retry["device"])
        joined = failure.model_copy(update={"failure_class": self._oom_class(retry["line"]), "evidence": retry["line"][:500], "rank": retry["rank"]})
        return joined, oom

    def _failure_from_exit(self, status: int) -> Failure:
        last = self._last_sglang_line or "no SGLang line before the exit"
        if status == 2 and not self._ranks:
            return Failure(failure_class=FailureClass.INVALID_ARGUMENTS, evidence="exited with status 2 (argparse) before any startup line", exit_status=status)
        if not self.ready and self._phase == "host_pool":
            return Failure(
                failure_class=FailureClass.HOST_MEMORY,
                evidence=f"exited with status {status} right after allocating the hierarchical-cache host pool: {last}",
                exit_status=status,
            )
        phase = self._failure_phase()
        where = "while serving" if phase == SERVING else f"during startup (phase {phase})"
        return Failure(failure_class=FailureClass.CRASH, evidence=f"exited with status {status} {where}; {self._last_line_evidence()}", exit_status=status)

    def _last_line_evidence(self) -> str:
        """``last SGLang line: …``, or what it means that there is none (evidence never says None)."""
        if self._last_sglang_line:
            return f"last SGLang line: {self._last_sglang_line}"
        return "no SGLang line reached the tuner"

    def _freeze_rank(self, key: str, d: dict[str, Any]) -> RankMemory:
        draft = d.get("draft")
        fields = {k: v for k, v in d.items() if k != "draft"}
        return RankMemory(**fields, draft=self._freeze_rank(key, draft) if draft else None)


# ---------------------------------------------------------------------------------------------
# The line formats: one row per format, each with its handler
# ---------------------------------------------------------------------------------------------


class LineFormat(NamedTuple):
    """One format of SGLang's output: a row of :data:`LINE_FORMATS`.

    Attributes:
        id: The format's name; SGLang's own formats use the ``id`` of ``tuner/data/log-formats.json``
            (read from SGLang's source per version, §4), others name their source in ``source``.
        anchor: A literal every line of the format contains (the cheap gate before ``pattern``).
        pattern: What the line must match; its groups are what the handler reads.
        handler: ``LogWatcher`` method that fills typed facts from the match; it returns ``False``
            when the line is not to be counted as SGLang output (a traceback helper, a client line).
        source: Where the format comes from: ``§`` of the reference, or the non-SGLang program.
        evidence: Whether the line may also be failure evidence (the failure table is read too).
    """

    id: str
    anchor: str
    pattern: re.Pattern[str]
    handler: Callable[[LogWatcher, re.Match[str], str, str | None, str | None], bool | None]
    source: str
    evidence: bool = True


W = LogWatcher
LINE_FORMATS: tuple[LineFormat, ...] = (
    LineFormat("prefill_batch", "Prefill batch", _P["batch"], W._on_batch, "§4.5 log_prefill_stats", evidence=False),
    LineFormat("decode_batch", "Decode batch", _P["batch"], W._on_batch, "§4.5 log_decode_stats", evidence=False),
    LineFormat("server_args", "server_args=", _P["server_args"], W._on_server_args, "§2 server_args echo", evidence=False),
    LineFormat("dist_begin", "Init torch distributed begin.", _P["dist_begin"], W._on_dist_begin, "§4.2 item 1"),
    LineFormat("parallel_end", "Init parallel ends.", _P["parallel_end"], W._on_parallel_end, "§4.2 item 1 (0.5.23)"),
    LineFormat("dist_end", "Init torch distributed ends.", _P["dist_end"], W._on_dist_end, "§4.2 item 1"),
    LineFormat("baseline", "Memory baseline taken.", _P["baseline"], W._on_dist_end, "§4.2 item 1 (0.5.23)"),
    LineFormat("load_begin", "Load weight begin.", _P["load_begin"], W._on_load_begin, "§4.2 item 2"),
    LineFormat("load_end_committed", "Load weight end. Committed", _P["load_end_committed"], W._on_load_end_committed, "§4.2 item 3 (0.5.23 overlap)"),
    LineFormat("load_end", "Load weight end.", _P["load_end"], W._on_load_end, "§4.2 item 3"),
    LineFormat("kv_dtype", "Using KV cache dtype: ", _P["kv_dtype"], W._on_kv_dtype, "§4.2 item 4"),
    LineFormat("post_capture_kv", "Post-capture KV sizing", _P["post_capture"], W._on_post_capture_kv, "§1.7 (0.5.23)"),
    LineFormat("mamba", "Mamba Cache is allocated.", _P["mamba"], W._on_mamba, "§4.2 item 5 (hybrid Mamba)"),
    LineFormat("swa_pool", "SWAKVPool mem usage: ", _P["swa_pool"], W._on_swa_pool, "§4.2 item 5 (hybrid SWA)"),
    LineFormat("kv_alloc", "KV Cache ", _P["kv_alloc"], W._on_kv_alloc, "§4.2 item 5"),
    LineFormat("pool_end", "Memory pool end.", _P["pool_end"], W._on_pool_end, "§4.2 item 6"),
    LineFormat("cap_progress", "Capturing ", _P["cap_progress"], W._on_cap_progress, "§4.2 item 7 (tqdm)"),
    LineFormat("cap_bs_list", "Capture cuda graph bs [", _P["cap_bs_list"], W._on_cap_bs_list, "§4.2 item 7 (0.5.5)"),
    LineFormat("cap_end", "Capture ", _P["cap_end"], W._on_cap_end, "§4.2 item 7"),
    LineFormat("cap_begin", "Capture ", _P["cap_begin"], W._on_cap_begin, "§4.2 item 7"),
    LineFormat("scheduler", "max_total_num_tokens=", _P["scheduler"], W._on_scheduler, "§4.2 item 8"),
    LineFormat("host_pool_old", "host memory for hierarchical KV cache", _P["host_pool_old"], W._on_host_pool_old, "§4.2 item 9"),
    LineFormat("host_pool_new", "hierarchical KV host pool: ", _P["host_pool_new"], W._on_host_pool_new, "§4.2 item 9 (0.5.23)"),
    LineFormat("ready", "ready to roll", _P["ready"], W._on_ready, "§4.2 item 10"),
    LineFormat("retract", "#retracted_reqs: ", _P["retract"], W._on_retract, "§4.4 retraction"),
    LineFormat("mtt_larger", "is larger than the profiled value", _P["mtt_larger"], W._on_mtt_larger, "§1.4"),
    LineFormat("mrr_spec", "Max running requests is reset to", _P["mrr_spec"], W._on_mrr_spec, "§1.5"),
    LineFormat("mrr_reduced", "max_running_requests was reduced", _P["mrr_reduced"], W._on_mrr_reduced, "§2.3 (0.5.16+)"),
    LineFormat("input_long", "exceeds the maximum allowed length", _P["input_long"], W._on_input_too_long, "§4.4 too-long input"),
    LineFormat("input_ctx", "is longer than the model's context length", _P["input_ctx"], W._on_input_too_long, "§4.4 too-long input"),
    LineFormat("alloc_try", "Try to allocate ", _P["alloc_try"], W._on_alloc_continuation, "§4.4 allocation failure"),
    LineFormat("alloc_avail", "Available ", _P["alloc_avail"], W._on_alloc_continuation, "§4.4 allocation failure"),
    LineFormat("alloc_avail_typo", "Avaliable ", _P["alloc_avail"], W._on_alloc_continuation, "§4.4 allocation failure (0.4.x spelling)"),
    LineFormat("alloc_avail_old", "available_size()=", _P["alloc_avail_old"], W._on_alloc_continuation, "§4.4 allocation failure (0.4.x)"),
    LineFormat("alloc_evict_old", "evictable_size()=", _P["alloc_evict_old"], W._on_alloc_continuation, "§4.4 allocation failure (0.4.x)"),
    LineFormat("http_request", " HTTP/1.", _P["serving"], W._on_http_request, "uvicorn access log (serving)"),
    LineFormat("bench_client", "bench_serving", _P["serving"], W._on_http_request, "§6 sglang.bench_serving (serving)"),
    LineFormat("worker_exception_04", "TpModelWorkerClient hit an exception", re.compile(r"TpModelWorkerClient hit an exception"), W._on_worker_exception,
               "0.4.x managers/tp_worker_overlap_thread.py forward_thread_func", evidence=False),
    LineFormat("capture_failed", "Capture cuda graph failed", CAPTURE_FAILED, W._on_capture_failed,
               "0.5.5.post3 model_executor/cuda_graph_runner.py:396 (wraps any capture exception)", evidence=False),
    LineFormat("alloc_retry", "memory allocation failed with OOM on device", _P["alloc_retry"], W._on_alloc_retry,
               "torch CUDACachingAllocator.cpp warning (flush and retry)"),
    LineFormat("transformers_fallback", "Transformers implementation", _P["transformers_fallback"], W._on_transformers_fallback,
               "model_loader: no native class, falling back to Transformers"),
    LineFormat("command", "sglang.launch_server", _P["command"], W._on_command, "§3 launch command"),
    LineFormat("command_serve", "sglang serve", _P["command"], W._on_command, "§3 launch command (sglang serve)"),
    LineFormat("flag_line", "--", _P["flag_line"], W._on_flag_line, "§3 launch command, one flag per line"),
)
"""Every line format the parser reads. A line is matched against the rows whose anchor it contains
(one scan for all anchors), never in table order; see :func:`match_format` for the rule that decides
a line two rows match. Adding a wording is one row here and one ``_on_*`` handler."""

_ROWS_BY_ANCHOR: dict[str, tuple[LineFormat, ...]] = {
    a: tuple(f for f in LINE_FORMATS if f.anchor == a) for a in dict.fromkeys(f.anchor for f in LINE_FORMATS)
}
_ANCHORS = re.compile("|".join(re.escape(a) for a in sorted(_ROWS_BY_ANCHOR, key=len, reverse=True)))
"""All anchors in one alternation, longest first (so an anchor that contains another is found)."""


_WITH_CONTAINED: dict[str, tuple[str, ...]] = {a: (a, *(b for b in _ROWS_BY_ANCHOR if b != a and b in a)) for a in _ROWS_BY_ANCHOR}
"""Each anchor with the anchors inside it (``Capture cuda graph bs [`` holds ``Capture ``)."""


def _anchors_in(msg: str) -> list[str]:
    """Every anchor the line contains, including anchors inside a longer one found at the same place."""
    found: list[str] = []
    for m in _ANCHORS.finditer(msg):
        found += _WITH_CONTAINED[m.group(0)]
    return found


def match_format(msg: str) -> tuple[LineFormat, re.Match[str]] | None:
    """The one line format a cleaned line is, with its match.

    Rule: of the rows whose anchor the line contains and whose pattern matches, the one whose match
    covers the most characters of the line wins (the most specific reading: a capture end line
    with a scheduler line glued on is a capture end line, whose handler reads the glued part). Two
    rows covering equally much would be ambiguous; ``tests/sglang/test_formats.py`` checks that no
    golden line of any version (``tests/fixtures/sglang-formats``) and no line of a handed case
    has such a tie, so the table's order never decides.

    Args:
        msg: The line, prefixes stripped (:func:`clean_line`).

    Returns:
        ``(row, match)``, or ``None`` when no row matches.
    """
    head = _ANCHORS.match(msg)
    if head is not None:  # a row that covers the whole line wins at once: nothing can cover more
        for anchor in _WITH_CONTAINED[head.group(0)]:
            for row in _ROWS_BY_ANCHOR[anchor]:
                m = row.pattern.match(msg)
                if m is not None and m.end() == len(msg):
                    return row, m
    best: tuple[LineFormat, re.Match[str]] | None = None
    for anchor in _anchors_in(msg):
        for row in _ROWS_BY_ANCHOR[anchor]:
            m = row.pattern.search(msg)
            if m is not None and (best is None or m.end() - m.start() > best[1].end() - best[1].start()):
                best = (row, m)
    return best


def matching_formats(msg: str) -> list[tuple[LineFormat, re.Match[str]]]:
    """Every row that matches a cleaned line (for the ambiguity check), widest match first."""
    hits = [(row, m) for anchor in dict.fromkeys(_anchors_in(msg)) for row in _ROWS_BY_ANCHOR[anchor] if (m := row.pattern.search(msg))]
    return sorted(hits, key=lambda h: h[1].start() - h[1].end())


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def parse_log(lines: Iterable[str], *, exit_status: int | None = None) -> LogReport:
    """Parse SGLang output (any §4 format, any prefixes) into a :class:`LogReport`.

    Args:
        lines: Lines of a file, a ``journalctl`` stream or a pipe; newlines optional. A single
            string is split into lines.
        exit_status: The process exit status, if known.

    Returns:
        The report; never raises on odd input (unknown lines are ignored).
    """
    if isinstance(lines, str):
        lines = lines.splitlines()
    watcher = LogWatcher()
    watcher.feed_many(lines)
    return watcher.report(exit_status=exit_status)


def read_log(path: Path | str, *, exit_status: int | None = None) -> LogReport:
    """Read and parse an SGLang log file.

    Args:
        path: The log file (plain text, or gzip-compressed as logrotate leaves it; a journald
            export with ``-o short`` or ``short-iso``).
        exit_status: The process exit status, if known.

    Returns:
        The :class:`LogReport`.

    Raises:
        LogError: The file is missing, empty, binary, or holds no SGLang line.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise LogError(f"cannot read log file {path}: {err.strerror}", hint="pass an existing SGLang log file with --log") from err
    if data[:2] == b"\x1f\x8b":  # a rotated, gzip-compressed log
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:
            raise LogError(f"log {path} is a damaged gzip file", hint="pass the uncompressed log or a complete .gz") from err
    return parse_log_bytes(data, source=str(path), exit_status=exit_status)


def parse_log_bytes(data: bytes, *, source: str, exit_status: int | None = None) -> LogReport:
    """Parse raw bytes of SGLang output, rejecting empty, binary and foreign input.

    Args:
        data: The bytes (UTF-8; invalid sequences are replaced).
        source: What the bytes came from (a path, ``journalctl -u NAME``), for messages.
        exit_status: The process exit status, if known.

    Returns:
        The :class:`LogReport`.

    Raises:
        LogError: Empty, binary, or no SGLang line.
    """
    if not data.strip():
        raise LogError(f"log {source} is empty", hint="pass the SGLang server's output (journalctl -u UNIT, or the file it logs to)")
    head = data[:65536]
    if b"\x00" in head or sum(b < 9 or 13 < b < 32 for b in head) > len(head) // 100:
        raise LogError(f"log {source} is binary, not text", hint="pass the SGLang server's text output, not a binary file")
    report = parse_log(data.decode("utf-8", errors="replace").splitlines(), exit_status=exit_status)
    if report.sglang_lines == 0 and not report.server_args:
        raise LogError(
            f"log {source} holds no SGLang line (no memory, scheduler, batch or failure line)",
            hint="pass the output of `python -m sglang.launch_server` (e.g. journalctl -u UNIT)",
        )
    return report


def classify(lines: Iterable[str], *, exit_status: int | None = None) -> Failure | None:
    """Classify why an SGLang start or run failed, with the evidence line (§4.3, §4.4, §1.1).

    The most specific evidence wins: ``Not enough memory`` / ``Capture cuda graph failed`` /
    ``Not enough host memory`` / ``memory capacity is unbalanced`` / ``alloc_req_slots`` /
    argparse errors beat a generic CUDA OOM, which beats ``Scheduler hit an exception``. A
    generic CUDA OOM is classed by where it was raised: the innermost known frame of its
    traceback, else the startup phase reached. While serving, or in the warm-up batch →
    runtime OOM; loading the target's weights (or earlier) → weight-load OOM; before ready and
    after the KV pool is sized (``init_memory_pool``'s req_to_token table and KV pool, graphs,
    a draft worker loaded after the pool, all from the ``1 − mfs`` reserve, §1.6) → CUDA-graph
    OOM; a log that shows nothing of a start → runtime OOM. A negative
    profiled token count in the ``max_total_tokens=... is larger than the profiled value`` line
    is a startup KV OOM (case-03). With no failure line, a non-zero ``exit_status`` gives
    ``invalid_arguments`` for status 2 before any startup line, ``host_memory`` right after the
    host-pool allocation (case-16), else ``crash``.

    Args:
        lines: The log lines.
        exit_status: The process exit status when known.

    Returns:
        The :class:`Failure`, or ``None`` when nothing failed.
    """
    return parse_log(lines, exit_status=exit_status).failure


_OUTCOMES = {
    FailureClass.STARTUP_KV_OOM: "startup_oom",
    FailureClass.WEIGHT_LOAD_OOM: "startup_oom",
    FailureClass.CUDA_GRAPH_OOM: "startup_oom",
    FailureClass.STARTUP_OOM: "startup_oom",
    FailureClass.RUNTIME_OOM: "runtime_oom",
    FailureClass.KV_PAGE_SHORTFALL: "runtime_oom",
}


def outcome_of(failure: Failure | None) -> str:
    """Coarse outcome (``started``, ``startup_oom``, ``runtime_oom``, ``other_error``) of a failure,
    the vocabulary of ``shared/cases/README.md``."""
    if failure is None:
        return "started"
    return _OUTCOMES.get(failure.failure_class, "other_error")


# ---- the server's own error line (the run quotes it when a trial cannot start) ----------------

_ERROR_LINE_RE = re.compile(r"(?i)\berror\b|exception|address already in use|no such file|not found")


def log_error_line(lines: Sequence[str]) -> str | None:
    """The server's own reason in its log: the last line that reads like an error.

    Args:
        lines: The server log's lines, oldest first.

    Returns:
        That line (stripped, at most 400 characters; a ``Traceback`` header is skipped), or
        ``None`` when no line reads like an error.
    """
    for line in reversed(lines):
        text = line.strip()
        if text and _ERROR_LINE_RE.search(text) and not text.startswith("Traceback"):
            return text[:400]
    return None
