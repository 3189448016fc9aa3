"""Which SGLang server flags can change what the model answers (the quality gate's scope).

One concept: the numerics of a launch. Two launches with the same *numerics key* compute the same
logits up to kernel nondeterminism; a launch whose key differs from the baseline's can change the
answers and must pass the quality gate before it can be best or applied (issue "quality gate").

The memory and scheduling knobs the tuner searches first (``mem_fraction_static``,
``max_running_requests``, ``chunked_prefill_size``, the hierarchical cache, CUDA-graph sizes) only
change how much runs at once, never the arithmetic of one token, so they are not here.

Sources, per flag (SGLang ``python/sglang/srt/server_args.py`` for the names):

- ``kv_cache_dtype``: fp8/fp4 KV stores K and V at lower precision (sglang#1286 accuracy tables;
  ROCm/ATOM#1772, GSM8K 0.0099 from an fp8 KV dtype bug).
- ``attention_backend``, ``prefill_attention_backend``, ``decode_attention_backend``,
  ``mm_attention_backend``: other kernels, other accumulation order and precision.
- ``dcp_size``: decode context parallelism splits each request's KV across ranks and merges partial
  softmaxes (sglang#14194, #31821 gates itself on GSM8K).
- ``enable_dp_attention`` / ``dp_size`` with it: attention runs at another tensor-parallel degree
  (``tp_size / dp_size``), so other reductions (``shared/sglang-reference.md`` §1.5b); two DP sizes
  are two numerics. ``dp_size`` without DP attention is plain data parallelism: replicas that each
  compute what one server computes, so it is no numerics change.
- ``quantization``, ``dtype``, ``moe_runner_backend``, ``enable_fp32_lm_head``,
  ``triton_attention_reduce_in_fp32``: the weights' or the kernels' precision.
- ``speculative_*``: under greedy decoding, speculative decoding is lossless (the target verifies
  every token), so a speculative change must *pass* the gate; it is probed, not exempt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["NUMERICS_FLAGS", "LOSSLESS_UNDER_GREEDY", "numerics_key", "numerics_changes"]

NUMERICS_FLAGS: tuple[str, ...] = (
    "kv_cache_dtype",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "mm_attention_backend",
    "dcp_size",
    "enable_dp_attention",
    "dp_size",
    "quantization",
    "dtype",
    "moe_runner_backend",
    "enable_fp32_lm_head",
    "triton_attention_reduce_in_fp32",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
)
"""SGLang field names (dests) whose value can change the model's answers (module docstring)."""

LOSSLESS_UNDER_GREEDY: frozenset[str] = frozenset(
    name for name in NUMERICS_FLAGS if name.startswith("speculative_"))
"""Flags whose change keeps greedy answers identical in exact arithmetic (speculative decoding):
the gate still probes them and they must pass."""

_NEUTRAL = {None, "auto", False, "none", ""}


def _normal(name: str, value: Any) -> Any:
    """A value as the key compares it: ``auto``/``None``/``False`` (SGLang's defaults) are one value;
    ``dcp_size`` and ``dp_size`` 1 are none."""
    if isinstance(value, str):
        value = value.strip().lower()
    if value in _NEUTRAL or (name in ("dcp_size", "dp_size") and value in (1, "1")):
        return None
    return value


def _launched(flags: Mapping[str, Any]) -> Mapping[str, Any]:
    """``flags`` less ``dp_size`` when DP attention is off (plain data parallelism)."""
    if _normal("enable_dp_attention", flags.get("enable_dp_attention")) is None and "dp_size" in flags:
        return {name: value for name, value in flags.items() if name != "dp_size"}
    return flags


def numerics_key(flags: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The numerics-relevant part of a launch's flags, comparable and hashable.

    Args:
        flags: SGLang field names → values (a trial's params merged over the baseline's flags);
            names not in :data:`NUMERICS_FLAGS` are ignored.

    Returns:
        ``((name, value), ...)`` sorted by name, only flags set to a non-default value; two launches
        with equal keys need one quality probe between them.
    """
    flags = _launched(flags)
    items = ((name, _normal(name, flags.get(name))) for name in NUMERICS_FLAGS)
    return tuple(sorted((name, value) for name, value in items if value is not None))


def numerics_changes(candidate: Mapping[str, Any], baseline: Mapping[str, Any]) -> list[str]:
    """The numerics-relevant flags on which a candidate differs from the baseline.

    Args:
        candidate, baseline: SGLang field names → values (unset = SGLang's default).

    Returns:
        Sorted field names; empty when the candidate computes what the baseline computes.
    """
    candidate, baseline = _launched(candidate), _launched(baseline)
    return sorted(name for name in NUMERICS_FLAGS
                  if _normal(name, candidate.get(name)) != _normal(name, baseline.get(name)))
