"""The SLO bracket: while the latency SLO binds, get feasible, then push capacity inside it.

Once a measured window broke the SLO (:mod:`tuner.study.slo_bound`: per knob set, the largest
SLO-safe and the smallest SLO-breaking count of requests the server ran at once), the planner
first gets feasible by bisecting ``max_running_requests`` between those counts (the next count
interpolated from the measured latencies), then pushes capacity inside that bracket and tries the
other chunk sizes at the safe load. The memory frontier (:mod:`tuner.study.decide.memory`) goes on
once every bracket is closed, never proposing a load a window of the same knobs already broke.
"""

from __future__ import annotations

import math

from tuner.records import Prediction
from tuner.study.calibration import Calibration, Family, changed_knobs, neighbours
from tuner.study.decide import Proposal
from tuner.study.decide.rungs import rung_points
from tuner.study.slo_bound import SLOBound, family_of
from tuner.study.space import config_key
from tuner.study.view import ConfigKey, StudyView

__all__ = ["SLOBracket"]


class SLOBracket:
    """The next launch while the latency SLO binds (a :class:`~tuner.study.decide.Proposer`).

    With no feasible trial, the family whose windows say most about the SLO is bisected between
    its largest safe and its smallest broken running-request count (from the measured latencies,
    :meth:`tuner.study.slo_bound.SLOBound.next_count`); with a feasible incumbent, its family's
    bracket is narrowed the same way (capacity = slots inside the SLO), then each other family
    (chunked prefill size, ...) is measured at the incumbent's safe load and, if it holds there, at
    its family's break. ``None``: the SLO does not bind, or every bracket is closed.
    """

    def propose(self, view: StudyView) -> Proposal | None:
        """The next config inside the SLO bracket, or ``None``."""
        cal = view.calibration
        binding = {f: b for f, b in cal.bounds.items() if b.binds}
        if not cal.model_points or not binding:
            return None
        feasible = [p for p in cal.points if p.feasible]
        if feasible:
            family = cal.bracket_key(family_of(max(feasible, key=lambda p: (p.capacity, -p.number)).params))
        else:
            family = max(binding, key=lambda f: (len(binding[f].points), -(binding[f].broken or 0)))
        own_base = cal.bounds.get(family)
        base = own_base if own_base is not None and own_base.binds else binding[cal.binding_family()]
        # One bracket per knob set but the graphs: cuda_graph_max_bs lands with the count (_at_count).
        # A neighbour on a structural rung no start ran is the rung proposer's (its own cell and weights).
        others = [cal.bracket_key(f) for f in neighbours(view.space, dict(family)) if rung_points(cal.model_points, f)]
        families = list(dict.fromkeys([family, *_by_chunk_direction(others, family, _limit_of(base))]))
        for rank, fam in enumerate(families):
            own = cal.bounds.get(fam)
            count: int | None
            if rank and own is not None and own.binds and not own.safe and base.safe:
                if (own.broken or 0) <= base.safe:
                    continue  # it breaks at the incumbent's safe load: fewer requests cannot beat it
                # It broke where the base family did (tried there first): its safe load now.
                count = int(base.safe)
                why = f"another {changed_knobs(family, fam)} at the SLO-safe load of trial {base.safe_trial}"
            elif own is not None and own.points:
                count = own.next_count()
                if count is None and not own.binds and base.broken is not None:
                    # It held so far: try where the base family broke, then step up by a quarter
                    # (never a jump to the memory frontier: the SLO binds on these loads).
                    count = int(base.broken) if base.broken > own.safe else max(int(own.safe) + 1,
                                                                              math.ceil(own.safe * 1.25))
                why = ("bisect running requests between the largest SLO-safe and the smallest SLO-breaking "
                       "window of these knobs" if rank == 0 else
                       f"another {changed_knobs(family, fam)} within the SLO bracket")
            elif base.converged and base.broken is not None and base.safe:
                # The base bracket is closed: only a hold at its break can beat the incumbent's
                # capacity, so the other knobs are measured there first (at the safe load after,
                # if they break there too).
                count = int(base.broken)
                why = (f"another {changed_knobs(family, fam)} at the load that broke the SLO on trial "
                       f"{base.broken_trial} (the SLO-safe load {int(base.safe)} is closed there)")
            else:
                count = int(base.safe) if base.safe else base.next_count()
                why = f"another {changed_knobs(family, fam)} at the SLO-safe load of trial {base.safe_trial}"
            if count is None or count < 1:
                continue
            count = cal.land_count(fam, count, floor=own.safe if own is not None else 0.0)
            proposal = _at_count(cal, fam, count, view.tried, why, own or base)
            if proposal is not None:
                return proposal
        return None


def _at_count(cal: Calibration, key: Family, count: int, tried: frozenset[ConfigKey], why: str,
              bound: SLOBound) -> Proposal | None:
    """The bracket ``key``'s knobs with ``count`` request slots, on the graphs they land on
    (:meth:`~tuner.study.calibration.Calibration.land`: the smallest ``cuda_graph_max_bs`` that
    captures what the largest does at ``count``), at the smallest fraction whose pool holds them
    (the memory frontier at that count), or ``None`` (already tried, or memory forbids it)."""
    family, moved = cal.land(key, count)
    ref = cal.reference(family, count, rung_points(cal.points, family) or cal.points)
    need = cal.need_gib(family)
    found = cal.frontier(family, ref, count, need)
    if found is None and family != key:  # the landed graphs leave too little free: the key's own
        family, moved = key, None
        ref = cal.reference(family, count, rung_points(cal.points, family) or cal.points)
        need = cal.need_gib(family)
        found = cal.frontier(family, ref, count, need)
    if found is None:
        return None
    mfs, tokens, capacity, free, mrr = found
    params, free, graphs = cal.place(ref, family, mfs, mrr, need)
    graphs = graphs or moved
    if config_key(params) in tried:
        return None
    if graphs is not None:
        why = f"{why}; {graphs}"
    return Proposal(params=params, prediction=Prediction(
        token_capacity=tokens, context_capacity=capacity, free_gib_after_graphs=round(free, 3),
        need_gib=round(need, 3), calibrated_on_trial=ref.number,
        running_requests=cal.running_requests(mrr, tokens),
        slo_safe_running_requests=bound.safe, slo_safe_trial=bound.safe_trial,
        slo_broken_running_requests=bound.broken, slo_broken_trial=bound.broken_trial,
        why=why,
    ))


def _limit_of(bound: SLOBound) -> str | None:
    """The latency limit that binds ``bound``: the one its smallest breaking window broke most
    (:attr:`~tuner.study.slo_bound.SLOPoint.limited_by`), ``None`` when not known."""
    return next((p.limited_by for p in bound.points if p.number == bound.broken_trial), None)


def _by_chunk_direction(others: list[Family], family: Family, limit: str | None) -> list[Family]:
    """``others`` with the chunked prefill sizes that move the binding latency limit the right way
    first: a larger chunk prefills a prompt in fewer scheduler steps (a lower TTFT), a smaller one
    adds less prefill work to the decode steps it joins (a lower ITL; §2.1's
    ``chunked_prefill_size``, SGLang's mixed prefill/decode batches). Families that differ in other
    knobs keep their order after those; with the limit not known, the order is kept."""
    chunk = _chunk(family)
    if limit not in ("ttft", "itl") or chunk is None:
        return others

    def rank(fam: Family) -> tuple[int, float]:
        other = _chunk(fam)
        if other is None or other == chunk:
            return (1, 0.0)
        toward = other > chunk if limit == "ttft" else other < chunk
        return (0 if toward else 1, abs(other - chunk) if toward else 0.0)

    return sorted(others, key=rank)


def _chunk(family: Family) -> float | None:
    """``family``'s chunked prefill size in tokens (chunking off, ``-1``: unbounded), ``None``
    when it does not set one."""
    value = dict(family).get("chunked_prefill_size")
    if not isinstance(value, int | float):
        return None
    return math.inf if value <= 0 else float(value)
