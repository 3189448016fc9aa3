"""Structural causes in the launch arguments: a flag that explains a failure better than a fraction.

One concept: some failures have their cause in a structural choice of the command line rather than
in ``mem_fraction_static``. SGLang's own message then points at the fraction (``Not enough memory.
Please try to increase --mem-fraction-static``, 0.5.5.post3 ``model_executor/model_runner.py`` line
1666), but the lever is the structural flag. Each rule is one row of :data:`STRUCTURAL_RULES`: the
failure classes it explains, when the arguments show the cause, and the lever.

- **DP attention** (``--enable-dp-attention`` with ``--dp-size N > 1``): attention projections are
  partitioned over ``attn_tp = tp / N`` instead of ``tp``, and the embedding is replicated when
  ``N = tp`` (``python/sglang/srt/models/deepseek_v2.py``; ``shared/sglang-reference.md`` §1.5b),
  so every GPU holds more weights and the same fraction leaves less (or no) KV budget. SGLang turns
  DP attention off at ``dp_size == 1`` (0.5.5.post3 ``server_args.py`` ``_handle_data_parallelism``),
  so the rule needs a DP size above 1, or none stated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from tuner.sglang.failures import FailureClass, Lever

__all__ = ["StructuralRule", "STRUCTURAL_RULES", "structural_lever"]

_TRUE = ("true", "1", "yes")


def _int_arg(args: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = args.get(name)
        if value is not None and str(value).strip().lstrip("-").isdigit():
            return int(str(value).strip())
    return None


def _dp_attention(args: Mapping[str, Any]) -> str | None:
    """Why DP attention explains a missing KV budget, or ``None`` when it is off."""
    if str(args.get("enable_dp_attention", "")).strip().lower() not in _TRUE:
        return None
    dp = _int_arg(args, "dp_size", "dp")
    if dp is not None and dp <= 1:
        return None  # SGLang turns DP attention off at dp_size 1 (_handle_data_parallelism)
    tp = _int_arg(args, "tp_size", "tp", "tensor_parallel_size")
    shape = (f"tp {tp}, dp {dp}: attention partitioned over attn_tp = {tp // dp}" if tp and dp and tp % dp == 0
             else "attention partitioned over attn_tp = tp / dp")
    return (f"--enable-dp-attention ({shape}) replicates the attention weights (and the embedding at dp = tp) on every GPU "
            "(deepseek_v2.py, §1.5b), so the weights leave no KV budget at this fraction: turn DP attention off, or raise "
            "--mem-fraction-static to what the ladder's DP rung needs")


class StructuralRule(NamedTuple):
    """One structural cause: ``classes`` it explains, ``why(args)`` (``None``: not this launch) and the lever's knob/direction."""

    id: str
    classes: frozenset[FailureClass]
    why: Callable[[Mapping[str, Any]], str | None]
    knob: str
    direction: Literal["raise", "lower", "set", "none"]


STRUCTURAL_RULES: tuple[StructuralRule, ...] = (
    StructuralRule("dp_attention_weights", frozenset({FailureClass.STARTUP_KV_OOM}), _dp_attention, "enable_dp_attention", "set"),
)
"""Every structural cause the explanation knows; adding one is one row and its ``why``."""


def structural_lever(failure_class: FailureClass, args: Mapping[str, Any]) -> Lever | None:
    """The structural lever of a failure, when the launch arguments show its cause.

    Args:
        failure_class: The failure's class.
        args: The launch arguments as logged (``server_args`` echo or command line; SGLang field
            names, string values).

    Returns:
        The first matching rule's lever (``set`` ``enable_dp_attention`` off, with the reason), or
        ``None``.
    """
    for rule in STRUCTURAL_RULES:
        if failure_class in rule.classes and (why := rule.why(args)) is not None:
            return Lever(knob=rule.knob, direction=rule.direction, why=why)
    return None
