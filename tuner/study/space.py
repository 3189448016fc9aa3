"""The search space: the SGLang knobs a study may change, resolved from the baseline.

The space is the set of SGLang knobs the study may change (by SGLang field name). Ranges the config
leaves out are derived from the baseline the unit runs now, its GPU and its SGLang version.
Which candidate to try next is :mod:`tuner.study.planner`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from pydantic import BaseModel, ConfigDict, Field

from tuner.config import SpaceSection
from tuner.load.workloads import ReuseEstimate
from tuner.sglang.flags import FlagTable
from tuner.sglang.hicache import (
    HOST_MARGIN_MIN_BYTES,
    HOST_MARGIN_SHARE,
    SGLANG_HOST_RESERVE_BYTES,
    HostMemory,
    preferred_size_knob,
)

__all__ = ["SEARCHED_FIELDS", "HICACHE_KNOBS", "Space", "HiCacheChoice", "decide_hicache", "resolve_space",
           "default_chunked_prefill_size", "MIN_REUSE_SHARE", "config_key"]

SEARCHED_FIELDS = (
    "mem_fraction_static",
    "max_running_requests",
    "chunked_prefill_size",
    "enable_hierarchical_cache",
    "hicache_ratio",
    "hicache_size",
    "hicache_write_policy",
    "hicache_io_backend",
    "hicache_mem_layout",
    "page_size",
    "cuda_graph_max_bs",
    "schedule_conservativeness",
)
"""Every knob the study can change, by SGLang field name."""
HICACHE_KNOBS = ("hicache_ratio", "hicache_size", "hicache_write_policy", "hicache_io_backend", "hicache_mem_layout")
"""The hierarchical cache's conditional knobs: set only when ``enable_hierarchical_cache`` is on (§7)."""
MIN_REUSE_SHARE = 0.10
"""Below this share of prompt tokens served from an earlier request's prefix, a prefix tier cannot pay."""

def config_key(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A config as a hashable key: its ``(knob, value)`` pairs sorted by knob. Snap it first
    (:meth:`Space.snap`) to compare configs on the space's grid."""
    return tuple(sorted(params.items()))


def default_chunked_prefill_size(gpu_total_mib: float | None) -> int:
    """SGLang's default ``chunked_prefill_size`` for a GPU size in MiB (§2.1, 0.5.5 ≈ 0.5.10)."""
    if gpu_total_mib is None:
        return 4096
    for limit_mib, size in ((20480, 2048), (35840, 2048), (61440, 4096), (163840, 8192)):
        if gpu_total_mib < limit_mib:
            return size
    return 16384


class Space(BaseModel):
    """The resolved search space.

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
    fixed: dict[str, Any] = Field(default_factory=dict)

    def distributions(self) -> dict[str, BaseDistribution]:
        """Optuna distributions of every searched knob (conditional ones included)."""
        low, high, step = self.mem_fraction_static
        dists: dict[str, BaseDistribution] = {
            "mem_fraction_static": FloatDistribution(low, high, step=step),
            "max_running_requests": IntDistribution(*self.max_running_requests, log=True),
            "chunked_prefill_size": CategoricalDistribution(list(self.chunked_prefill_size)),
        }
        if self.hierarchical_cache:
            dists["enable_hierarchical_cache"] = CategoricalDistribution([False, True])
            if self.hicache_size is not None:
                dists["hicache_size"] = IntDistribution(*self.hicache_size)
            elif self.hicache_ratio is not None:
                dists["hicache_ratio"] = FloatDistribution(*self.hicache_ratio, step=0.5)
            dists["hicache_write_policy"] = CategoricalDistribution(list(self.hicache_write_policy))
            if self.hicache_io_backend:
                dists["hicache_io_backend"] = CategoricalDistribution(list(self.hicache_io_backend))
            if self.hicache_mem_layout:
                dists["hicache_mem_layout"] = CategoricalDistribution(list(self.hicache_mem_layout))
        if self.page_size:
            dists["page_size"] = CategoricalDistribution(list(self.page_size))
        if self.cuda_graph_max_bs:
            dists["cuda_graph_max_bs"] = CategoricalDistribution(list(self.cuda_graph_max_bs))
        if self.schedule_conservativeness:
            dists["schedule_conservativeness"] = FloatDistribution(
                *self.schedule_conservativeness, step=0.1
            )
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
        """Ask ``trial`` for every knob (enqueued values come back as they were enqueued).

        Returns:
            The candidate's params by SGLang field name (searched knobs plus :attr:`fixed`).
        """
        low, high, step = self.mem_fraction_static
        params: dict[str, Any] = dict(self.fixed)
        params["mem_fraction_static"] = trial.suggest_float("mem_fraction_static", low, high, step=step)
        params["max_running_requests"] = trial.suggest_int("max_running_requests", *self.max_running_requests, log=True)
        params["chunked_prefill_size"] = trial.suggest_categorical("chunked_prefill_size", list(self.chunked_prefill_size))
        if self.hierarchical_cache:
            on = bool(trial.suggest_categorical("enable_hierarchical_cache", [False, True]))
            params["enable_hierarchical_cache"] = on
            if on:  # conditional knobs (§7)
                if self.hicache_size is not None:
                    params["hicache_size"] = trial.suggest_int("hicache_size", *self.hicache_size)
                elif self.hicache_ratio is not None:
                    params["hicache_ratio"] = trial.suggest_float("hicache_ratio", *self.hicache_ratio, step=0.5)
                params["hicache_write_policy"] = trial.suggest_categorical(
                    "hicache_write_policy", list(self.hicache_write_policy)
                )
                for name in ("hicache_io_backend", "hicache_mem_layout"):
                    choices = getattr(self, name)
                    if choices:
                        params[name] = trial.suggest_categorical(name, list(choices))
        if self.page_size:
            params["page_size"] = trial.suggest_categorical("page_size", list(self.page_size))
        if self.cuda_graph_max_bs:
            params["cuda_graph_max_bs"] = trial.suggest_categorical("cuda_graph_max_bs", list(self.cuda_graph_max_bs))
        if self.schedule_conservativeness:
            params["schedule_conservativeness"] = trial.suggest_float(
                "schedule_conservativeness", *self.schedule_conservativeness, step=0.1
            )
        params["mem_fraction_static"] = round(params["mem_fraction_static"], 6)
        return params

    def snap(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Clip and align a proposed candidate onto the space (for enqueueing).

        Only searched knobs are returned (Optuna's enqueued params); conditional knobs of a
        disabled hierarchical cache are dropped.
        """
        low, high, step = self.mem_fraction_static
        mfs = float(params.get("mem_fraction_static", low))
        mfs = min(high, max(low, low + round((mfs - low) / step) * step))
        out: dict[str, Any] = {"mem_fraction_static": round(mfs, 6)}
        mrr = int(params.get("max_running_requests", self.max_running_requests[1]))
        out["max_running_requests"] = min(self.max_running_requests[1], max(self.max_running_requests[0], mrr))
        cps = params.get("chunked_prefill_size", self.chunked_prefill_size[0])
        out["chunked_prefill_size"] = cps if cps in self.chunked_prefill_size else _nearest(self.chunked_prefill_size, cps)
        if self.hierarchical_cache:
            on = bool(params.get("enable_hierarchical_cache", False))
            out["enable_hierarchical_cache"] = on
            if on:
                if self.hicache_size is not None:
                    lo_s, hi_s = self.hicache_size
                    out["hicache_size"] = min(hi_s, max(lo_s, int(round(float(params.get("hicache_size", lo_s))))))
                elif self.hicache_ratio is not None:
                    ratio = float(params.get("hicache_ratio", self.hicache_ratio[0]))
                    lo, hi = self.hicache_ratio
                    out["hicache_ratio"] = min(hi, max(lo, lo + round((ratio - lo) / 0.5) * 0.5))
                for name in ("hicache_write_policy", "hicache_io_backend", "hicache_mem_layout"):
                    choices = getattr(self, name)
                    if choices:
                        value = params.get(name, choices[0])
                        out[name] = value if value in choices else choices[0]
        for name in ("page_size", "cuda_graph_max_bs"):
            choices = getattr(self, name)
            if choices:
                value = params.get(name, choices[0])
                out[name] = value if value in choices else _nearest(choices, value)
        if self.schedule_conservativeness:
            lo, hi = self.schedule_conservativeness
            value = float(params.get("schedule_conservativeness", 1.0))
            out["schedule_conservativeness"] = round(min(hi, max(lo, lo + round((value - lo) / 0.1) * 0.1)), 6)
        return out

    def hicache_on(self) -> dict[str, Any]:
        """The knobs that turn the hierarchical cache on at the low end of its ranges (the planner's
        neighbour step); empty when the space does not search it."""
        if not self.hierarchical_cache:
            return {}
        out: dict[str, Any] = {"enable_hierarchical_cache": True}
        if self.hicache_size is not None:
            out["hicache_size"] = self.hicache_size[0]
        elif self.hicache_ratio is not None:
            out["hicache_ratio"] = self.hicache_ratio[0]
        out["hicache_write_policy"] = self.hicache_write_policy[0]
        for name in ("hicache_io_backend", "hicache_mem_layout"):
            choices = getattr(self, name)
            if choices:
                out[name] = choices[0]
        return out

    def fractions(self) -> list[float]:
        """Every ``mem_fraction_static`` on the grid, ascending."""
        low, high, step = self.mem_fraction_static
        count = int(round((high - low) / step)) + 1
        return [round(low + i * step, 6) for i in range(count)]


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
        fixed=fixed,
    )


def _with_baseline(choices: Sequence[int] | None, value: Any) -> tuple[int, ...] | None:
    if not choices:
        return None
    out = list(dict.fromkeys(choices))
    if value is not None and int(value) not in out:
        out.append(int(value))
    return tuple(sorted(out))
