"""Failure classes: why an SGLang start or run ended, with the evidence line, the phase and the lever.

The classes follow the failure modes of ``shared/sglang-reference.md`` §4.3 (startup) and §4.4
(runtime). The log parser (:mod:`tuner.sglang.logs`) assigns them from the evidence line, the
traceback frames and the phase the server had reached; launchers, trials and the study store them
as data (a failed trial is information, never noise). Each class has one :class:`Lever`: the knob
to move, which way, and why (:data:`LEVERS`); ``tuner explain`` refines it with the log's numbers.

The sets at the bottom are the one place that says which classes bound which knob; the study's
skip rules (:func:`tuner.sglang.memory.must_fail`, the planner's ceilings) use them.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "FailureClass",
    "Failure",
    "Lever",
    "LEVERS",
    "STARTUP_MEMORY_FAILURES",
    "RESERVE_FAILURES",
    "KV_SHORT_FAILURES",
    "SOFT_CLASSES",
]


class FailureClass(str, Enum):
    """Why a server failed. Values are stable strings stored in the study database."""

    INVALID_ARGUMENTS = "invalid_arguments"
    """argparse rejected the command line, or a server-args check failed (exit 2)."""
    STARTUP_KV_OOM = "startup_kv_oom"
    """``Not enough memory. Please try to increase --mem-fraction-static`` (§4.3): KV budget ≤ 0."""
    WEIGHT_LOAD_OOM = "weight_load_oom"
    """CUDA OOM while loading the target's weights, before the KV pool is sized."""
    CUDA_GRAPH_OOM = "cuda_graph_oom"
    """``Capture cuda graph failed`` (§4.3): graphs did not fit the ``1 - mem_fraction_static`` reserve.
    Also any CUDA/HIP OOM at startup after the KV pool is sized (the req_to_token table and KV pool in
    ``init_memory_pool``, an attention backend's workspace such as AITER's, a 0.5.5/0.5.10 draft
    worker, §1.5, §1.6): the same reserve was too small."""
    STARTUP_OOM = "startup_oom"
    """A CUDA/HIP OOM before the server was ready where the log shows neither the phase nor a known
    traceback frame (an excerpt with the error alone) and nothing of serving: a startup OOM whose
    knob cannot be told from the log."""
    HOST_MEMORY = "host_memory"
    """``Not enough host memory available`` for the hierarchical cache (§4.3, §7)."""
    UNBALANCED_MEMORY = "unbalanced_memory"
    """``The memory capacity is unbalanced`` (§1.1): another process holds memory on some GPU."""
    STARTUP_TIMEOUT = "startup_timeout"
    """No ready line and no failure line within the start timeout (hang)."""
    RUNTIME_OOM = "runtime_oom"
    """``CUDA out of memory`` while serving or in the warm-up batch (§4.4): activations outgrew the headroom."""
    KV_PAGE_SHORTFALL = "kv_page_shortfall"
    """``Prefill/Decode out of memory. Try to lower your batch size.`` or ``memory allocation failed with
    OOM`` (§4.4): the KV allocator had no free pages (``available_size`` + ``evictable_size`` below
    what the batch needs, rounded up to whole pages per request). Not CUDA memory: a lower fraction
    makes it worse."""
    RETRACTION_STORM = "retraction_storm"
    """``KV cache pool is full. Retract requests.`` (0.4.x wording ``Decode out of memory happened.
    #retracted_reqs``, §4.4): the scheduler evicted running requests because the KV pool was full.
    A soft class: the server keeps running (never a launch failure), decode slows while the
    retracted requests are re-run."""
    REQUEST_SLOT_EXHAUSTION = "request_slot_exhaustion"
    """``alloc_req_slots runs out of memory`` (§4.4): req_to_token pool exhausted."""
    CRASH = "crash"
    """Any other exit or exception."""
    JOURNAL_UNREADABLE = "journal_unreadable"
    """Not the server's failure: the service manager's journal stopped answering during the
    trial, so its log (and any OOM or invalid-flag line in it) could not be read. The run stops."""


Phase = Literal["init", "weights", "after_weights", "kv_pool", "after_pool", "capture", "after_capture", "host_pool", "serving"]


class Lever(BaseModel):
    """The knob a diagnosis says to move.

    Attributes:
        knob: SGLang's field name (``mem_fraction_static``, ``page_size``, ``hicache_size``), or
            ``None`` when no server knob helps (a crash to read, a model that does not fit).
        direction: ``raise``, ``lower``, ``set`` (give an explicit value) or ``none``.
        why: One sentence with the reason (and the log's numbers when ``tuner explain`` has them).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    knob: str | None
    direction: Literal["raise", "lower", "set", "none"]
    why: str


LEVERS: dict[FailureClass, Lever] = {
    FailureClass.STARTUP_KV_OOM: Lever(knob="mem_fraction_static", direction="raise",
                                       why="mem_fraction_static × free memory did not cover the weights, so the KV budget was ≤ 0 (§1.2, §4.3)"),
    FailureClass.WEIGHT_LOAD_OOM: Lever(knob="tp_size", direction="raise",
                                        why="the weights did not fit before any fraction applies: more GPUs (tp), a quantized checkpoint, or free the GPUs"),
    FailureClass.CUDA_GRAPH_OOM: Lever(knob="mem_fraction_static", direction="lower",
                                       why="what is allocated after the KV pool (graphs, workspace, req_to_token, draft) comes from the "
                                           "(1 − mem_fraction_static) reserve, which was too small (§1.6)"),
    FailureClass.STARTUP_OOM: Lever(knob="mem_fraction_static", direction="lower",
                                    why="an OOM before ready with no phase line: unless the weights alone do not fit, what runs out at "
                                        "startup comes from the (1 − mem_fraction_static) reserve (§1.6); the log does not show which phase"),
    FailureClass.HOST_MEMORY: Lever(knob="hicache_size", direction="lower",
                                    why="the hierarchical cache's host pool is allocated per rank and must fit host RAM (§7)"),
    FailureClass.UNBALANCED_MEMORY: Lever(knob=None, direction="none",
                                          why="another process holds GPU memory on some GPU; free it (wait for a stopped server to exit) (§1.1)"),
    FailureClass.RUNTIME_OOM: Lever(knob="chunked_prefill_size", direction="lower",
                                    why="activations of the running batch outgrew the headroom after graphs: a smaller prefill chunk, or a "
                                        "lower mem_fraction_static for more headroom (§4.4)"),
    FailureClass.KV_PAGE_SHORTFALL: Lever(knob="page_size", direction="lower",
                                          why="the KV allocator ran out of free pages (each request takes whole pages), not CUDA memory: a "
                                              "smaller page size, fewer request slots, or more KV (a higher fraction); a lower fraction makes it worse (§4.4)"),
    FailureClass.RETRACTION_STORM: Lever(knob="mem_fraction_static", direction="raise",
                                         why="the KV pool was full and running requests were retracted: more KV (a higher fraction, fp8 KV, "
                                             "more GPUs) or shorter requests (§4.4, §8)"),
    FailureClass.REQUEST_SLOT_EXHAUSTION: Lever(knob="max_running_requests", direction="set",
                                                why="the req_to_token pool had no request slot left while the KV pool may have room (§4.4)"),
    FailureClass.INVALID_ARGUMENTS: Lever(knob=None, direction="none", why="the command line was rejected: fix the flag for this SGLang version"),
    FailureClass.STARTUP_TIMEOUT: Lever(knob=None, direction="none", why="no ready line within the start timeout: raise the timeout or find the hang"),
    FailureClass.CRASH: Lever(knob=None, direction="none", why="no memory cause in the log: read the traceback above the evidence line"),
}
"""The default lever of each class; ``tuner explain`` makes it concrete with the log's numbers."""


STARTUP_MEMORY_FAILURES = frozenset(
    {FailureClass.STARTUP_KV_OOM, FailureClass.WEIGHT_LOAD_OOM, FailureClass.CUDA_GRAPH_OOM, FailureClass.STARTUP_OOM}
)
"""Startup failures caused by GPU memory: what the search explores (not a broken command).
:func:`tuner.sglang.memory.must_fail` proves others from all but ``startup_oom`` (phase unknown)."""

RESERVE_FAILURES = frozenset({FailureClass.CUDA_GRAPH_OOM, FailureClass.RUNTIME_OOM})
"""Failures that bound ``mem_fraction_static`` from above: the ``(1 − mfs)`` reserve was too small (§1.6)."""

KV_SHORT_FAILURES = frozenset({FailureClass.STARTUP_KV_OOM, FailureClass.KV_PAGE_SHORTFALL, FailureClass.RETRACTION_STORM})
"""Failures of too little KV: a lower fraction never helps them (they never bound it from above)."""

SOFT_CLASSES = frozenset({FailureClass.RETRACTION_STORM})
"""Classes of a server that keeps running: a diagnosis, never a launch failure."""


class Failure(BaseModel):
    """One classified failure.

    Attributes:
        failure_class: The class.
        evidence: The log line (ANSI and prefixes stripped) that proves it, or a description of
            what was observed (``"no ready line after 600 s"``).
        exit_status: The process exit status when known (``None`` when still running or unknown).
        rank: The rank prefix of the evidence line (``"TP3"``), if any.
        phase: The startup phase the server had reached when it failed (``weights``,
            ``kv_pool``, ``after_pool``, ``capture``, ``serving``, ...), ``None`` when the log shows none.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    failure_class: FailureClass
    evidence: str
    exit_status: int | None = None
    rank: str | None = None
    phase: str | None = None
