"""The search space: the SGLang knobs a study may change, declared once, resolved from the baseline.

Every knob the study can change is one :class:`Knob` of :data:`KNOBS` (by SGLang field name, the
shape of SGLang's ``arg_groups/fields/schedule.py``: one declaration per knob). The space's Optuna
distributions, what the sampler is asked for, the grid a candidate is snapped onto, the
hierarchical cache's conditional knobs and the planner's one-step neighbours are derived from that
table and a resolved :class:`Space`, whose fields hold each knob's range or choices. Ranges the
config leaves out are derived from the baseline the unit runs now, its GPU and its SGLang version.
Which candidate to try next is :mod:`tuner.study.decide`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import cache
from types import MappingProxyType
from typing import Any, NamedTuple

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

import tuner.knobs
from tuner.config import SpaceSection
from tuner.knobs.knob import Knob
from tuner.load.workloads import ReuseEstimate
from tuner.sglang.flags import FlagTable
from tuner.sglang.hicache import (
    HOST_MARGIN_MIN_BYTES,
    HOST_MARGIN_SHARE,
    SGLANG_HOST_RESERVE_BYTES,
    HostMemory,
    preferred_size_knob,
)
from tuner.study.lever_space import LeverChoice

__all__ = ["Knob", "KNOBS", "SEARCHED_FIELDS", "SPEC_SHAPE_KNOBS", "HICACHE_KNOBS", "MEMORY_KNOBS", "Space", "HiCacheChoice",
           "decide_hicache", "resolve_space", "default_chunked_prefill_size", "MIN_REUSE_SHARE", "config_key",
           "suggest_param"]


_HICACHE = "enable_hierarchical_cache"
_SPEC = "speculative_algorithm"
SPEC_SHAPE_KNOBS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
"""The draft shape's knobs, searched together under the speculative switch (§1.5)."""

KNOBS: tuple[Knob, ...] = (
    Knob(name="mem_fraction_static", kind="float", memory=True, drawn_digits=6, shown_first=True,
         help="Share of the GPU's memory for the weights and the KV cache pool (0-1); the rest is the reserve "
              "for activations and CUDA graphs (§1.2, §1.6)."),
    Knob(name="max_running_requests", kind="int", log=True, memory=True, absent="high", shown_first=True,
         help="Most requests running at once (requests); left out, SGLang derives it from the KV pool (§2.3)."),
    Knob(name="chunked_prefill_size", kind="categorical", shown_first=True,
         help="Most prompt tokens prefilled in one step (tokens); -1 disables chunked prefill (§2.1)."),
    Knob(name=_HICACHE, kind="bool", domain="hierarchical_cache", absent=False, shown_first=True,
         help="A host-memory tier under the radix cache, for prefixes evicted from the GPU (§7)."),
    Knob(name="hicache_ratio", kind="float", step=0.5, condition=_HICACHE, shown_first=True,
         help="Host pool per rank as a multiple of the device KV pool (ratio; versions that prefer it, §7)."),
    Knob(name="hicache_size", kind="int", condition=_HICACHE, replaces="hicache_ratio", shown_first=True,
         help="Host pool per rank (decimal GB; versions that prefer it, 0.5.23, §7)."),
    Knob(name="hicache_write_policy", kind="categorical", condition=_HICACHE,
         help="When the host tier is written: write_through, write_through_selective or write_back (§7)."),
    Knob(name="hicache_io_backend", kind="categorical", condition=_HICACHE,
         help="How pages move between host and device: kernel or direct (versions that have it, §7)."),
    Knob(name="hicache_mem_layout", kind="categorical", condition=_HICACHE,
         help="The host pool's memory layout: layer_first, page_first, ... (versions that have it, §7)."),
    Knob(name="page_size", kind="categorical",
         help="Tokens per KV cache page (tokens); chunked_prefill_size must be a multiple of it (§2.1)."),
    Knob(name="cuda_graph_max_bs", kind="categorical",
         help="Largest batch captured as a CUDA graph (requests; its reserve grows with it; spelled per "
              "version, §3.2)."),
    Knob(name=_SPEC, kind="bool", domain="speculative", absent=True,
         help="Speculative decoding with the baseline's draft model: on (the baseline's --speculative-algorithm) "
              "or off (every speculative flag removed; §1.5)."),
    Knob(name="speculative_num_steps", kind="categorical", condition=_SPEC,
         help="Draft steps per decode step (steps; SGLang's rules in tuner.sglang.speculative, §1.5)."),
    Knob(name="speculative_eagle_topk", kind="categorical", condition=_SPEC,
         help="Draft branches per step (1 = a chain: SGLang then verifies steps + 1 tokens, §1.5)."),
    Knob(name="speculative_num_draft_tokens", kind="categorical", condition=_SPEC,
         help="Tokens verified per request per step, the root included (tokens; the verify CUDA graphs "
              "grow with it, §1.5, §2.1)."),
    Knob(name="speculative_draft_kv_cache_dtype", kind="categorical", condition=_SPEC,
         help="The draft's KV pool dtype (SGLang 0.5.23): fp8 halves the draft pool, and what the budget "
              "profiled for it beyond that is left free (its help: raise the fraction to turn it into KV; "
              "the target verifies every token, so the answers do not change, §1.5)."),
    Knob(name="schedule_conservativeness", kind="float", step=0.1, absent=1.0, neighbour_step=0.3,
         help="How much KV the scheduler reserves for running requests' future tokens before admitting "
              "more (factor; SGLang's default 1.0; lower admits more and retracts more, §2.4)."),
    *(lever.knob for lever in tuner.knobs.LEVERS),
)
"""Every knob the study can change, in the order the sampler is asked for them: the memory,
scheduling, cache and speculative rows, then each structural lever's row (:data:`tuner.knobs.LEVERS`)."""
_OWN_KNOBS = KNOBS[:len(KNOBS) - len(tuner.knobs.LEVERS)]


@cache
def _tables(levers: tuple[tuner.knobs.Lever, ...]) -> tuple[tuple[Knob, ...], Mapping[str, Knob], Mapping[str, Knob]]:
    """The knob table with ``levers``' rows, by name, and by the knob each replaces."""
    knobs = (*_OWN_KNOBS, *(lever.knob for lever in levers))
    return (knobs, MappingProxyType({knob.name: knob for knob in knobs}),
            MappingProxyType({knob.replaces: knob for knob in knobs if knob.replaces}))


def _table() -> tuple[tuple[Knob, ...], Mapping[str, Knob], Mapping[str, Knob]]:
    """The knob table as :data:`tuner.knobs.LEVERS` holds the levers now (read at call time)."""
    return _tables(tuner.knobs.LEVERS)

SEARCHED_FIELDS = tuple(knob.name for knob in KNOBS)
"""Every knob the study can change, by SGLang field name (:data:`KNOBS`' names)."""
HICACHE_KNOBS = tuple(knob.name for knob in KNOBS if knob.condition == _HICACHE)
"""The hierarchical cache's conditional knobs: set only when ``enable_hierarchical_cache`` is on (§7)."""
MEMORY_KNOBS = tuple(knob.name for knob in KNOBS if knob.memory)
"""The knobs that size the memory pools and the requests in flight (:attr:`Knob.memory`)."""
MIN_REUSE_SHARE = 0.10
"""Below this share of prompt tokens served from an earlier request's prefix, a prefix tier cannot pay."""

def config_key(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A config as a hashable key: its ``(knob, value)`` pairs sorted by knob. Snap it first
    (:meth:`Space.snap`) to compare configs on the space's grid."""
    return tuple(sorted(params.items()))


def suggest_param(trial: optuna.Trial, name: str, dist: BaseDistribution) -> Any:
    """Ask ``trial`` for param ``name`` from ``dist`` (one of the three kinds the space makes).

    Returns:
        The value (an enqueued or fixed one comes back as it was given).

    Raises:
        TypeError: ``dist`` is not a categorical, int or float distribution.
    """
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, list(dist.choices))
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
    raise TypeError(f"param {name}: the space makes categorical, int and float distributions, not {type(dist).__name__}")


def default_chunked_prefill_size(gpu_total_mib: float | None) -> int:
    """SGLang's default ``chunked_prefill_size`` for a GPU size in MiB (§2.1, 0.5.5 ≈ 0.5.10)."""
    if gpu_total_mib is None:
        return 4096
    for limit_mib, size in ((20480, 2048), (35840, 2048), (61440, 4096), (163840, 8192)):
        if gpu_total_mib < limit_mib:
            return size
    return 16384


class _Bound(NamedTuple):
    """A searched :class:`Knob` read against one :class:`Space`: its choices, or its range and step."""

    knob: Knob
    choices: tuple[Any, ...] | None
    low: Any
    high: Any
    step: float | None
    absent: Any

    def snap(self, value: Any) -> Any:
        """``value`` on the grid: clipped to the range and aligned on the step (floats to 6
        decimals), or the nearest choice (the first for a non-number)."""
        kind = self.knob.kind
        if kind == "bool":
            return bool(value)
        if self.choices is not None:
            return value if value in self.choices else _nearest(self.choices, value)
        if kind == "int":
            return min(self.high, max(self.low, int(round(float(value)))))
        assert self.step is not None, self.knob.name  # every float knob has a grid
        low = self.low
        return round(min(self.high, max(low, low + round((float(value) - low) / self.step) * self.step)), 6)


class Space(BaseModel):
    """The resolved search space: each :class:`Knob`'s range or choices (its :attr:`Knob.domain`).

    Stored as JSON in every study (``model_dump(mode="json")``): its fields are that format.

    Attributes:
        mem_fraction_static: ``(low, high, step)``.
        max_running_requests: ``(low, high)``, log scale.
        chunked_prefill_size: Choices (-1 disables chunked prefill).
        hierarchical_cache: Whether ``enable_hierarchical_cache`` is searched.
        hicache_ratio: ``(low, high)`` when the hierarchical cache is on and the version prefers the
            ratio (``None`` when the size is searched instead).
        hicache_size: ``(low, high)`` GB per rank (integers) when the version prefers the size.
        hicache_write_policy: Choices when the hierarchical cache is on.
        hicache_io_backend: Choices, or ``None`` (not searched).
        hicache_mem_layout: Choices, or ``None`` (not searched).
        hicache_reason: Why the hierarchical cache is in the space or out of it (one sentence).
        page_size: Choices, or ``None`` (left as the baseline has it).
        cuda_graph_max_bs: Choices, or ``None``.
        schedule_conservativeness: ``(low, high)``, or ``None``.
        levers: Each searched structural lever's choices (:data:`tuner.knobs.LEVERS`), the baseline's
            first, by knob name (``kv_cache_dtype``, ``dcp_size``, ``dp_size``: 1 = DP attention off);
            a lever not searched has no entry. A study stored before this field held them as
            fields of their own: they are read into it.
        lever_reasons: Per structural lever, whether it is searched and why
            (:func:`tuner.study.lever_space.derive_levers`).
        speculative: Whether speculative decoding is searched (on/off; the baseline runs a draft).
        speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens: Choices, the
            baseline's first (a candidate that leaves one out runs the baseline's), or ``None``.
        speculative_draft_kv_cache_dtype: Choices (the baseline's first: its flag, else its
            ``kv_cache_dtype``, which the draft follows), or ``None`` (the version lacks the flag).
        fixed: Knobs not searched, kept at the baseline's value.
    """

    model_config = ConfigDict(frozen=True)

    mem_fraction_static: tuple[float, float, float]
    max_running_requests: tuple[int, int]
    chunked_prefill_size: tuple[int, ...]
    hierarchical_cache: bool = False
    hicache_ratio: tuple[float, float] | None = (2.0, 4.0)
    hicache_size: tuple[int, int] | None = None
    hicache_write_policy: tuple[str, ...] = ("write_through",)
    hicache_io_backend: tuple[str, ...] | None = None
    hicache_mem_layout: tuple[str, ...] | None = None
    hicache_reason: str = ""
    page_size: tuple[int, ...] | None = None
    cuda_graph_max_bs: tuple[int, ...] | None = None
    schedule_conservativeness: tuple[float, float] | None = None
    levers: dict[str, tuple[Any, ...]] = Field(default_factory=dict)
    lever_reasons: tuple[str, ...] = ()
    speculative: bool = False
    speculative_num_steps: tuple[int, ...] | None = None
    speculative_eagle_topk: tuple[int, ...] | None = None
    speculative_num_draft_tokens: tuple[int, ...] | None = None
    speculative_draft_kv_cache_dtype: tuple[str, ...] | None = None
    fixed: dict[str, Any] = Field(default_factory=dict)
    _knobs: tuple[_Bound, ...] = PrivateAttr(default=())

    @model_validator(mode="before")
    @classmethod
    def _stored_levers(cls, data: Any) -> Any:
        """A stored space of an earlier version: its lever fields (``kv_cache_dtype: [...]``) read into :attr:`levers`."""
        if not isinstance(data, Mapping):
            return data
        names = [lever.knob.name for lever in tuner.knobs.LEVERS if lever.knob.name in data]
        if not names:
            return data
        data = dict(data)
        levers = dict(data.get("levers") or {})
        for name in names:
            choices = data.pop(name)
            if choices:
                levers.setdefault(name, choices)
        data["levers"] = levers
        return data

    def model_post_init(self, context: Any, /) -> None:
        """Read the knob table against the fields once (:meth:`snap` runs for every record a screen
        compares a candidate with)."""
        self._knobs = tuple(self._bind(knob) for knob in _table()[0] if self.searches(knob.name))

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Space:
        """A copy (pydantic's), with the knob table read again against its fields (``update``
        bypasses :meth:`model_post_init`)."""
        copy = super().model_copy(update=update, deep=deep)
        copy.model_post_init(None)
        return copy

    # -- the table, read against this space -------------------------------------------------------

    def searches(self, name: str) -> bool:
        """Whether the space searches knob ``name``: its range or choices are set, its switch is
        searched, and no knob that replaces it is searched; ``False`` for a name not in :data:`KNOBS`."""
        _, by_name, replaced_by = _table()
        knob = by_name.get(name)
        if knob is None or not self._domain(knob):
            return False
        if knob.condition is not None and not self.searches(knob.condition):
            return False
        rival = replaced_by.get(name)
        return rival is None or not self.searches(rival.name)

    def _domain(self, knob: Knob) -> Any:
        """``knob``'s range, choices or switch in this space (a lever's: its :attr:`levers` entry)."""
        return self.levers.get(knob.name) if knob.field == "levers" else getattr(self, knob.field)

    def _bind(self, knob: Knob) -> _Bound:
        """``knob`` with this space's range or choices, and the value a candidate without it gets."""
        domain = self._domain(knob)
        if knob.kind == "bool":
            return _Bound(knob, (False, True), None, None, None, knob.absent)
        if knob.kind == "categorical":
            choices = tuple(domain)
            return _Bound(knob, choices, None, None, None, choices[0] if knob.absent in ("low", "high") else knob.absent)
        low, high = domain[0], domain[1]
        step = domain[2] if len(domain) > 2 else knob.step
        absent = low if knob.absent == "low" else high if knob.absent == "high" else knob.absent
        return _Bound(knob, None, low, high, step, absent)

    def _bound(self, name: str) -> _Bound | None:
        return next((b for b in self._knobs if b.knob.name == name), None)

    # -- what derives from it ---------------------------------------------------------------------

    def distributions(self) -> dict[str, BaseDistribution]:
        """Optuna distributions of every searched knob (conditional ones included), in :data:`KNOBS`' order."""
        dists: dict[str, BaseDistribution] = {}
        for bound in self._knobs:
            knob = bound.knob
            if bound.choices is not None:
                dists[knob.name] = CategoricalDistribution(list(bound.choices))
            elif knob.kind == "int":
                dists[knob.name] = IntDistribution(bound.low, bound.high, log=knob.log)
            else:
                dists[knob.name] = FloatDistribution(bound.low, bound.high, step=bound.step)
        return dists

    def contains(self, name: str, value: Any) -> bool:
        """Whether ``value`` is a point of knob ``name``'s distribution (in range, on its step,
        or one of its choices); ``False`` for a knob the space does not search."""
        dist = self.distributions().get(name)
        if dist is None or value is None:
            return False
        if isinstance(dist, CategoricalDistribution):
            return value in dist.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not isinstance(dist, (IntDistribution, FloatDistribution)):
            return False
        if not dist.low - 1e-9 <= float(value) <= dist.high + 1e-9:
            return False
        if isinstance(dist, IntDistribution):
            return float(value) == int(value) and (int(value) - dist.low) % dist.step == 0
        if dist.step is None:
            return True
        steps = (float(value) - dist.low) / dist.step
        return abs(steps - round(steps)) < 1e-6

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """Ask ``trial`` for every searched knob, in :data:`KNOBS`' order; a knob under a switch
        only when the switch came back on (enqueued values come back as they were enqueued).

        Returns:
            The candidate's params by SGLang field name (searched knobs plus :attr:`fixed`).
        """
        params: dict[str, Any] = dict(self.fixed)
        for name, dist in self.distributions().items():
            knob = _table()[1][name]
            if knob.condition is not None and not params.get(knob.condition):
                continue
            value = suggest_param(trial, name, dist)
            if knob.kind == "bool":
                value = bool(value)
            elif knob.drawn_digits is not None:
                value = round(value, knob.drawn_digits)
            params[name] = value
        return params

    def snap(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Clip and align a proposed candidate onto the space (for enqueueing).

        Each searched knob is clipped to its range and aligned on its step (floats to 6
        decimals), or moved to its nearest choice (the first for non-numbers); a knob the
        candidate leaves out gets :attr:`Knob.absent`. Only searched knobs are returned (Optuna's
        enqueued params), in :data:`KNOBS`' order; knobs under a switch that is off are dropped.
        """
        out: dict[str, Any] = {}
        for bound in self._knobs:
            name, condition = bound.knob.name, bound.knob.condition
            if condition is not None and not out.get(condition):
                continue
            out[name] = bound.snap(params.get(name, bound.absent))
        return out

    def hicache_on(self) -> dict[str, Any]:
        """The knobs that turn the hierarchical cache on at the low end of its ranges (the planner's
        neighbour step); empty when the space does not search it."""
        return self._switched_on(_HICACHE)

    def _switched_on(self, switch: str) -> dict[str, Any]:
        """``switch`` on, with the knobs under it at their :attr:`Knob.absent` (empty: not searched)."""
        if not self.searches(switch):
            return {}
        snapped = self.snap({switch: True})
        return {k: v for k, v in snapped.items() if k == switch or _table()[1][k].condition == switch}

    def neighbours(self, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The configs one step from ``params`` in the knobs that are not memory knobs, for the planner.

        In :data:`KNOBS`' order: each other choice of a categorical knob; a switch flipped (on at the
        low end of the knobs under it, :meth:`hicache_on`; off without them); a float knob
        :attr:`Knob.neighbour_step` either side of its value (:attr:`Knob.absent` when unset) where
        that stays in range. Each is snapped onto the space, the memory knobs
        (:data:`MEMORY_KNOBS`) are left out, and a config reached twice is listed once.

        Args:
            params: A config by SGLang field name (memory knobs and knobs outside the space are ignored).

        Returns:
            The neighbouring configs (searched non-memory knobs only, in :data:`KNOBS`' order), in a
            stable order.
        """
        base = {k: v for k, v in params.items() if k not in MEMORY_KNOBS}
        steps: list[dict[str, Any]] = []
        for bound in self._knobs:
            knob = bound.knob
            if knob.memory or knob.condition is not None:
                continue
            if knob.kind == "bool":
                steps.append({**base, knob.name: False} if base.get(knob.name) else {**base, **self._switched_on(knob.name)})
            elif bound.choices is not None:
                steps += [{**base, knob.name: c} for c in bound.choices if c != base.get(knob.name)]
            elif knob.neighbour_step is not None:
                current = float(base.get(knob.name, bound.absent))
                for value in (current - knob.neighbour_step, current + knob.neighbour_step):
                    if bound.low <= value <= bound.high:
                        steps.append({**base, knob.name: round(value, 6)})
        seen: dict[tuple[tuple[str, Any], ...], dict[str, Any]] = {}
        for step in steps:
            config = {k: v for k, v in self.snap(step).items() if k not in MEMORY_KNOBS}
            seen.setdefault(config_key(config), config)
        return list(seen.values())

    def grid(self, name: str) -> list[Any]:
        """Every value of knob ``name`` the space searches, ascending: its choices as given, an int
        range's integers, a float range's steps (to 6 decimals) up to its high end; empty for a
        knob it does not search."""
        bound = self._bound(name)
        if bound is None:
            return []
        if bound.choices is not None:
            return list(bound.choices)
        if bound.knob.kind == "int":
            return list(range(int(bound.low), int(bound.high) + 1))
        assert bound.step is not None, name  # every float knob has a grid
        count = int(math.floor((bound.high - bound.low) / bound.step + 1e-9)) + 1
        return [round(bound.low + i * bound.step, 6) for i in range(count)]

    def fractions(self) -> list[float]:
        """Every ``mem_fraction_static`` on the grid, ascending."""
        return self.grid("mem_fraction_static")


def _nearest(choices: Sequence[Any], value: Any) -> Any:
    try:
        return min(choices, key=lambda c: abs(float(c) - float(value)))
    except (TypeError, ValueError):
        return choices[0]


def _align_down(value: float, low: float, step: float) -> float:
    return round(low + math.floor((value - low) / step + 1e-9) * step, 6)


class HiCacheChoice(BaseModel):
    """Whether the hierarchical cache's knobs enter the space, why, and their ranges (§7).

    Attributes:
        include: Whether ``enable_hierarchical_cache`` is searched.
        reason: One sentence for the dry run and the study's record.
        ratio: ``hicache_ratio`` range, or None when the size is searched.
        size: ``hicache_size`` range (GB per rank), or None.
        write_policy, io_backend, mem_layout: Choices (``io_backend`` / ``mem_layout`` None where
            the version lacks the flag).
    """

    model_config = ConfigDict(frozen=True)

    include: bool
    reason: str
    ratio: tuple[float, float] | None = (2.0, 4.0)
    size: tuple[int, int] | None = None
    write_policy: tuple[str, ...] = ("write_through",)
    io_backend: tuple[str, ...] | None = None
    mem_layout: tuple[str, ...] | None = None


def _pays(reuse: ReuseEstimate | None, device_tokens: int | None) -> tuple[bool, str]:
    if reuse is None:
        return False, "the workload's prefix reuse is unknown"
    share = f"{reuse.reuse_share:.0%}"
    if reuse.reuse_share < MIN_REUSE_SHARE:
        return False, (f"the workload reuses {share} of its prompt tokens (below {MIN_REUSE_SHARE:.0%}; "
                       f"{reuse.describe()}): a host prefix tier would have nothing to serve, and it costs "
                       "host RAM and PCIe bandwidth (§7)")
    if device_tokens and reuse.working_set_tokens <= device_tokens // 2:
        return False, (f"the workload reuses {share} of its prompt tokens, but its reused prefixes "
                       f"({reuse.working_set_tokens:,} tokens) fit in half the device pool ({device_tokens:,} "
                       "tokens): the radix cache alone keeps them, a host tier adds no hit (§7)")
    pool = f" exceed half the device pool ({device_tokens:,} tokens)" if device_tokens else " may not stay on the GPU"
    return True, (f"the workload reuses {share} of its prompt tokens and its reused prefixes "
                  f"({reuse.working_set_tokens:,} tokens){pool}: prefixes evicted from the GPU can come back "
                  "from host memory instead of being prefilled again (§7)")


def decide_hicache(
    section: SpaceSection,
    *,
    reuse: ReuseEstimate | None,
    device_tokens: int | None = None,
    version: str | None = None,
    table: FlagTable | None = None,
    host: HostMemory | None = None,
    ranks: int = 1,
) -> HiCacheChoice:
    """Decide whether the hierarchical cache's knobs enter the space, and their ranges (§7).

    In by default when the workload's reuse can pay (at least :data:`MIN_REUSE_SHARE` of prompt
    tokens reused, and a reused working set larger than half the device pool, which running
    requests share); ``[space] hierarchical_cache = true / false`` overrides. Knobs by version from
    its flag table: ``hicache_ratio`` or ``hicache_size`` (:func:`~tuner.sglang.hicache.preferred_size_knob`;
    the size range needs the host's RAM, else the ratio is searched), the write policies, and the
    I/O backend and memory layout where the version has them.

    Args:
        section: ``[space]``.
        reuse: The workload's :func:`~tuner.load.workloads.estimate_reuse`, or None.
        device_tokens: The device pool at the baseline (``max_total_num_tokens``), if known.
        version: The SGLang version.
        table: Its flag table (choices); None = the defaults of 0.5.5.
        host: The host's memory (for the size range), if known.
        ranks: Ranks on the host (``tp × pp``).

    Returns:
        The :class:`HiCacheChoice`.
    """
    if section.hierarchical_cache is None:
        include, reason = _pays(reuse, device_tokens)
        reason = ("in the space: " if include else "left out: ") + reason
    else:
        include = section.hierarchical_cache
        reason = f"{'in the space' if include else 'left out'}: [space] hierarchical_cache = {str(include).lower()}"

    def choices(field: str, wanted: Sequence[str] | None, default: Sequence[str]) -> tuple[str, ...] | None:
        if table is not None and not table.has(field):
            return None
        have = list(table.option(field).choices or default) if table is not None else list(default)
        picked = [c for c in (wanted or default) if c in have]
        return tuple(dict.fromkeys(picked)) or None

    policies = choices("hicache_write_policy", section.hicache_write_policy,
                       ("write_through", "write_through_selective", "write_back")) or ("write_through",)
    io = choices("hicache_io_backend", section.hicache_io_backend, ("kernel", "direct"))
    layout_default = "layer_first"
    if table is not None and table.has("hicache_mem_layout"):
        layout_default = str(table.option("hicache_mem_layout").default or "layer_first")
    layouts = choices("hicache_mem_layout", section.hicache_mem_layout, (layout_default, "page_first"))
    if table is None and section.hicache_io_backend is None:
        io = None
    if table is None and section.hicache_mem_layout is None:
        layouts = None
    size: tuple[int, int] | None = None
    ratio: tuple[float, float] | None = section.hicache_ratio or (2.0, 4.0)
    wants_size = section.hicache_size is not None or (
        section.hicache_ratio is None and version is not None and preferred_size_knob(version) == "hicache_size")
    if wants_size:
        if section.hicache_size is not None:
            size = (max(1, int(section.hicache_size[0])), max(1, int(section.hicache_size[1])))
        elif host is not None and host.mem_total_bytes:
            room = host.mem_available_bytes + host.pinned_now_bytes - SGLANG_HOST_RESERVE_BYTES
            room -= max(HOST_MARGIN_MIN_BYTES, int(HOST_MARGIN_SHARE * host.mem_total_bytes))
            if host.cgroup_max_bytes is not None:
                room = min(room, host.cgroup_max_bytes - max(HOST_MARGIN_MIN_BYTES,
                                                             int(HOST_MARGIN_SHARE * host.cgroup_max_bytes)))
            top = int(room / max(1, ranks) / 1e9)
            if top >= 1:
                size = (max(1, top // 4), top)
        if size is not None:
            ratio = None
    return HiCacheChoice(include=include, reason=reason, ratio=ratio, size=size, write_policy=policies,
                         io_backend=io, mem_layout=layouts)


def resolve_space(
    section: SpaceSection,
    baseline: Mapping[str, Any],
    *,
    gpu_total_mib: float | None = None,
    capacity_hint: int | None = None,
    slots_hint: int | None = None,
    hicache: HiCacheChoice | None = None,
    levers: LeverChoice | None = None,
    draft_kv_dtype: bool = False,
) -> Space:
    """Turn ``[space]`` into a :class:`Space`, deriving what it leaves out.

    Defaults, each widened so the baseline's own value is inside (the baseline is trial 0):

    * ``mem_fraction_static``: from 0.05 below the baseline to 0.97.
    * ``max_running_requests``: from 1 (a latency SLO may bind at any count of requests in
      flight; the scale is logarithmic) to the larger of the baseline's and 1.5 ×
      ``capacity_hint`` (the capacity predicted at the highest fraction), but no more than
      ``slots_hint`` (the most slots that can change a result,
      :func:`tuner.study.budget.reachable_slots` at the highest fraction) and at least the
      capacity hint; the baseline's own value widens the range only up to ``slots_hint``.
    * ``chunked_prefill_size``: half, once and twice the baseline's (or the GPU default of §2.1).

    Args:
        section: The ``[space]`` table.
        baseline: The baseline's resolved knobs by SGLang field name (``mem_fraction_static``,
            ``max_running_requests`` (effective), ``chunked_prefill_size``, ...).
        gpu_total_mib: GPU size (nvidia-smi MiB) for the chunked-prefill default.
        capacity_hint: The context capacity predicted at the top of the fraction range.
        slots_hint: The reachable request slots at the top of the fraction range.
        hicache: The hierarchical cache's decision (:func:`decide_hicache`); None = decided from
            ``[space] hierarchical_cache`` alone (unset = out, no reuse estimate).
        levers: The structural levers' decision (:func:`tuner.study.lever_space.derive_levers`);
            None = only the levers ``[space]`` lists.
        draft_kv_dtype: The version has ``--speculative-draft-kv-cache-dtype`` (0.5.23).

    Returns:
        The space.
    """
    step = section.mem_fraction_step
    base_mfs = float(baseline.get("mem_fraction_static") or 0.88)
    low, high = section.mem_fraction_static or (max(0.05, base_mfs - 0.05), max(0.97, base_mfs))
    low = min(low, base_mfs)
    high = max(high, base_mfs)
    # Align the grid on the baseline so its value is a grid point.
    low = round(base_mfs - math.floor((base_mfs - low) / step + 1e-9) * step, 6)
    high = _align_down(high, low, step)

    base_mrr = int(baseline.get("max_running_requests") or 0) or None
    if section.max_running_requests:
        mrr_low, mrr_high = section.max_running_requests
    else:
        reference = base_mrr or capacity_hint or 64
        mrr_low = 1
        mrr_high = max(reference, int(1.5 * (capacity_hint or reference)), 8)
        if slots_hint:
            mrr_high = max(min(mrr_high, slots_hint), capacity_hint or 1, 2)
    if base_mrr:
        mrr_low = min(mrr_low, base_mrr)
        if not slots_hint or section.max_running_requests or base_mrr <= mrr_high:
            mrr_high = max(mrr_high, base_mrr)

    base_cps = baseline.get("chunked_prefill_size")
    if base_cps is None:
        base_cps = default_chunked_prefill_size(gpu_total_mib)
    base_cps = int(base_cps)
    if section.chunked_prefill_size:
        cps = list(dict.fromkeys(section.chunked_prefill_size))
    elif base_cps <= 0:
        cps = [-1, 4096, 8192]
    else:
        cps = [max(512, base_cps // 2), base_cps, base_cps * 2]
    if base_cps not in cps:
        cps.append(base_cps)

    page_size = _with_baseline(section.page_size, baseline.get("page_size"))
    graph_bs = _with_baseline(section.cuda_graph_max_bs, baseline.get("cuda_graph_max_bs"))
    conservativeness = section.schedule_conservativeness
    if conservativeness:
        base_c = float(baseline.get("schedule_conservativeness") or 1.0)
        conservativeness = (min(conservativeness[0], base_c), max(conservativeness[1], base_c))
    if hicache is None:
        hicache = decide_hicache(section, reuse=None)
    spec = _speculative_space(section, baseline, draft_kv_dtype=draft_kv_dtype)
    fixed = {}
    if not hicache.include and baseline.get("enable_hierarchical_cache"):
        fixed["enable_hierarchical_cache"] = True
    return Space(
        mem_fraction_static=(low, high, step),
        max_running_requests=(int(mrr_low), int(mrr_high)),
        chunked_prefill_size=tuple(sorted(dict.fromkeys(cps))),
        hierarchical_cache=hicache.include,
        hicache_ratio=hicache.ratio,
        hicache_size=hicache.size,
        hicache_write_policy=hicache.write_policy,
        hicache_io_backend=hicache.io_backend,
        hicache_mem_layout=hicache.mem_layout,
        hicache_reason=hicache.reason,
        page_size=page_size,
        cuda_graph_max_bs=graph_bs,
        schedule_conservativeness=conservativeness,
        levers=dict(levers.choices) if levers else _listed_levers(section, baseline),
        lever_reasons=levers.reasons if levers else (),
        **spec,
        fixed=fixed,
    )


def _listed_levers(section: SpaceSection, baseline: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """The structural levers ``[space]`` lists, each with the baseline's value first (where a
    candidate that leaves the knob out lands); a lever ``[space]`` does not name, or pins (the
    baseline's value alone), is left out."""
    out = {}
    for lever in tuner.knobs.LEVERS:
        name = lever.knob.name
        value = baseline.get(name)
        choices = tuple(dict.fromkeys([lever.neutral if value is None else value, *(getattr(section, name, None) or ())]))
        if len(choices) > 1:
            out[name] = choices
    return out


def _speculative_space(section: SpaceSection, baseline: Mapping[str, Any], *, draft_kv_dtype: bool = False
                       ) -> dict[str, Any]:
    """The speculative knobs' domains (§1.5): searched only when the baseline runs a draft model
    (its ``speculative_algorithm`` and resolved shape in ``baseline``) and ``[space] speculative``
    is not false. Choices list the baseline's value first (a candidate without the knob runs it):
    steps 1-5, topk 1 and the baseline's, draft tokens the baseline's and, with a topk above 1, 4, 6
    and 8; the draft's KV dtype (where the version has its flag) the baseline's and ``fp8_e4m3``;
    ``[space]`` lists replace the defaults. Invalid combinations are screened, not launched
    (:class:`tuner.study.decide.speculative.SpeculativeRules`)."""
    base = [baseline.get(name) for name in SPEC_SHAPE_KNOBS]
    if not baseline.get(_SPEC) or section.speculative is False or any(v is None for v in base):
        return {}
    steps, topk, draft = (int(v) for v in base)  # type: ignore[arg-type]

    def first(value: int, choices: Sequence[int] | None, default: Sequence[int]) -> tuple[int, ...]:
        rest = sorted(set(choices or default) - {value})
        return (value, *rest)

    topks = first(topk, section.speculative_eagle_topk, (1,))
    drafts = first(draft, section.speculative_num_draft_tokens, (4, 6, 8) if max(topks) > 1 else ())
    out: dict[str, Any] = {
        "speculative": True, "speculative_num_steps": first(steps, section.speculative_num_steps, (1, 2, 3, 4, 5)),
        "speculative_eagle_topk": topks, "speculative_num_draft_tokens": drafts}
    if draft_kv_dtype:
        # Unset, the draft follows --kv-cache-dtype (0.5.23 kv_cache_dtype.py): that is the baseline's value.
        own = str(baseline.get("speculative_draft_kv_cache_dtype") or baseline.get("kv_cache_dtype") or "auto")
        out["speculative_draft_kv_cache_dtype"] = tuple(dict.fromkeys(
            [own, *(section.speculative_draft_kv_cache_dtype or ("fp8_e4m3",))]))
    return out


def _with_baseline(choices: Sequence[int] | None, value: Any) -> tuple[int, ...] | None:
    if not choices:
        return None
    out = list(dict.fromkeys(choices))
    if value is not None and int(value) not in out:
        out.append(int(value))
    return tuple(sorted(out))
