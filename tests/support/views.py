"""A decision's view of a synthetic history, for the proposers' and screens' pure tests.

:func:`study_view` builds the frozen :class:`tuner.study.view.StudyView` a decision would see: the
finished ``(number, record)`` pairs as given, plus configs running now (``tried``: claimed by some
host; ``pending``: the planner's trials running on other hosts, with their predictions), as real
Optuna trials (``optuna.trial.create_trial``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from tuner.config import BudgetSection, ObjectiveSection
from tuner.records import Prediction, TrialRecord
from tuner.study.calibration import ModelSettings
from tuner.study.decide import Decider, Proposal
from tuner.study.decide.memory import MemoryFrontier
from tuner.study.decide.slo import SLOBracket
from tuner.study.optuna_io import HOST_ATTR, KIND_ATTR, PREDICTION_ATTR
from tuner.study.space import Space
from tuner.study.view import StudyView


def study_view(space: Space, history: Sequence[tuple[int, TrialRecord]], *, context_tokens: int,
               budget: BudgetSection | None = None, mean_request_tokens: int | None = None,
               objective: ObjectiveSection | None = None, tried: Iterable[Mapping[str, Any]] = (),
               pending: Iterable[tuple[Mapping[str, Any], Prediction]] = ()) -> StudyView:
    """The view of ``history`` with ``tried`` configs and ``pending`` planner trials running."""
    dists = space.distributions()
    number = max((n for n, _ in history), default=-1) + 1
    running = []
    for params, attrs in [*((p, {}) for p in tried),
                          *((p, {KIND_ATTR: "predicted", PREDICTION_ATTR: pred.stored()}) for p, pred in pending)]:
        snapped = space.snap(dict(params))
        trial = optuna.trial.create_trial(state=TrialState.RUNNING, params=snapped,
                                          distributions={k: dists[k] for k in snapped},
                                          user_attrs={HOST_ATTR: "elsewhere", **attrs})
        trial.number = number
        number += 1
        running.append(trial)
    settings = ModelSettings(context_tokens=context_tokens, objective=objective or ObjectiveSection(), budget=budget,
                             mean_request_tokens=mean_request_tokens)
    return StudyView(trials=tuple(running), finished=tuple(history), space=space, settings=settings)


def plan(view: StudyView) -> Proposal | None:
    """The planner's next proposal on ``view``: the SLO bracket, then the memory frontier (as the
    study asks them)."""
    return Decider([SLOBracket(), MemoryFrontier()], [], [], limit=10**6).plan(view)
