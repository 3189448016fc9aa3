"""The structural levers, declared: one module per lever, and :data:`LEVERS`, the one tuple every reader loops over.

One concept: what the tuner knows of a structural lever (a flag that changes the KV pool's shape
by more than the fraction can: fp8 KV, decode context parallelism, DP attention), each in its own
module in the shape of SGLang's ``python/sglang/srt/arg_groups/*_hook.py`` (a field and its
rules). A :class:`Lever` declares

- its names: :attr:`Lever.name` (``[space] exclude_levers``, the feasibility table's ``lever`` in
  ``tuner/data/levers.json``), its knob row :attr:`Lever.knob` (the Optuna param and the
  ``[space]`` key, an SGLang field name), the flag the flag tables answer for (:attr:`Lever.flag`);
- its neutral value (:attr:`Lever.neutral`: the value that sets nothing in SGLang);
- how it is derived from the baseline and the facts (:meth:`Lever.base`, :meth:`Lever.running`,
  :meth:`Lever.gate`, :meth:`Lever.derived`; the generic walk is
  :func:`tuner.study.lever_space.derive_levers`);
- when it is available (:meth:`Lever.unavailable`: the version's flag table, the layout's
  divisibility rules; the feasibility table's GPU × backend × attention cells by :attr:`Lever.name`);
- how it renders to launched flags (:meth:`Lever.render`: ``dp_size`` 4 → ``--enable-dp-attention
  --dp-size 4``), which the record, the numerics key and the fingerprint read;
- how the ladder prices it (:meth:`Lever.rung`: the ladder's flags of one value, and
  :meth:`Lever.gain`, the most it can multiply the logical pool);
- how capacity counts under it (:meth:`Lever.pools`, :meth:`Lever.interleave`).

The readers (the space, the lever derivation, the rung proposer, the screens, the render, the
record's numerics, the fingerprint's layout flags, the dry run's checks) loop over
:data:`LEVERS` and never name a lever. They read it as ``tuner.knobs.LEVERS`` at call time, so a
test may plant a lever by replacing the tuple. No registry, no entry points: a new lever is a
module here and one more item of the tuple.

SGLang's facts behind each rule (flag tables, feasibility cells, the ladder's arithmetic) stay in
:mod:`tuner.sglang` (:mod:`tuner.sglang.levers`, :mod:`tuner.sglang.ladder`, :mod:`tuner.sglang.numerics`).
"""

from __future__ import annotations

from tuner.config import SpaceSection
from tuner.errors import ConfigError
from tuner.knobs.dcp import DCP
from tuner.knobs.dp_attention import DP_ATTENTION
from tuner.knobs.fp8_kv import FP8_KV
from tuner.knobs.knob import Knob
from tuner.knobs.lever import Lever, lever_sizes

__all__ = ["Lever", "LEVERS", "Knob", "lever_sizes", "check_listed_levers"]

LEVERS: tuple[Lever, ...] = (FP8_KV, DCP, DP_ATTENTION)
"""Every structural lever, in the order the knob table asks for them and the dry run lists them."""


def check_listed_levers(section: SpaceSection, *, version: str | None, tp: int) -> None:
    """The values ``[space]`` lists for each lever, checked by the lever's own rule before anything
    runs (``tuner run`` and its dry run, :func:`tuner.preflight.check_run`): a list must name a
    value, and each value other than the neutral one must be one this deployment can take
    (:meth:`Lever.unavailable`: the version's flag table, ``--dcp-size`` / DP attention's
    ``--dp-size`` dividing ``--tp-size``); an unknown fact is not refused (the study's screen skips
    what the started server proves).

    Args:
        section: ``[space]``.
        version: The SGLang version the service runs (``None``: unknown, only the layout is checked).
        tp: The service's ``--tp-size``.

    Raises:
        ConfigError: Naming the key, the value and the fact, with the fix.
    """
    for lever in LEVERS:
        name = lever.knob.name
        listed = getattr(section, name, None)
        if listed is None:
            continue
        if not listed:
            raise ConfigError(f"[space] {name} = [] lists no value",
                              hint=f"list the values to search, or leave {name} out to let the study derive it "
                                   f"({lever.words}), or add {lever.name!r} to exclude_levers to leave it out")
        for value in listed:
            if value == lever.neutral:
                continue
            why = lever.unavailable(value, version=version, tp=tp)
            if why is not None:
                raise ConfigError(f"[space] {name} = {list(listed)}: {value!r} cannot run here: {why}",
                                  hint=f"list only values this deployment takes, or leave {name} out")
