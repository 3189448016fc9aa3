"""The :class:`Lever` declaration: a structural lever's names, knob row and rules (:mod:`tuner.knobs`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tuner.knobs.knob import Knob
from tuner.sglang.levers import Verdict, default_backend, feasibility, flag_available
from tuner.sglang.modelconfig import ModelArch

__all__ = ["Lever", "lever_sizes", "mla_at_tp", "size_unavailable"]


@dataclass(frozen=True, kw_only=True)
class Lever:
    """One structural lever: its names, its knob row and its rules (override the methods).

    Attributes:
        name: The lever's own name (``fp8_kv``): ``[space] exclude_levers`` and ``levers.json``'s ``lever``.
        words: How the dry run and the progress lines name it (``fp8 KV (kv_cache_dtype)``).
        knob: Its row of the knob table (:data:`tuner.study.space.KNOBS`); ``knob.name`` is the
            Optuna param, the ``[space]`` key and a candidate's key (an SGLang field name).
        flag: The SGLang field whose presence in the version's flag table says the lever exists
            (``enable_dp_attention`` for DP attention).
        neutral: The knob's value that sets nothing in SGLang (``auto``, 1): a config without the
            knob runs it.
        probe: The value the flag table and the feasibility table are asked about when the lever
            is derived (``fp8_e4m3`` for fp8 KV; ``None``: the flag alone).
        changes_numerics: Its launched flags change the model's answers (then each of them is in
            :data:`tuner.sglang.numerics.NUMERICS_FLAGS`; ``tests/knobs/test_levers.py`` checks it).
        switch: A launched flag its knob's value turns on and off with it (DP attention's
            ``enable_dp_attention``, said by ``dp_size``): a rung names the size, not the switch.
        layout: The SGLang fields among its launched ones that set the parallel layout (how the
            model and its KV cache are split over the GPUs: the fingerprint's
            :data:`tuner.study.fingerprint.LAYOUT_FLAGS`).
    """

    name: str
    words: str
    knob: Knob
    flag: str
    neutral: Any
    probe: Any = None
    changes_numerics: bool = True
    switch: str | None = None
    layout: tuple[str, ...] = ()

    # -- derivation from the baseline -----------------------------------------------------------

    def base(self, flags: Mapping[str, Any]) -> Any:
        """The baseline's value of the knob from its command's fields (the neutral value when unset)."""
        value = flags.get(self.knob.name)
        return self.neutral if value is None else value

    def running(self, flags: Mapping[str, Any], base: Any, *, version: str, gpu: str | None,
                attentions: Sequence[str]) -> str | None:
        """Why the baseline runs the lever already (no rung to derive), or ``None``."""
        return None if base == self.neutral else f"the baseline runs it already ({self.knob.name} = {base})"

    def gate(self, flags: Mapping[str, Any], *, tp: int, attentions: Sequence[str], model: ModelArch | None) -> str | None:
        """Why the deployment cannot take the lever (after the flag exists and the attention type
        is known), or ``None``; the feasibility table is asked after this."""
        return None

    def derived(self, base: Any, *, tp: int) -> tuple[Any, ...]:
        """The choices a derived lever searches, the baseline's first."""
        raise NotImplementedError

    # -- availability ------------------------------------------------------------------------------

    def feasible(self, *, gpu: str | None, version: str, backend: str | None, attentions: Sequence[str]) -> Verdict:
        """The feasibility table's cell (``tuner/data/levers.json``, lever :attr:`name`, value
        :attr:`probe`) for every attention type allowed: all must say supported; SGLang's own
        backend is resolved where the command names none and the cell for ``None`` is unknown
        (:func:`tuner.sglang.levers.default_backend`)."""
        verdicts = []
        for attention in attentions:
            verdict = feasibility(self.name, gpu=gpu, version=version, backend=backend, attention=attention, value=self.probe)
            if verdict.ok is None and backend is None:
                default = default_backend(gpu, attention)
                if default.ok:
                    name, _, source = default.why.partition(": ")
                    verdict = feasibility(self.name, gpu=gpu, version=version, backend=name, attention=attention, value=self.probe)
                    verdict = Verdict(ok=verdict.ok, why=f"{verdict.why}; SGLang's default backend here is {name} ({source})")
            verdicts.append(verdict)
        bad = [v for v in verdicts if v.ok is not True]
        return bad[0] if bad else verdicts[0]

    def unavailable(self, value: Any, *, version: str | None, tp: int) -> str | None:
        """Why SGLang ``version`` at ``--tp-size tp`` cannot launch the knob at ``value`` (a fact
        with its source), or ``None``; the neutral value is never asked about. ``version`` ``None``
        (unknown): only the rules that do not depend on it."""
        return None

    # -- the launch ----------------------------------------------------------------------------------

    def render(self, value: Any) -> dict[str, Any]:
        """The SGLang fields ``value`` sets on the baseline's command (``None``: the flag is removed)."""
        return {self.knob.name: value}

    def rung(self, value: Any) -> dict[str, Any]:
        """The ladder's flags of ``value`` (:func:`tuner.sglang.ladder.evaluate`), ``value`` ``None`` = neutral."""
        value = self.neutral if value is None else value
        return {} if value == self.neutral else {self.knob.name: value}

    def gain(self, value: Any) -> float:
        """The most ``value`` can multiply the logical pool at an unchanged budget (orders the rungs)."""
        return 1.0

    # -- capacity ------------------------------------------------------------------------------------

    def pools(self, value: Any) -> int:
        """KV pools of their own across the deployment under ``value`` (DP attention's ranks), 1 else."""
        return 1

    def interleave(self, value: Any) -> int:
        """Ranks one request's KV is spread over under ``value`` (DCP's), 1 else."""
        return 1


def lever_sizes(tp: int) -> tuple[int, ...]:
    """A size lever's derived choices: 1 (off), tp and tp / 2 (distinct, ≥ 1)."""
    return tuple(dict.fromkeys(s for s in (1, tp, tp // 2) if s >= 1))


def mla_at_tp(tp: int, attentions: Sequence[str]) -> str | None:
    """Why a parallel attention lever (DCP, DP attention) cannot be derived here: it needs an MLA
    model at tp > 1; ``None`` when it can."""
    if tp <= 1 or not set(attentions) <= {"mla", "dsa"}:
        return f"needs an MLA model at tp > 1 (tp {tp}, attention {'/'.join(attentions)})"
    return None


def size_unavailable(lever: Lever, value: Any, *, version: str | None, tp: int, source: str) -> str | None:
    """A size lever's availability (DCP, DP attention): the version has its flag (:attr:`Lever.flag`,
    unknown ``version``: not asked), and ``value`` divides ``--tp-size`` (``source`` says where SGLang checks it)."""
    verdict = None if version is None else flag_available(version, lever.flag)
    if verdict is not None and verdict.ok is False:
        return verdict.why
    if tp % int(value):
        return f"--{lever.knob.name.replace('_', '-')} {value} must divide --tp-size {tp} ({source})"
    return None
