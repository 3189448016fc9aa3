"""What is true of SGLang: flags by version, log parsing, failure classes, the memory model, the HTTP client.

Every fact here cites its section of ``shared/sglang-reference.md`` (``§n.m``). The public API is
:data:`__all__`; names are imported from their modules on first use (PEP 562), so importing
``tuner.sglang.failures`` alone stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    # failures
    "FailureClass", "Failure", "Lever", "LEVERS", "STARTUP_MEMORY_FAILURES", "RESERVE_FAILURES", "KV_SHORT_FAILURES",
    # logs
    "RankMemory", "SchedulerInfo", "LogReport", "LogWatcher", "parse_log", "read_log", "classify", "outcome_of",
    # memory, model config
    "ModelArch", "load_model_config", "cell_size_bytes", "KVCapacityModel", "must_fail",
    # flags, versions
    "FlagTable", "render", "replace_flags", "parse_argv", "validate", "parse_version", "at_least",
    # client
    "ServerInfo", "SGLangClient", "ServerNotReady",
    # explain
    "Explanation", "explain_from",
]

_HOME = {
    "FailureClass": "failures", "Failure": "failures", "STARTUP_MEMORY_FAILURES": "failures", "Lever": "failures",
    "LEVERS": "failures", "RESERVE_FAILURES": "failures", "KV_SHORT_FAILURES": "failures",
    "RankMemory": "logs", "SchedulerInfo": "logs", "LogReport": "logs", "LogWatcher": "logs", "parse_log": "logs",
    "read_log": "logs", "classify": "logs", "outcome_of": "logs",
    "ModelArch": "modelconfig", "load_model_config": "modelconfig",
    "cell_size_bytes": "memory", "KVCapacityModel": "memory", "must_fail": "memory",
    "FlagTable": "flags", "render": "flags", "replace_flags": "flags", "parse_argv": "flags", "validate": "flags",
    "parse_version": "versions", "at_least": "versions",
    "ServerInfo": "client", "SGLangClient": "client", "ServerNotReady": "client",
    "Explanation": "explain", "explain_from": "explain",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'tuner.sglang' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tuner.sglang.{module}"), name)
