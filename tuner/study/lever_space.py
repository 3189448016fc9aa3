"""The structural levers a study's space derives: which rungs it searches without being told, and why.

One concept (issue 23): from the baseline's flags, the SGLang version's flag table and the
feasibility table (GPU architecture × version × attention backend × attention type,
``tuner/data/levers.json``), each structural lever is a dimension of the space or is left out with
its reason, as :func:`tuner.study.space.decide_hicache` does for the hierarchical cache:

- **fp8 KV** (``kv_cache_dtype``: the baseline's, ``fp8_e4m3``), **DCP** (``dcp_size``: 1, tp,
  tp / 2; MLA models at tp > 1) and **DP attention** (``dp_size`` with ``--enable-dp-attention``:
  1, tp, tp / 2; MLA models at tp > 1, priced from the model's ``config.json``) are derived only
  where the version has the flag and the table's cell says *supported* for this GPU, the
  baseline's attention backend (SGLang's own default where the command names none,
  :func:`tuner.sglang.levers.default_backend`) and the model's attention type. An unknown cell is
  not derived: the reason says what is unknown. A lever the baseline runs already is not derived,
  SGLang's resolution of ``auto`` included: a DeepSeek DSA model's ``auto`` KV is ``fp8_e4m3`` on
  SM ≥ 10 (:func:`tuner.sglang.levers.dsa_kv_settings`), so ``--kv-cache-dtype fp8_e4m3`` there
  starts the same server (no rung).
- ``[space]`` overrides: a list names the lever's values (one value, the baseline's, pins it),
  ``exclude_levers`` leaves levers out.

The attention type comes from the model's ``config.json`` (``[model] config_json`` or
``--model-path``'s), else from the baseline's startup log (one ``KV size`` buffer: the MLA family;
``K size`` and ``V size``: MHA/GQA), else it is unknown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from tuner.config import SpaceSection, TunerConfig
from tuner.errors import TunerError
from tuner.sglang.levers import (
    Verdict,
    attention_type,
    default_backend,
    dsa_kv_settings,
    feasibility,
    flag_available,
    gpu_arch,
)
from tuner.sglang.modelconfig import ModelArch, load_model_config

__all__ = ["LeverChoice", "LEVER_FIELDS", "derive_levers", "study_model", "attentions_of_log"]

LEVER_FIELDS = {"fp8_kv": "kv_cache_dtype", "dcp": "dcp_size", "dp_attention": "dp_size"}
"""Each structural lever the study searches (``[space] exclude_levers`` names) → its knob."""

_FP8 = "fp8_e4m3"
_WORDS = {"fp8_kv": "fp8 KV (kv_cache_dtype)", "dcp": "DCP (dcp_size)", "dp_attention": "DP attention (dp_size)"}


class LeverChoice(BaseModel):
    """The structural levers' place in a study's space.

    Attributes:
        kv_cache_dtype: Choices, the baseline's first, or ``None`` (not searched).
        dcp_size: Choices, the baseline's (1) first, or ``None``.
        dp_size: DP-attention sizes, 1 (off) first, or ``None``.
        reasons: One line per lever: derived / given / left out, and why (the dry run and the
            baseline's progress line say them).
    """

    model_config = ConfigDict(frozen=True)

    kv_cache_dtype: tuple[str, ...] | None = None
    dcp_size: tuple[int, ...] | None = None
    dp_size: tuple[int, ...] | None = None
    reasons: tuple[str, ...] = ()


def study_model(config: TunerConfig, flags: Mapping[str, Any]) -> ModelArch | None:
    """The served model's architecture from ``[model] config_json``, else ``--model-path``'s
    ``config.json`` when it is a local directory; ``None`` when neither reads."""
    paths = [config.model.config_json] if config.model.config_json else []
    model_path = flags.get("model_path")
    if isinstance(model_path, str) and model_path and Path(model_path).is_dir():
        paths.append(model_path)
    for path in paths:
        try:
            return load_model_config(path)
        except TunerError:
            continue
    return None


def attentions_of_log(ranks: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...]:
    """The attention types a baseline's parsed startup lines allow (:class:`tuner.sglang.logs.RankMemory`
    fields by rank): one ``KV size`` buffer is the MLA family (MLA or DSA, §4.2), ``K size`` and
    ``V size`` are MHA/GQA; a hybrid pool (SWA, Mamba) or no KV line: ``()`` (unknown)."""
    for rank in ranks.values():
        if rank.get("swa_pool_gib") is not None or rank.get("mamba_cache_gib") is not None:
            return ()
        if rank.get("k_size_gib") is not None:
            return ("mha",)
        if rank.get("kv_size_gib") is not None:
            return ("mla", "dsa")
    return ()


def _feasible(lever: str, *, gpu: str | None, version: str, backend: str | None, attentions: Sequence[str],
              value: str | None = None) -> Verdict:
    """The table's cell for every attention type allowed (all must say supported), SGLang's own
    backend resolved where the command names none and the cell for ``None`` is unknown."""
    verdicts = []
    for attention in attentions:
        verdict = feasibility(lever, gpu=gpu, version=version, backend=backend, attention=attention, value=value)
        if verdict.ok is None and backend is None:
            default = default_backend(gpu, attention)
            if default.ok:
                name, _, source = default.why.partition(": ")
                verdict = feasibility(lever, gpu=gpu, version=version, backend=name, attention=attention, value=value)
                verdict = Verdict(ok=verdict.ok, why=f"{verdict.why}; SGLang's default backend here is {name} ({source})")
        verdicts.append(verdict)
    bad = [v for v in verdicts if v.ok is not True]
    return bad[0] if bad else verdicts[0]


def _sizes(tp: int) -> tuple[int, ...]:
    return tuple(dict.fromkeys(s for s in (1, tp, tp // 2) if s >= 1))


def _one(lever: str, section: SpaceSection, flags: Mapping[str, Any], *, version: str, gpu: str | None,
         attentions: Sequence[str], model: ModelArch | None) -> tuple[tuple[Any, ...] | None, str]:
    """One lever's choices and its reason line."""
    field = LEVER_FIELDS[lever]
    tp = int(flags.get("tp_size") or 1)
    dp_on = bool(flags.get("enable_dp_attention"))
    base: Any = {"fp8_kv": flags.get("kv_cache_dtype") or "auto", "dcp": int(flags.get("dcp_size") or 1),
                 "dp_attention": int(flags.get("dp_size") or 1) if dp_on else 1}[lever]
    given = getattr(section, field)
    if given:
        choices = tuple(dict.fromkeys([base, *given]))
        if len(choices) == 1:
            return None, f"pinned by [space] {field} = [{base!r}]"
        return choices, f"as [space] {field} lists: {', '.join(map(str, choices))}"
    if lever in section.exclude_levers:
        return None, f"left out by [space] exclude_levers ({lever})"
    in_use = str(base).startswith("fp8") if lever == "fp8_kv" else (dp_on if lever == "dp_attention" else int(base) > 1)
    if in_use:
        return None, f"the baseline runs it already ({field} = {base})"
    if lever == "fp8_kv" and set(attentions) == {"dsa"}:
        resolved, _ = dsa_kv_settings(version=version, gpu=gpu, kv_cache_dtype=str(base))
        if resolved.startswith("fp8"):  # --kv-cache-dtype fp8_e4m3 would start the same server
            return None, (f"the baseline runs it already ({field} = {base} resolves to {resolved} for DeepSeek DSA on "
                          f"{gpu_arch(gpu)}: 0.5.5 server_args.py, 0.5.23 arg_groups/overrides.py _dsa_kv_cache_dtype_default)")
    flag = "enable_dp_attention" if lever == "dp_attention" else field
    has = flag_available(version, flag, _FP8 if lever == "fp8_kv" else None)
    if has.ok is not True:
        return None, f"not derived: {has.why}"
    if not attentions:
        return None, ("not derived: the model's attention type is unknown (no readable config.json: set [model] "
                      "config_json; no MLA/MHA KV line in the baseline's log)")
    if lever != "fp8_kv":
        if tp <= 1 or not set(attentions) <= {"mla", "dsa"}:
            return None, f"not derived: needs an MLA model at tp > 1 (tp {tp}, attention {'/'.join(attentions)})"
        if lever == "dp_attention" and int(flags.get("dp_size") or 1) > 1:
            return None, "not derived: the baseline runs plain data parallelism (--dp-size without DP attention)"
        if lever == "dp_attention" and model is None:
            return None, ("not derived: pricing DP attention's replicated attention weights needs the model's config.json "
                          "(set [model] config_json)")
    verdict = _feasible(lever, gpu=gpu, version=version, backend=flags.get("attention_backend"), attentions=attentions,
                        value=_FP8 if lever == "fp8_kv" else None)
    if verdict.ok is not True:
        return None, f"not derived: {verdict.why}"
    choices = (base, _FP8) if lever == "fp8_kv" else _sizes(tp)
    return choices, f"derived: {', '.join(map(str, choices))} ({has.why}; {verdict.why})"


def derive_levers(section: SpaceSection, flags: Mapping[str, Any], *, version: str, gpu: str | None,
                  model: ModelArch | None = None, log_attentions: Sequence[str] = ()) -> LeverChoice:
    """Which structural levers enter the space, with their choices and one reason each.

    Args:
        section: ``[space]`` (its lever lists and ``exclude_levers``).
        flags: The baseline's command line by SGLang field name (:func:`tuner.sglang.flags.parse_argv`).
        version: The SGLang version.
        gpu: The GPU's name or architecture (``None``: unknown, so the table's cells are unknown).
        model: The model's architecture (:func:`study_model`), if known.
        log_attentions: The attention types the baseline's log allows (:func:`attentions_of_log`),
            used when ``model`` is ``None``.

    Returns:
        The :class:`LeverChoice`.
    """
    attentions = (attention_type(model),) if model is not None else tuple(log_attentions)
    out: dict[str, Any] = {}
    reasons = []
    for lever, field in LEVER_FIELDS.items():
        choices, reason = _one(lever, section, flags, version=version, gpu=gpu, attentions=attentions, model=model)
        out[field] = choices
        reasons.append(f"{_WORDS[lever]}: {reason}")
    return LeverChoice(**out, reasons=tuple(reasons))
