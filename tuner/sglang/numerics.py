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

The key is of the flags a launch *runs*, after SGLang's own resolution (:func:`resolve_numerics`):
two command lines SGLang turns into the same server are one numerics, so the baseline's own
speculative shape, left to SGLang's choice on its command line and named on a candidate's, costs
no probe (issue 38).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tuner.sglang.speculative import DRAFT_ALGORITHMS, auto_shape, resolve_shape

__all__ = ["NUMERICS_FLAGS", "LOSSLESS_UNDER_GREEDY", "numerics_key", "numerics_changes", "resolve_numerics"]

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


_SHAPE = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")

_KV_ALIASES = {"bfloat16": "bf16"}
"""``--kv-cache-dtype`` spellings SGLang treats as one (``server_args.py`` choices, 0.5.5-0.5.23)."""


def resolve_numerics(flags: Mapping[str, Any], *, model_class: str | None = None) -> dict[str, Any]:
    """``flags`` with the numerics fields SGLang resolves before it runs, resolved as it does.

    - ``speculative_algorithm`` upper-cased, ``NEXTN`` renamed ``EAGLE`` (0.5.5.post3
      ``srt/server_args.py`` ``_handle_speculative_decoding``; 0.5.23
      ``arg_groups/speculative_hook.py``);
    - a draft algorithm's shape: unset, SGLang's ``auto_choose_speculative_params`` for
      ``model_class`` (:func:`tuner.sglang.speculative.auto_shape`; left unset when the model's
      class is not known); ``speculative_eagle_topk`` 1 forces ``speculative_num_draft_tokens =
      steps + 1`` (:func:`tuner.sglang.speculative.resolve_shape`, ``shared/sglang-reference.md`` §1.5);
    - ``kv_cache_dtype`` ``bfloat16`` is ``bf16``.

    The attention backend SGLang picks when none is named depends on the GPU and the model and
    is not resolved here: a launch naming the default backend counts as a change (probed once).

    Args:
        flags: SGLang field names → values.
        model_class: The model's class (the startup log's weight line, ``DeepseekV3ForCausalLM``),
            or ``None``.

    Returns:
        A new mapping (``flags`` is not changed).
    """
    out = dict(flags)
    kv = out.get("kv_cache_dtype")
    if isinstance(kv, str):
        out["kv_cache_dtype"] = _KV_ALIASES.get(kv.strip().lower(), kv)
    algorithm = out.get("speculative_algorithm")
    if not isinstance(algorithm, str) or _normal("speculative_algorithm", algorithm) is None:
        return out
    algorithm = "EAGLE" if algorithm.strip().upper() == "NEXTN" else algorithm.strip().upper()
    out["speculative_algorithm"] = algorithm
    if algorithm not in DRAFT_ALGORITHMS:
        return out
    given = [out.get(name) for name in _SHAPE]
    if given[0] is None and model_class is not None:
        given = list(auto_shape(model_class, algorithm))
    values = [value for value in given if value is not None]
    if len(values) == len(_SHAPE):
        try:
            out.update(zip(_SHAPE, resolve_shape(*(int(v) for v in values)), strict=True))
        except (TypeError, ValueError):
            pass  # not numbers: the flag check refuses the launch; the key keeps what was given
    return out


def numerics_key(flags: Mapping[str, Any], *, model_class: str | None = None) -> tuple[tuple[str, Any], ...]:
    """The numerics-relevant part of a launch's flags after SGLang's resolution
    (:func:`resolve_numerics`), comparable and hashable.

    Args:
        flags: SGLang field names → values (a trial's params merged over the baseline's flags);
            names not in :data:`NUMERICS_FLAGS` are ignored.
        model_class: The model's class, for the speculative shape SGLang chooses (:func:`resolve_numerics`).

    Returns:
        ``((name, value), ...)`` sorted by name, only flags set to a non-default value; two launches
        with equal keys need one quality probe between them.
    """
    flags = _launched(resolve_numerics(flags, model_class=model_class))
    items = ((name, _normal(name, flags.get(name))) for name in NUMERICS_FLAGS)
    return tuple(sorted((name, value) for name, value in items if value is not None))


def numerics_changes(candidate: Mapping[str, Any], baseline: Mapping[str, Any], *,
                     model_class: str | None = None) -> list[str]:
    """The numerics-relevant flags on which a candidate differs from the baseline, both as SGLang
    resolves them (:func:`resolve_numerics`).

    ``dp_size`` here is SGLang's field: without ``enable_dp_attention`` it is plain data
    parallelism, no change. A study's ``dp_size`` *knob* is DP attention's size: render it first
    (:func:`tuner.study.launch.launch_fields`).

    Args:
        candidate, baseline: SGLang field names → values (unset = SGLang's default).
        model_class: The model's class, for the speculative shape SGLang chooses.

    Returns:
        Sorted field names; empty when the candidate computes what the baseline computes.
    """
    ours, theirs = dict(numerics_key(candidate, model_class=model_class)), dict(numerics_key(baseline, model_class=model_class))
    return sorted(name for name in NUMERICS_FLAGS if ours.get(name) != theirs.get(name))
