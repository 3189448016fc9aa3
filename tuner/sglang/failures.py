"""Failure classes: why an SGLang start or run ended, with the evidence line.

The classes follow the failure modes of ``shared/sglang-reference.md`` §4.3 (startup) and §4.4
(runtime). The log parser (:mod:`tuner.sglang.logs`) assigns them; launchers, trials and the study
store them as data (a failed trial is information, never noise).
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict

__all__ = ["FailureClass", "Failure", "STARTUP_MEMORY_FAILURES"]


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
    Also any CUDA OOM at startup after the KV pool is sized (the req_to_token table and KV pool in
    ``init_memory_pool``, a 0.5.5/0.5.10 draft worker, §1.5, §1.6): the same reserve was too small."""
    HOST_MEMORY = "host_memory"
    """``Not enough host memory available`` for the hierarchical cache (§4.3, §7)."""
    UNBALANCED_MEMORY = "unbalanced_memory"
    """``The memory capacity is unbalanced`` (§1.1): another process holds memory on some GPU."""
    STARTUP_TIMEOUT = "startup_timeout"
    """No ready line and no failure line within the start timeout (hang)."""
    RUNTIME_OOM = "runtime_oom"
    """``CUDA out of memory`` while serving or in the warm-up batch, ``Scheduler hit an exception`` (§4.4)."""
    REQUEST_SLOT_EXHAUSTION = "request_slot_exhaustion"
    """``alloc_req_slots runs out of memory`` (§4.4): req_to_token pool exhausted."""
    CRASH = "crash"
    """Any other exit or exception."""
    JOURNAL_UNREADABLE = "journal_unreadable"
    """Not the server's failure: the service manager's journal stopped answering during the
    trial, so its log (and any OOM or invalid-flag line in it) could not be read. The run stops."""


STARTUP_MEMORY_FAILURES = frozenset(
    {FailureClass.STARTUP_KV_OOM, FailureClass.WEIGHT_LOAD_OOM, FailureClass.CUDA_GRAPH_OOM}
)
"""Failures that are monotone in ``mem_fraction_static`` (see :mod:`tuner.sglang.memory`)."""


class Failure(BaseModel):
    """One classified failure.

    Attributes:
        failure_class: The class.
        evidence: The log line (ANSI and prefixes stripped) that proves it, or a description of
            what was observed (``"no ready line after 600 s"``).
        exit_status: The process exit status when known (``None`` when still running or unknown).
        rank: The rank prefix of the evidence line (``"TP3"``), if any.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    failure_class: FailureClass
    evidence: str
    exit_status: int | None = None
    rank: str | None = None
