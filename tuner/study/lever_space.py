"""The structural levers a study's space derives: which rungs it searches without being told, and why.

One concept (issue 23): from the baseline's flags, the SGLang version's flag table and the
feasibility table (GPU architecture × version × attention backend × attention type,
``tuner/data/levers.json``), each structural lever is a dimension of the space or is left out with
its reason, as :func:`tuner.study.space.decide_hicache` does for the hierarchical cache:

- every lever of :data:`tuner.knobs.LEVERS` goes through the same walk (:func:`derive_levers`):
  ``[space]``'s list, ``exclude_levers``, whether the baseline runs it already
  (:meth:`~tuner.knobs.Lever.running`, SGLang's resolution of ``auto`` included: a DeepSeek DSA
  model's ``auto`` KV is ``fp8_e4m3`` on SM ≥ 10), whether the version has its flag, whether the
  deployment can take it (:meth:`~tuner.knobs.Lever.gate`: DCP and DP attention need an MLA model
  at tp > 1), and the table's cell for this GPU, the baseline's attention backend (SGLang's own
  default where the command names none, :func:`tuner.sglang.levers.default_backend`) and the
  model's attention type; an unknown cell is not derived, the reason says what is unknown. The
  derived choices are the lever's (:meth:`~tuner.knobs.Lever.derived`: fp8 KV the baseline's
  dtype and ``fp8_e4m3``, DCP and DP attention 1, tp, tp / 2).
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

import tuner.knobs
from tuner.config import SpaceSection, TunerConfig
from tuner.errors import TunerError
from tuner.knobs import Lever
from tuner.sglang.levers import attention_type, flag_available
from tuner.sglang.modelconfig import ModelArch, load_model_config

__all__ = ["LeverChoice", "derive_levers", "study_model", "attentions_of_log"]


class LeverChoice(BaseModel):
    """The structural levers' place in a study's space.

    Attributes:
        choices: Each derived or listed lever's choices by knob name (:data:`tuner.knobs.LEVERS`),
            the baseline's first (``kv_cache_dtype``, ``dcp_size``, ``dp_size``: 1 = DP attention
            off); a lever not searched has no entry.
        reasons: One line per lever: derived / given / left out, and why (the dry run and the
            baseline's progress line say them).
    """

    model_config = ConfigDict(frozen=True)

    choices: dict[str, tuple[Any, ...]] = {}
    reasons: tuple[str, ...] = ()

    def of(self, name: str) -> tuple[Any, ...] | None:
        """Knob ``name``'s choices, or ``None`` (not searched)."""
        return self.choices.get(name)


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


def _one(lever: Lever, section: SpaceSection, flags: Mapping[str, Any], *, version: str, gpu: str | None,
         attentions: Sequence[str], model: ModelArch | None) -> tuple[tuple[Any, ...] | None, str]:
    """One lever's choices and its reason line, by its declaration's rules (:class:`tuner.knobs.Lever`)."""
    field = lever.knob.name
    tp = int(flags.get("tp_size") or 1)
    base = lever.base(flags)
    given = getattr(section, field, None)
    if given:
        choices = tuple(dict.fromkeys([base, *given]))
        if len(choices) == 1:
            return None, f"pinned by [space] {field} = [{base!r}]"
        return choices, f"as [space] {field} lists: {', '.join(map(str, choices))}"
    if lever.name in section.exclude_levers:
        return None, f"left out by [space] exclude_levers ({lever.name})"
    running = lever.running(flags, base, version=version, gpu=gpu, attentions=attentions)
    if running is not None:
        return None, running
    has = flag_available(version, lever.flag, lever.probe)
    if has.ok is not True:
        return None, f"not derived: {has.why}"
    if not attentions:
        return None, ("not derived: the model's attention type is unknown (no readable config.json: set [model] "
                      "config_json; no MLA/MHA KV line in the baseline's log)")
    gate = lever.gate(flags, tp=tp, attentions=attentions, model=model)
    if gate is not None:
        return None, f"not derived: {gate}"
    verdict = lever.feasible(gpu=gpu, version=version, backend=flags.get("attention_backend"), attentions=attentions)
    if verdict.ok is not True:
        return None, f"not derived: {verdict.why}"
    choices = lever.derived(base, tp=tp)
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
    out: dict[str, tuple[Any, ...]] = {}
    reasons = []
    for lever in tuner.knobs.LEVERS:
        choices, reason = _one(lever, section, flags, version=version, gpu=gpu, attentions=attentions, model=model)
        if choices is not None:
            out[lever.knob.name] = choices
        reasons.append(f"{lever.words}: {reason}")
    return LeverChoice(choices=out, reasons=tuple(reasons))
