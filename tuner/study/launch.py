"""What a trial's params launch: the SGLang fields its command sets on the baseline's.

One rule for the render (:func:`tuner.trial.render_argv` replaces these fields in the baseline's
command), the record and the screens, so that a proposal, a stored record and the quality gate
key the same launch the same way (issue 38: the "failed the gate already" screen keyed
``dp_size: 4`` / ``speculative_algorithm: True`` where the record keyed the launched
``enable_dp_attention`` / ``'eagle3'``, and never matched).

The params are the study's knobs (``tuner.study.space.KNOBS``); a structural lever's knob renders
as its declaration says (:meth:`tuner.knobs.Lever.render`), and some knobs are switches that stand
for several flags:

- ``dp_size`` (DP attention's size; 1 = off): ``--enable-dp-attention --dp-size N`` above 1, both
  removed at 1 (``shared/sglang-reference.md`` §1.5b; :mod:`tuner.knobs.dp_attention`);
- ``enable_hierarchical_cache`` off removes its conditional knobs too (§7);
- ``speculative_algorithm``: ``False`` removes every ``--speculative-*`` flag; ``True`` keeps the
  baseline's algorithm and draft model (§1.5); a string names the algorithm as such.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tuner.knobs
from tuner.records import TrialRecord
from tuner.sglang.numerics import numerics_key
from tuner.study.space import HICACHE_KNOBS

__all__ = ["launch_changes", "launch_fields", "launch_numerics", "needs_reference", "record_numerics", "render_levers"]


def render_levers(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with each structural lever's knob rendered to the fields it launches
    (:meth:`tuner.knobs.Lever.render`: ``dp_size`` above 1 sets ``enable_dp_attention`` with it, 1
    removes both, §1.5b); a knob that renders to itself keeps its place."""
    out = dict(params)
    for lever in tuner.knobs.LEVERS:
        name = lever.knob.name
        if name in out and (fields := lever.render(out[name])) != {name: out[name]}:
            del out[name]
            out.update(fields)
    return out


def launch_changes(params: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """The SGLang fields ``params`` set on the baseline's command (``None``: the flag is removed).

    Args:
        params: A trial's params (the study's knobs; see the module docstring for the switches).
        baseline: The baseline command's fields (``tuner.sglang.flags.parse_argv``), or at least
            its ``speculative_*`` ones.

    Returns:
        Field → value to set, e.g. ``{"enable_dp_attention": True, "dp_size": 4}`` for ``{"dp_size": 4}``.
    """
    rendered = dict(params)
    if rendered.get("enable_hierarchical_cache") is False:
        rendered.update(dict.fromkeys(("enable_hierarchical_cache", *HICACHE_KNOBS)))
    rendered = render_levers(rendered)
    switch = rendered.pop("speculative_algorithm", None)
    if switch is False:
        rendered.update(dict.fromkeys(k for k in baseline if k.startswith("speculative_")))
    elif isinstance(switch, str):  # an algorithm named as such (the baseline's own params)
        rendered["speculative_algorithm"] = switch
    return rendered


def launch_fields(params: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """The fields the launch of ``params`` runs with: the baseline's, :func:`launch_changes` over
    them (removed flags dropped)."""
    merged = {**baseline, **launch_changes(params, baseline)}
    return {name: value for name, value in merged.items() if value is not None}


def launch_numerics(params: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """The numerics key (:func:`tuner.sglang.numerics.numerics_key`, as a mapping) of the launch
    of ``params`` on the baseline's fields: the key a trial's record stores for the same launch."""
    return dict(numerics_key(launch_fields(params, baseline)))


def record_numerics(record: TrialRecord) -> dict[str, Any]:
    """A stored trial's numerics key, rebuilt from what it launched: its params rendered over its
    recorded numerics (:func:`launch_numerics`), so a record stored before the key was resolved
    (a speculative baseline's shape left to SGLang, recorded as ``speculative_algorithm`` alone
    while its params hold the shape SGLang resolved) reads as the key a new record stores. A new
    record's key is its own: rebuilding it changes nothing."""
    return launch_numerics(record.params, record.quality.numerics)


def needs_reference(finished: Sequence[tuple[int, TrialRecord]]) -> bool:
    """Whether the study holds no reference answers of the baseline's numerics and no launch of
    them tried to record some (a try that failed says why in its ``reason``: no logprobs, a task
    probe without signal): the quality gate was off when they ran, and turning it on needs one
    launch of the baseline's numerics to record them.

    Args:
        finished: ``(number, record)`` of the study's finished trials.
    """
    return not any(r.quality.status == "reference" or (not r.quality.changes and r.quality.reason)
                   for _, r in finished if r.outcome in ("ok", "failed"))
