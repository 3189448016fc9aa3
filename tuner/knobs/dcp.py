"""Decode context parallelism (``--dcp-size N``): a request's KV interleaved over N ranks, the logical pool N × one rank's.

The facts: :mod:`tuner.sglang.levers` (``dcp_gain``, the DSA indexer's replication, the feasibility
cells ``dcp`` of ``tuner/data/levers.json``: SGLang 0.5.23, MLA). ``--dcp-size`` must divide
``--tp-size`` (0.5.23 ``arg_groups/attention_hook.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tuner.knobs.knob import Knob
from tuner.knobs.lever import Lever, lever_sizes, mla_at_tp, size_unavailable
from tuner.sglang.modelconfig import ModelArch

__all__ = ["DCP"]


class _Dcp(Lever):
    """DCP: derived as 1, tp, tp / 2 for MLA models at tp > 1."""

    def base(self, flags: Mapping[str, Any]) -> Any:
        return int(flags.get(self.knob.name) or 1)

    def gate(self, flags: Mapping[str, Any], *, tp: int, attentions: Sequence[str], model: ModelArch | None) -> str | None:
        return mla_at_tp(tp, attentions)

    def derived(self, base: Any, *, tp: int) -> tuple[Any, ...]:
        return lever_sizes(tp)

    def unavailable(self, value: Any, *, version: str | None, tp: int) -> str | None:
        return size_unavailable(self, value, version=version, tp=tp, source="SGLang 0.5.23 attention_hook.py")

    def rung(self, value: Any) -> dict[str, Any]:
        size = int(value or 1)
        return {self.knob.name: size} if size > 1 else {}

    def gain(self, value: Any) -> float:
        return float(value)

    def interleave(self, value: Any) -> int:
        return int(value or 1)


DCP = _Dcp(
    name="dcp", words="DCP (dcp_size)", flag="dcp_size", neutral=1, layout=("dcp_size",),
    knob=Knob(name="dcp_size", kind="categorical", domain="levers",
              help="Decode context parallelism (ranks a request's KV is interleaved over; logical pool × dcp; SGLang "
                   "0.5.23, MLA; tuner/sglang/levers.py)."),
)
"""Decode context parallelism."""
