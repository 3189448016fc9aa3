"""Decide: which config the study launches next, and which it need not launch.

What to try next is a chain of :class:`Proposer` s, each one small object with one method that
sees the decision's frozen :class:`~tuner.study.view.StudyView` and returns a :class:`Proposal` or
nothing (the shape of Optuna's samplers and GuideLLM's ``Profile.next_strategy``). In the order the
study asks them (:class:`Decider`):

=================  ===========================================================================
the queue          trials enqueued in the study (a killed run's, a dead host's): run them first
SLO bracket        :mod:`~tuner.study.decide.slo`: get feasible, then push inside the latency SLO
early cache        :mod:`~tuner.study.decide.cache`: the first planned best with the hierarchical
                   cache on, once (the space searches it only where the workload's reuse pays)
memory frontier    :mod:`~tuner.study.decide.memory`: the smallest fraction reaching the highest
                   capacity the calibrated memory model predicts, then the band's neighbours
cache              :mod:`~tuner.study.decide.cache`: the best flags with the hierarchical cache on
noise repeat       :mod:`~tuner.study.decide.repeat`: re-measure the band's two fastest configs
sampler            :mod:`~tuner.study.decide.sampler`: TPE on an in-memory mirror of the study
=================  ===========================================================================

Whether a proposal needs no restart is a list of :class:`Screen` s
(:mod:`~tuner.study.decide.screens`: measured already, must fail, predicted, host memory, running
elsewhere), each one method returning a :class:`Skip` with its reason and proving trial, or
nothing (the shape of Optuna's pruners). Nothing here writes to the study, reads the storage or
knows the hosts: the loop (:mod:`tuner.study.loop`) asks, claims, runs and records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tuner.records import Constraints, Prediction, TrialRecord, now_iso
from tuner.study.view import StudyView

__all__ = ["Proposal", "Skip", "Draw", "Proposer", "Screen", "Decider", "first_skip", "record_kind"]


@dataclass(frozen=True)
class Proposal:
    """A config a proposer wants launched next.

    Attributes:
        params: Searched knobs by SGLang field name, on the space's grid (empty for
            :attr:`from_queue`).
        kind: ``predicted`` (the planner's models), ``sampled`` (the sampler) or ``enqueued``.
        prediction: What the models expect (:class:`tuner.records.Prediction`: ``token_capacity``,
            ``context_capacity``, ``free_gib_after_graphs`` (GiB), ``need_gib``, ``why``, ...),
            stored with the trial and in its record.
        repeat_of: The trial this proposal re-measures (the noise), or ``None``.
        from_queue: Take the study's oldest waiting trial (its own params and attributes).
    """

    params: dict[str, Any] = field(default_factory=dict)
    kind: str = "predicted"
    prediction: Prediction = field(default_factory=Prediction)
    repeat_of: int | None = None
    from_queue: bool = False


@dataclass(frozen=True)
class Skip:
    """Why a config needs no restart.

    Attributes:
        reason: One line for the user (says "predicted" when it is a prediction, not a proof).
        proof: The trial that proves it (or calibrated the prediction); a fact of the deployment
            (its SGLang version, its command) cites the study's baseline
            (:attr:`tuner.study.view.StudyView.baseline`), ``None`` before it was measured. Never a
            made-up number: stored as the record's ``proved_by_trial``.
    """

    reason: str
    proof: int | None

    def record(self, params: Mapping[str, Any], kind: str, prediction: Prediction | None = None) -> TrialRecord:
        """The record of a config not launched: why, and the trial that proves it (every
        constraint violated, no values)."""
        return TrialRecord(params=dict(params), kind=record_kind(kind), outcome="skipped", skipped_reason=self.reason,
                           proved_by_trial=self.proof, prediction=prediction or Prediction(),
                           started_at=now_iso(),
                           duration_s=0.0, constraints=Constraints.all_violated())


@dataclass(frozen=True)
class Draw:
    """A sampler's proposal that a screen rejected.

    Attributes:
        params: Its knobs by SGLang field name (:meth:`tuner.study.space.Space.suggest`).
        optuna_params: Its Optuna params, as the mirror's trial holds them.
        distributions: Their distributions.
        skip: Why it needs no restart.
        record: Its record (``outcome="skipped"``), told to the mirror and stored.
        write: Store it in the study (a config the study holds no skip of; a host-memory skip,
            each host's own, always).
        repeat: A config measured, or skipped by this run, already: no trial, only a count
            towards the exhaustion stop.
    """

    params: dict[str, Any]
    optuna_params: dict[str, Any]
    distributions: dict[str, Any]
    skip: Skip
    record: TrialRecord
    write: bool
    repeat: bool


class Proposer(Protocol):
    """One way of choosing the next config. Asked once per decision, in the chain's order;
    ``None`` passes to the next one."""

    def propose(self, view: StudyView) -> Proposal | None:
        """The next config to launch given ``view``, or ``None``."""
        ...


class Screen(Protocol):
    """One reason a config needs no restart. Asked before a launch."""

    def why_not(self, params: Mapping[str, Any], view: StudyView) -> Skip | None:
        """Why ``params`` (SGLang field names) need not be launched, or ``None``."""
        ...


def first_skip(screens: Sequence[Screen], params: Mapping[str, Any], view: StudyView) -> Skip | None:
    """The first screen's skip of ``params``, in order, or ``None`` to launch."""
    for screen in screens:
        skip = screen.why_not(params, view)
        if skip is not None:
            return skip
    return None


def record_kind(kind: str) -> Any:
    """``kind`` as a record's kind (``sampled`` for anything unknown)."""
    return kind if kind in ("baseline", "predicted", "sampled", "enqueued") else "sampled"


class Decider:
    """The chain: the queue, then the planner's proposers (while the study's planned trials are
    below ``limit``), and the screens a proposal passes before a restart. The sampler, which
    draws outside the claim lock and stores its own skips, is the loop's last resort
    (:class:`tuner.study.decide.sampler.Sampler`).

    Args:
        planned: The planner's proposers, in order (empty: the sampler alone, the
            search-quality benchmark's comparison).
        screens: Screens every proposal passes (proofs, host memory).
        sampled_screens: Screens a sampled proposal passes (proofs, predictions, host memory).
        limit: ``[study] predicted_candidates``: the planner's trials a study makes at most.
    """

    def __init__(self, planned: Sequence[Proposer], screens: Sequence[Screen], sampled_screens: Sequence[Screen],
                 limit: int) -> None:
        self.planned = tuple(planned)
        self.screens = tuple(screens)
        self.sampled_screens = tuple(sampled_screens)
        self.limit = limit

    def planning(self, view: StudyView) -> bool:
        """Whether the planner still proposes (it has proposers and the study is below the limit)."""
        return bool(self.planned) and view.planned < self.limit

    def plan(self, view: StudyView) -> Proposal | None:
        """The queue's trial, else the first planned proposal, else ``None`` (the sampler's turn)."""
        if view.waiting:
            return Proposal(kind="enqueued", from_queue=True)
        if not self.planning(view):
            return None
        for proposer in self.planned:
            proposal = proposer.propose(view)
            if proposal is not None:
                return proposal
        return None

    def screen(self, params: Mapping[str, Any], kind: str, view: StudyView) -> Skip | None:
        """Why the asked trial's ``params`` (of ``kind``) need no restart, or ``None``."""
        return first_skip(self.sampled_screens if kind == "sampled" else self.screens, params, view)
