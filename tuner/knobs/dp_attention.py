"""DP attention (``--enable-dp-attention --dp-size N``): attention at ``attn_tp = tp / N``, N KV pools of their own (§1.5b).

The knob is DP attention's size (``dp_size``; 1 = off); it renders to both flags, or removes both.
The facts: :mod:`tuner.sglang.levers` (``dp_attention_extra_weight_gib``: the attention and
embedding weights replicated over N; the feasibility cells ``dp_attention``). ``--dp-size`` must
divide ``--tp-size`` (SGLang ``server_args.py`` ``_handle_data_parallelism`` asserts
``self.tp_size % self.dp_size == 0``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tuner.knobs.knob import Knob
from tuner.knobs.lever import Lever, lever_sizes, mla_at_tp, size_unavailable
from tuner.sglang.modelconfig import ModelArch

__all__ = ["DP_ATTENTION"]

_SWITCH = "enable_dp_attention"


class _DpAttention(Lever):
    """DP attention: derived as 1, tp, tp / 2 for MLA models at tp > 1 with a ``config.json``
    (its replicated weights are priced from it), never over plain data parallelism."""

    def base(self, flags: Mapping[str, Any]) -> Any:
        return int(flags.get(self.knob.name) or 1) if flags.get(_SWITCH) else 1

    def running(self, flags: Mapping[str, Any], base: Any, *, version: str, gpu: str | None,
                attentions: Sequence[str]) -> str | None:
        return f"the baseline runs it already ({self.knob.name} = {base})" if flags.get(_SWITCH) else None

    def gate(self, flags: Mapping[str, Any], *, tp: int, attentions: Sequence[str], model: ModelArch | None) -> str | None:
        if (why := mla_at_tp(tp, attentions)) is not None:
            return why
        if int(flags.get(self.knob.name) or 1) > 1:
            return "the baseline runs plain data parallelism (--dp-size without DP attention)"
        if model is None:
            return ("pricing DP attention's replicated attention weights needs the model's config.json "
                    "(set [model] config_json)")
        return None

    def derived(self, base: Any, *, tp: int) -> tuple[Any, ...]:
        return lever_sizes(tp)

    def unavailable(self, value: Any, *, version: str | None, tp: int) -> str | None:
        return size_unavailable(self, value, version=version, tp=tp,
                                source="SGLang server_args.py _handle_data_parallelism: tp_size % dp_size == 0")

    def render(self, value: Any) -> dict[str, Any]:
        on = value is not None and int(value) > 1
        return {_SWITCH: True if on else None, self.knob.name: int(value) if on else None}

    def rung(self, value: Any) -> dict[str, Any]:
        size = int(value or 1)
        return {_SWITCH: size > 1, **({self.knob.name: size} if size > 1 else {})}

    def gain(self, value: Any) -> float:
        return float(value)

    def pools(self, value: Any) -> int:
        return int(value or 1)


DP_ATTENTION = _DpAttention(
    name="dp_attention", words="DP attention (dp_size)", flag=_SWITCH, neutral=1,
    switch=_SWITCH, layout=("dp_size", _SWITCH),
    knob=Knob(name="dp_size", kind="categorical", domain="levers",
              help="DP attention's size (--enable-dp-attention --dp-size N; 1 = off): N pools of their own, attention "
                   "weights replicated over N, max_running_requests and chunked_prefill_size divided by N, one request "
                   "≤ one rank's pool (§1.5b; tuner/sglang/levers.py)."),
)
"""DP attention."""
