"""Where the latency SLO breaks, learned from the measured windows: the planner's SLO constraint.

Every measured window records the load the server ran (``TrialRecord.measured_load``:
``running_requests`` admitted of the closed loop's streams, ``chunk_tokens`` per prefill chunk) and
its ``slo`` constraint (``measured / limit − 1`` of the worst limit, at least the error rate). Per
*family* (every knob but ``mem_fraction_static`` and ``max_running_requests``, so one chunked
prefill size), the windows bracket the largest running-request count that meets the SLO:

* ``safe``: the most running requests of a window that met the SLO;
* ``broken``: the fewest running requests of a window that broke it (with the server healthy:
  no crash, no failed stress phase; those are memory facts, not latency facts).

**The monotone rule** (used like the memory rules, to skip without a restart): at equal other
knobs, a closed loop with more running requests has at least the latency percentiles of one with
fewer. TTFT queues behind more prefills and every decode step carries a larger batch (ITL, TPOT);
the server is work-conserving, so nothing gets faster with more work in flight. It holds for the
knobs of one family only. It does **not** hold

* across chunked prefill sizes: a larger chunk lengthens the steps it joins (ITL) but finishes a
  prompt in fewer steps (TTFT), so either can go either way;
* across ``mem_fraction_static`` when the pool, not ``max_running_requests``, limits the running
  requests (retractions, §4.4): then the measured ``running_requests`` overstates the load and the
  rule is not applied to a config whose pool holds fewer requests than its slots;
* within the measurement noise: a window close to the limit may land on either side (the planner
  aims inside the boundary by :data:`AIM_MARGIN`), and one window's p99 ITL flips between the
  decode-only steps and those a prefill chunk joins by a handful of steps, so adjacent counts can
  break and hold in turn; a break that a window of the bracket contradicts by meeting the SLO at
  as many requests or more proves nothing (:meth:`SLOBound.proves`), and neither does an ITL
  break at the bracket's edge by no more than its slow decode steps' sampling noise (:attr:`SLOPoint.itl_exceedance_low`).
* across CUDA-graph coverage: a window that decoded some batches eagerly is slower than one whose
  graphs cover them (§2.1). The study keys its brackets without ``cuda_graph_max_bs``
  (:func:`tuner.study.calibration.bracket_key`) and tells the windows apart by
  :attr:`SLOPoint.graphed`; the proofs compare coverages
  (:meth:`tuner.study.calibration.Calibration.slo_proof`).

Between ``safe`` and ``broken`` the next count to try comes from the measured latencies: the
latency ratio ``slo + 1`` is interpolated linearly in running requests (a closed loop's queueing
latency grows about linearly with requests in flight) and solved for ``1 − AIM_MARGIN`` (for the
limit itself once a safe window is within that margin; for an ITL break, the share of slow token
gaps instead, :func:`_exceedance_count`); when the
fit says nothing useful (fewer than two points, a flat or falling slope, an estimate outside the
bracket) the step is a bisection (geometric without a safe point, since latencies fall at least to
one running request's). Once two safe windows show the curve bending up toward the broken one
(latency near the boundary rises far slower than the line to the break says), a line from the safe
side would land short every time; the step is a bisection there too (``SLOBound._convex``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from tuner.records import TrialRecord
from tuner.study.space import MEMORY_KNOBS

__all__ = ["AIM_MARGIN", "SLOPoint", "SLOBound", "slo_points", "slo_bounds", "family_of", "limited_by"]

AIM_MARGIN = 0.05
"""Relative latency margin the planner aims inside the SLO (so a noisy window still meets it)."""

def family_of(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Every knob but ``mem_fraction_static`` and ``max_running_requests``, as a sorted key."""
    return tuple(sorted((k, v) for k, v in params.items() if k not in MEMORY_KNOBS))


class SLOPoint(BaseModel):
    """One measured window as the SLO model sees it.

    Attributes:
        number: The trial.
        family: :func:`family_of` its params.
        running_requests: Requests the server ran at once (closed loop, capped by its slots).
        slo: The ``slo`` constraint (≤ 0: met).
        token_capacity: The window's KV pool (``max_total_num_tokens``, tokens; ``None``: unknown).
        graphed: The decode batches of ``1..running_requests`` that replayed a CUDA graph, as one
            number (``running_requests`` itself: all of them; else the largest captured size below
            the first eager batch, §2.1); ``None``: unknown.
        limited_by: The latency limit the window came nearest to (or broke most): ``"ttft"`` or
            ``"itl"`` (the largest ``measured / limit`` of its p99s against the SLO's limits,
            :attr:`tuner.records.SloCapacity.limits`); ``None``: not known.
        itl_exceedance: The window's share of token gaps above the ITL limit over the share its
            percentile allows (:attr:`tuner.records.TrialRecord.itl_exceedance`; ≤ 1 holds);
            ``None``: not measured.
        itl_exceedance_low: Its 95 % lower bound over the window's decode steps
            (:func:`tuner.load.metrics.itl_exceedance_low`); ``None``: not measured.
    """

    model_config = ConfigDict(frozen=True)

    number: int
    family: tuple[tuple[str, Any], ...]
    running_requests: float
    slo: float
    token_capacity: int | None = None
    graphed: int | None = None
    limited_by: str | None = None
    itl_exceedance: float | None = None
    itl_exceedance_low: float | None = None

    def same_graphs(self, other: SLOPoint) -> bool:
        """Whether the two windows decoded on the same graph coverage of their batches: both on a
        graph for every batch, or both eager above the same captured size (then one latency curve
        joins them; across a captured size it does not, :mod:`tuner.sglang.graphs`). Unknown
        coverage on both sides counts as the same (the rule before graphs were known)."""
        if self.graphed is None or other.graphed is None:
            return self.graphed is None and other.graphed is None
        mine_full, theirs_full = self.graphed >= self.running_requests, other.graphed >= other.running_requests
        return (mine_full and theirs_full) or (not mine_full and not theirs_full and self.graphed == other.graphed)


class SLOBound(BaseModel):
    """What one family's windows say about the SLO.

    Attributes:
        safe: Most running requests of a window that met the SLO (0: none yet).
        safe_trial: That window's trial.
        broken: Fewest running requests of a window that broke it (``None``: none broke it).
        broken_trial: That window's trial.
        points: The family's windows, by running requests.
    """

    model_config = ConfigDict(frozen=True)

    safe: float = 0.0
    safe_trial: int | None = None
    broken: float | None = None
    broken_trial: int | None = None
    points: tuple[SLOPoint, ...] = ()

    @property
    def binds(self) -> bool:
        """Whether the SLO broke in this family at some load."""
        return self.broken is not None

    @property
    def converged(self) -> bool:
        """Whether the bracket is down to adjacent counts (or a safe point at 1 request)."""
        return self.broken is not None and self.broken - self.safe <= max(1.0, 0.02 * self.broken)

    def proves(self, point: SLOPoint, running: float | None = None) -> bool:
        """Whether ``point`` (one of :attr:`points`) is a break the monotone rule may prove from
        for a config running ``running`` requests at once (``None``: at the break's own load): it
        broke the SLO and no window of the bracket met it running at least as many requests.
        Such a pair cannot both be true of one curve: the p99 near the limit is noise there (a
        window's p99 ITL lands in the prefill-joined steps or not by a handful of steps, so adjacent
        counts flip), and a skip needs a launch instead.

        The bracket's lowest break, if it is an ITL break by no more than its slow decode steps'
        sampling noise (:attr:`SLOPoint.itl_exceedance_low` ≤ 1), proves only loads where that
        lower bound, grown in proportion to the requests in flight, passes the limit's allowance:
        the share of slow gaps grows at least as the prefills' rate does (each request in flight
        adds one prompt per its output length; steps several prompts join grow faster). A break
        above another break is confirmed by it (two windows that broke in a row are not both
        noise by chance) and proves as before."""
        if point.slo <= 0 or any(p.slo <= 0 and p.running_requests >= point.running_requests for p in self.points):
            return False
        low = point.itl_exceedance_low
        lowest = not any(p.slo > 0 and p.running_requests < point.running_requests for p in self.points)
        if point.limited_by == "itl" and low is not None and low <= 1.0 and lowest:
            return running is not None and running * low > point.running_requests
        return True

    def violates(self, running_requests: float) -> bool:
        """The monotone rule: at least as many running requests as a window that broke the SLO."""
        return self.broken is not None and running_requests >= self.broken

    def next_count(self) -> int | None:
        """The running-request count to measure next inside the bracket, or ``None`` (converged
        or not binding)."""
        if self.broken is None or self.converged:
            return None
        lo, hi = self.safe, self.broken
        estimate = None if self._convex() else self._interpolate()
        if estimate is None or not lo < estimate < hi:
            estimate = (lo + hi) / 2 if lo > 0 else hi / 4
        count = int(math.floor(estimate))
        count = max(int(lo) + 1, min(int(math.ceil(hi)) - 1, count))
        return max(1, count)

    def _convex(self) -> bool:
        """Whether the two safe windows nearest the boundary show latency rising at less than half
        the rate of the line from the nearest one to the broken window: the curve bends up between
        them (queueing near saturation, or a cliff such as a batch that leaves the CUDA graphs),
        so a line from the safe side lands short of the boundary every time and the bracket
        creeps up a few requests per launch; bisection halves it instead."""
        safe = sorted((p for p in self.points if p.slo <= 0), key=lambda p: p.running_requests)[-2:]
        broken = [p for p in self.points if p.slo > 0 and p.running_requests == self.broken]
        if len(safe) < 2 or not broken:
            return False
        (a, b), c = safe, broken[0]
        if b.running_requests <= a.running_requests or c.running_requests <= b.running_requests:
            return False
        rising = (b.slo - a.slo) / (b.running_requests - a.running_requests)
        secant = (c.slo - b.slo) / (c.running_requests - b.running_requests)
        return rising < 0.5 * secant

    def _interpolate(self) -> float | None:
        """Running requests where the latency ratio ``slo + 1`` reaches ``1 − AIM_MARGIN``, from
        the two windows nearest the boundary (one on each side when both exist)."""
        below = [p for p in self.points if p.slo <= 0]
        above = [p for p in self.points if p.slo > 0]
        target = _aim(p.slo + 1.0 for p in below)
        if below and above:
            a = max(below, key=lambda p: p.running_requests)
            b = min(above, key=lambda p: p.running_requests)
        elif above:
            # From the broken side only: a line through two broken windows on one graph coverage;
            # a window that decoded part of its batches eagerly is on another curve (§2.1), so with
            # none alike the nearest alone says latency is proportional to the requests in flight.
            p, *rest = sorted(above, key=lambda q: q.running_requests)
            alike = [q for q in rest if q.same_graphs(p)]
            if not alike:
                return p.running_requests * target / (p.slo + 1.0)
            a, b = p, alike[0]
        else:
            return None
        dr = b.running_requests - a.running_requests
        if dr <= 0:
            return None
        if b.limited_by == "itl" and (a.itl_exceedance or 0) > 0 and (b.itl_exceedance or 0) > 0:
            return _exceedance_count(a, b, below)
        slope = (b.slo - a.slo) / dr
        if slope <= 0:
            return None
        return a.running_requests + (target - (a.slo + 1.0)) / slope


def _aim(safe: Iterable[float]) -> float:
    """The ratio to the limit a bracket aims at (latency over its limit, or slow gaps over their
    allowance), from the safe windows' ratios: ``1 − AIM_MARGIN`` (inside by the margin, so a noisy
    window still meets it), or the limit itself once a safe window is already within the margin."""
    return 1.0 if max(safe, default=0.0) > 1.0 - AIM_MARGIN else 1.0 - AIM_MARGIN


def _exceedance_count(a: SLOPoint, b: SLOPoint, below: Sequence[SLOPoint]) -> float | None:
    """Running requests where the ITL limit's exceedance reaches ``1 − AIM_MARGIN`` (the limit
    itself once a safe window is within that margin), on the power law through ``a`` and ``b``
    (``b`` ITL-bound, more requests).

    The p99 ITL of a chunked-prefill server is a quantile of a mixture (decode-only steps, steps one
    prefill chunk joins, steps two join, ...): it stays flat while the slow steps stay under 1 % of
    the gaps and jumps when they pass it, so a line through two p99s lands far from the boundary.
    The share of gaps above the limit grows smoothly instead, about as a power of the requests in
    flight (each adds one prompt per output length, and steps several prompts join grow as its
    square), so it is interpolated as a line in log-log. Extrapolated down from two breaks, the
    local power is the smallest the curve has (it steepens as the share falls toward none), so the
    estimate errs to fewer requests. ``None`` when the share does not rise between them.
    """
    target = _aim(p.itl_exceedance for p in below if p.itl_exceedance is not None)
    ea, eb = float(a.itl_exceedance or 0.0), float(b.itl_exceedance or 0.0)
    power = math.log(eb / ea) / math.log(b.running_requests / a.running_requests)
    if not power > 0:
        return None
    return a.running_requests * math.exp(math.log(target / ea) / power)


def slo_points(history: Sequence[tuple[int, TrialRecord]]) -> list[SLOPoint]:
    """The measured windows of ``history`` that give an SLO verdict on a healthy server."""
    out = []
    for number, record in history:
        load = record.measured_load
        value = record.constraints.get("slo")
        if (
            record.outcome != "ok"
            or value is None
            or not load.running_requests
            or record.constraints.get("oom_or_crash", 1.0) > 0
            or record.constraints.get("stress", 1.0) > 0
            or record.memory.probe_only
        ):
            continue
        out.append(SLOPoint(number=number, family=family_of(record.params),
                            running_requests=float(load.running_requests or 0), slo=float(value),
                            token_capacity=record.token_capacity, limited_by=limited_by(record),
                            itl_exceedance=record.itl_exceedance, itl_exceedance_low=record.itl_exceedance_low))
    return out


def limited_by(record: TrialRecord) -> str | None:
    """The latency limit ``record``'s measured window came nearest to: ``"ttft"`` or ``"itl"``
    (the larger of its p99 over the SLO's p99 limit), ``None`` when neither was measured
    against a limit (the limits are the record's :attr:`~tuner.records.SloCapacity.limits`)."""
    limits = record.slo_capacity.limits
    ratios = {name: measured / limits[f"p99_{name}_ms"]
              for name, measured in (("ttft", record.p99_ttft_ms), ("itl", record.p99_itl_ms))
              if measured is not None and limits.get(f"p99_{name}_ms")}
    return max(ratios, key=lambda name: ratios[name]) if ratios else None


def slo_bounds(points: Sequence[SLOPoint], *, normalise: Any = None) -> dict[tuple[tuple[str, Any], ...], SLOBound]:
    """One :class:`SLOBound` per family of ``points``.

    Args:
        points: :func:`slo_points`.
        normalise: Maps a family key to the key it is compared under (e.g. snapped to the space),
            or ``None``.
    """
    families: dict[tuple[tuple[str, Any], ...], list[SLOPoint]] = {}
    for p in points:
        key = normalise(p.family) if normalise else p.family
        families.setdefault(key, []).append(p)
    out = {}
    for key, items in families.items():
        items = sorted(items, key=lambda p: p.running_requests)
        met = [p for p in items if p.slo <= 0]
        broke = [p for p in items if p.slo > 0]
        safe = max(met, key=lambda p: p.running_requests, default=None)
        # A window that broke the SLO at fewer requests than one that met it is noise near the
        # boundary (the rule cannot hold for both): the bracket keeps the breaks above the safe one.
        above_safe = [p for p in broke if safe is None or p.running_requests > safe.running_requests]
        broken = min(above_safe, key=lambda p: p.running_requests, default=None)
        out[key] = SLOBound(
            safe=safe.running_requests if safe else 0.0, safe_trial=safe.number if safe else None,
            broken=broken.running_requests if broken else None, broken_trial=broken.number if broken else None,
            points=tuple(items),
        )
    return out
