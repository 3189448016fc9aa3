"""fp8 KV (``--kv-cache-dtype fp8_e4m3``): 1 B per KV element instead of 2, about twice the tokens (§1.3).

The facts: :mod:`tuner.sglang.levers` (the DSA models' ``auto`` resolution, the feasibility cells
``fp8_kv`` of ``tuner/data/levers.json``), the flag tables' ``--kv-cache-dtype`` choices. It changes
the model's answers (:mod:`tuner.sglang.numerics`), so a candidate must pass the quality gate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tuner.knobs.knob import Knob
from tuner.knobs.lever import Lever
from tuner.sglang.levers import dsa_kv_settings, flag_available, gpu_arch

__all__ = ["FP8_KV"]

_FP8 = "fp8_e4m3"


class _Fp8Kv(Lever):
    """fp8 KV: derived as ``(baseline's dtype, fp8_e4m3)``; a baseline already at an fp8 dtype
    (or a DeepSeek DSA model whose ``auto`` resolves to fp8 on SM ≥ 10) runs it."""

    def base(self, flags: Mapping[str, Any]) -> Any:
        return flags.get(self.knob.name) or self.neutral

    def running(self, flags: Mapping[str, Any], base: Any, *, version: str, gpu: str | None,
                attentions: Sequence[str]) -> str | None:
        if str(base).startswith("fp8"):
            return f"the baseline runs it already ({self.knob.name} = {base})"
        if set(attentions) == {"dsa"}:
            resolved, _ = dsa_kv_settings(version=version, gpu=gpu, kv_cache_dtype=str(base))
            if resolved.startswith("fp8"):  # --kv-cache-dtype fp8_e4m3 would start the same server
                return (f"the baseline runs it already ({self.knob.name} = {base} resolves to {resolved} for DeepSeek DSA on "
                        f"{gpu_arch(gpu)}: 0.5.5 server_args.py, 0.5.23 arg_groups/overrides.py _dsa_kv_cache_dtype_default)")
        return None

    def derived(self, base: Any, *, tp: int) -> tuple[Any, ...]:
        return (base, _FP8)

    def unavailable(self, value: Any, *, version: str | None, tp: int) -> str | None:
        verdict = None if version is None else flag_available(version, self.flag, value)
        return verdict.why if verdict is not None and verdict.ok is False else None

    def rung(self, value: Any) -> dict[str, Any]:
        return {self.knob.name: value or self.neutral}  # always named: the ladder's dtype

    def gain(self, value: Any) -> float:
        return 2.0 if str(value).startswith("fp8") else 1.0


FP8_KV = _Fp8Kv(
    name="fp8_kv", words="fp8 KV (kv_cache_dtype)", flag="kv_cache_dtype", neutral="auto", probe=_FP8,
    knob=Knob(name="kv_cache_dtype", kind="categorical", domain="levers",
              help="The KV cache's dtype: auto (the model's) or fp8 (half the bytes per token, so about twice the "
                   "tokens; a structural lever, tuner/sglang/levers.py; it changes the model's answers, so a candidate "
                   "must pass the quality gate, §1.3)."),
)
"""fp8 KV."""
