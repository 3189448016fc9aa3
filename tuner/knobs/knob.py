"""One knob the study can change, declared once: the row every knob table is made of.

One concept: the shape of SGLang's ``arg_groups/fields/*.py`` (one declaration per field). The
study's table (:data:`tuner.study.space.KNOBS`) is the memory, scheduling, cache and speculative
rows plus each structural lever's own row (:attr:`tuner.knobs.Lever.knob`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Knob"]


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One SGLang knob the study can change: everything the tuner knows of it, declared once.

    Attributes:
        name: SGLang's field name: the Optuna param's name and a candidate's key.
        kind: ``float`` (a range on a grid), ``int`` (a range of integers), ``categorical`` (a
            list of choices) or ``bool`` (a switch the study turns off and on).
        help: What it sets, with its unit.
        domain: The :class:`~tuner.study.space.Space` field holding its range ``(low, high)`` (``(low, high, step)``
            for ``mem_fraction_static``), its choices, or (``bool``) whether it is searched; unset
            (``None``, empty, false), the knob is not searched. Default: :attr:`name`; ``"levers"``: a
            structural lever's, its entry of :attr:`~tuner.study.space.Space.levers`.
        step: The grid step of a ``float`` knob whose range has no third item.
        log: Sample an ``int`` range on a log scale.
        condition: The switch (a ``bool`` knob) this knob is set under: with the switch off a
            candidate leaves it out (the hierarchical cache's knobs, §7).
        replaces: A knob of the same switch this one is searched instead of when the space holds
            both ranges (``hicache_size`` replaces ``hicache_ratio``).
        memory: It sizes the memory pools or the requests in flight (``mem_fraction_static``,
            ``max_running_requests``): the planner's memory model moves it, and its one-step
            neighbours (:meth:`~tuner.study.space.Space.neighbours`) leave it out.
        absent: Where :meth:`~tuner.study.space.Space.snap` puts a candidate that leaves it out: the range's
            ``"low"`` end (the first choice) or ``"high"`` end, or this value (SGLang's default).
        drawn_digits: Decimals the sampler's value is rounded to in :meth:`~tuner.study.space.Space.suggest`
            (``None``: as drawn; a stepped float is drawn as ``low + k × step``, with float noise).
        neighbour_step: A ``float`` knob's one step either side in :meth:`~tuner.study.space.Space.neighbours`
            (``None``: no float neighbours). A categorical knob's neighbours are its other
            choices, a switch's is the switch flipped; knobs under a switch have none.
        shown_first: Trial tables show it before the other knobs (``tuner.report.tables.KEY_PARAMS``).
    """

    name: str
    kind: Literal["float", "int", "categorical", "bool"]
    help: str
    domain: str | None = None
    step: float | None = None
    log: bool = False
    condition: str | None = None
    replaces: str | None = None
    memory: bool = False
    absent: Literal["low", "high"] | float | bool = "low"
    drawn_digits: int | None = None
    neighbour_step: float | None = None
    shown_first: bool = False

    @property
    def field(self) -> str:
        """The :class:`~tuner.study.space.Space` field holding its range or choices (:attr:`domain`, else :attr:`name`)."""
        return self.domain or self.name

