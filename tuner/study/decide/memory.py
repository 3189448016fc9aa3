"""The memory frontier: the capacity the calibrated memory model predicts, reached at the least cost.

The planner aims at the largest ``mem_fraction_static`` whose predicted headroom after CUDA graphs
still covers the activation need (:meth:`tuner.study.calibration.Calibration.need_gib`), and
proposes the smallest fraction that reaches the predicted best context capacity (capacity is an
integer: more KV than that buys nothing for the objective and costs headroom;
``shared/sglang-reference.md`` §1.2, §1.6, §8). Each result recalibrates the model. When the
frontier stops moving, it tries the capacity band with more request slots (shorter requests run
alongside: throughput) and one neighbour per other knob (chunked prefill size, hierarchical cache,
...) at its own predicted frontier; then the sampler explores the rest.

With trials running on other hosts, it proposes what is most useful *given* them (the "believer"
of batch Bayesian optimization): it believes each reaches its predicted context capacity, takes
the best as the incumbent, and aims past it or beside it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tuner.records import Prediction
from tuner.study.calibration import Calibration, Family, Point, changed_knobs, margin_for, neighbours
from tuner.study.decide import Proposal
from tuner.study.decide.rungs import rung_points
from tuner.study.slo_bound import SLOBound, family_of
from tuner.study.space import config_key
from tuner.study.view import ConfigKey, StudyView

__all__ = ["MemoryFrontier"]


class MemoryFrontier:
    """The memory model's next candidate (a :class:`~tuner.study.decide.Proposer`).

    With other hosts' planner trials running (:attr:`tuner.study.view.StudyView.pending`), it
    believes each reaches its predicted capacity (predictions stay calibrated on measured trials
    only; a believed start counts as a check of the model, so the margin is the one it would have
    once that start reports) and aims past the best of them, then the plan on the measured trials
    alone; with that spent, the next step from each running trial in the band, best first.
    """

    def propose(self, view: StudyView) -> Proposal | None:
        """The next config at the predicted memory frontier, or ``None`` (the sampler's turn)."""
        cal = view.calibration
        if not cal.model_points:
            return None
        incumbent = max([p for p in cal.points if p.feasible] or cal.model_points, key=lambda p: (p.capacity, -p.number))
        best_capacity = incumbent.capacity
        believers = sorted(_believed(cal, view.pending), key=lambda p: (-p.capacity, p.number))
        believed = max((p.capacity for p in believers), default=0)
        if any(prediction.free_gib_after_graphs is not None for _, prediction in view.pending):
            cal = cal.with_margin(margin_for(view.finished, view.settings, believed_check=True))
        if believed > best_capacity:
            found = _proposal(cal, believers[0], believed, view.tried)
            if found is not None:
                return _given(found, believed)
        found = _proposal(cal, incumbent, best_capacity, view.tried)
        if found is not None or not believers:
            return found
        # The plan on the measured trials is spent (every step of it is measured or running): the
        # step it takes next when a running trial comes back as predicted and becomes the
        # incumbent (its knobs with more request slots, its neighbours in the band), each running
        # trial in the band in turn, best first, before the sampler.
        top = max(best_capacity, believed)
        for ahead in believers:
            if ahead.capacity < top * (1.0 - view.settings.capacity_tolerance):
                break
            found = _proposal(cal, ahead, top, view.tried)
            if found is not None:
                return _given(found, believed)
        return None


def _given(found: Proposal, believed: int) -> Proposal:
    """``found`` with the pending trials it was proposed against in its prediction."""
    prediction = found.prediction.model_copy(update={
        "believed_pending_capacity": believed,
        "why": f"{found.prediction.why}, given trials running on other hosts predicted to reach {believed} contexts"})
    return Proposal(params=found.params, kind=found.kind, prediction=prediction)


def _believed(cal: Calibration, pending: Sequence[tuple[Mapping[str, Any], Prediction]]) -> list[Point]:
    """Running planner trials as if measured at their prediction (the model they were predicted
    with, their predicted context capacity, feasible); numbered after every trial."""
    out = []
    for i, (params, prediction) in enumerate(pending):
        capacity = int(prediction.context_capacity or 0)
        if capacity <= 0 or "mem_fraction_static" not in params:
            continue
        snapped = cal.space.snap(dict(params))
        ref = next((p for p in cal.model_points if p.number == prediction.calibrated_on_trial), None)
        ref = ref or cal.reference(family_of(snapped), int(snapped["max_running_requests"]))
        out.append(ref.model_copy(update={"number": 10**9 + i, "params": snapped, "capacity": capacity,
                                          "feasible": True}))
    return out


def _proposal(cal: Calibration, incumbent: Point, best_capacity: int, tried: frozenset[ConfigKey]) -> Proposal | None:
    """The memory plan's best proposal against ``best_capacity`` (measured, or believed): the
    incumbent's knobs first (raise capacity; or the band with more request slots), then each
    neighbour's family in the band. Each family is predicted from a start of its own structural
    rung (fp8 KV, DCP, DP attention: :func:`~tuner.study.decide.rungs.rung_points`); a rung no
    start ran is left to the rung proposer, which prices it with the ladder (another rung's KV cell
    and weights mispredict its pool: DP attention 8 from DP attention 4's start, 48 predicted, 8 ran)."""
    space, settings = cal.space, cal.settings
    proposals: list[tuple[tuple[int, int, int, int], Proposal]] = []
    base_family = family_of(incumbent.params)
    base_mrr = int(incumbent.params["max_running_requests"])
    # A neighbour on a structural rung no start ran is the rung proposer's (priced by the ladder).
    calibrated = [f for f in neighbours(space, incumbent.params) if rung_points(cal.model_points, f)]
    for rank, family in enumerate([base_family, *calibrated]):
        ref = cal.reference(family, base_mrr, rung_points(cal.model_points, family) or None)
        need = cal.need_gib(family)
        # Tight: just enough request slots for the capacity; or the incumbent's own count; or
        # more slots than the capacity (shorter requests run alongside: throughput), same band.
        # "More" is bounded by what the measured window can run at once (the pool over the mean
        # request, [budget] max_concurrency): the reachable count, and halfway to it (log scale).
        more: list[int] = []
        if rank == 0:
            top = incumbent.model.tokens(incumbent.params["mem_fraction_static"], page_size=incumbent.page_size)
            reach = min(cal.slots_cap(top), space.max_running_requests[1])
            if settings.budget is not None and reach > base_mrr:
                # The reachable count first: throughput grows with the requests run at once
                # until memory or the SLO binds, which the checks below and the SLO rule see.
                more = sorted({reach, int(round(math.sqrt(reach * base_mrr)))} - {base_mrr}, reverse=True)
            elif settings.budget is None:
                more = [m for m in (2 * base_mrr, 4 * base_mrr) if m <= space.max_running_requests[1]]
        options = [found for mrr in (None, base_mrr, *more)
                   if (found := cal.frontier(family, ref, mrr, need)) is not None]
        bound = cal.bound_for(family)
        for mfs, tokens, capacity, free, mrr in options:
            params, free, graphs_note = cal.place(ref, family, mfs, mrr, need)
            if config_key(params) in tried:
                continue
            if mrr > cal.slots_cap(tokens):
                continue  # more slots than the measured window can ever run at once
            if _slo_blocks(cal, family, bound, mrr, tokens):
                continue  # at least the load of a window that broke the SLO, with no better graphs
            if rank == 0 and capacity <= best_capacity and mrr not in more:
                continue
            if rank > 0 and capacity < best_capacity * (1.0 - settings.capacity_tolerance):
                continue
            if capacity > best_capacity:
                why = "raise capacity at the predicted memory frontier"
            elif rank == 0:
                if capacity < best_capacity * (1.0 - settings.capacity_tolerance):
                    continue
                why = "same capacity band with more request slots (shorter requests alongside)"
            else:
                why = "same capacity band with another " + changed_knobs(base_family, family)
            why += _warm_note(ref)
            # A higher predicted capacity first (the highest, whichever knobs reach it), then the
            # incumbent's own knobs before a neighbour's.
            order = (0 if capacity > best_capacity else 1, -capacity if capacity > best_capacity else 0, rank, -capacity)
            proposals.append((order, Proposal(params=params, prediction=Prediction(
                token_capacity=tokens, context_capacity=capacity, free_gib_after_graphs=round(free, 3),
                need_gib=round(need, 3), calibrated_on_trial=ref.number,
                why=why if graphs_note is None else f"{why}; {graphs_note}",
            ))))
    if not proposals:
        return None
    proposals.sort(key=lambda item: item[0])
    return proposals[0][1]


def _warm_note(ref: Point) -> str:
    """What a proposal says when a warm start's reference point (numbered ``-1 - n``,
    :mod:`tuner.study.warm`) predicted it; ``""`` for this study's own trials."""
    return f" (memory model of trial {-1 - ref.number} of the study this one started warm from)" if ref.number < 0 else ""


def _slo_blocks(cal: Calibration, family: Family, bound: SLOBound | None, mrr: int, tokens: int) -> bool:
    """Whether the SLO rules out ``family`` at ``mrr`` slots: a proof on its own windows (within
    equal graph coverage, :meth:`~tuner.study.calibration.Calibration.slo_proof`), or, while its
    knobs broke nothing yet, the binding family's bound as an estimate."""
    if bound is None:
        return False
    running = cal.running_requests(mrr, tokens)
    own = cal.bound_of(family)
    if own is not None and own.binds:
        return cal.slo_proof(family, mrr, running) is not None
    if not bound.violates(running):
        return False
    # The estimate holds as far as the graphs do: a family that decodes on a graph the batches
    # the broken window ran eagerly may hold the SLO there (it is launched, not ruled out).
    mine, theirs = cal.coverage(family, mrr), cal.coverages.get(bound.broken_trial or -1)
    return mine is None or theirs is None or theirs.covers_as_well(mine, int(bound.broken or 0))
