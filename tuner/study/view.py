"""What one decision sees: a frozen snapshot of the study, read once.

A :class:`StudyView` is made from one read of the study (every host's trials) at the start of a
decision, and every proposer and screen of that decision (:mod:`tuner.study.decide`) sees the same
one: the planner's calibration, the configs tried, the trials other hosts run. Values derived from
it (the calibrated memory model, :attr:`StudyView.calibration`) are computed on first use and kept
with the view, so they are made once per decision and never outlive the trials they came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.records import Prediction, TrialRecord
from tuner.study.best import band_floor
from tuner.study.calibration import Calibration, ModelSettings
from tuner.study.optuna_io import KIND_ATTR, PREDICTION_ATTR, REPEAT_ATTR, record_of
from tuner.study.space import Space, config_key

__all__ = ["ConfigKey", "StudyView", "RecordCache"]

ConfigKey = tuple[tuple[str, Any], ...]
"""A config as a hashable key (:func:`tuner.study.space.config_key`)."""


class RecordCache:
    """Finished trials' records, parsed once per run (a finished trial's record never changes)."""

    def __init__(self) -> None:
        self._parsed: dict[int, TrialRecord | None] = {}

    def finished(self, trials: Sequence[FrozenTrial]) -> tuple[tuple[int, TrialRecord], ...]:
        """``(number, record)`` of the COMPLETE and PRUNED trials with a record, in trial order."""
        out = []
        for trial in trials:
            if trial.state not in (TrialState.COMPLETE, TrialState.PRUNED):
                continue
            if trial.number not in self._parsed:
                self._parsed[trial.number] = record_of(trial)
            record = self._parsed[trial.number]
            if record is not None:
                out.append((trial.number, record))
        return tuple(out)


@dataclass(frozen=True)
class StudyView:
    """The study as one decision sees it (frozen; derived values computed once, on first use).

    Attributes:
        trials: Every trial of the study as read (every host's), in trial order.
        finished: ``(number, record)`` of the finished trials (COMPLETE and PRUNED), baseline
            included, in trial order.
        space: The study's resolved space.
        settings: The models' fixed settings.
    """

    trials: tuple[FrozenTrial, ...]
    finished: tuple[tuple[int, TrialRecord], ...]
    space: Space
    settings: ModelSettings

    @classmethod
    def read(cls, study: optuna.Study, space: Space, settings: ModelSettings, records: RecordCache) -> StudyView:
        """One read of ``study`` (on a shared PostgreSQL study, one round trip per table)."""
        trials = tuple(study.get_trials(deepcopy=False))
        return cls(trials=trials, finished=records.finished(trials), space=space, settings=settings)

    @cached_property
    def baseline(self) -> int | None:
        """The newest baseline's trial number (the service's own command and version, the fact a
        screen of a flag or a shape cites as its proof), ``None`` before any; not trial 0 by
        assumption: a baseline that could not start is measured again under a later number."""
        return next((number for number, record in reversed(self.finished) if record.kind == "baseline"), None)

    @cached_property
    def waiting(self) -> tuple[FrozenTrial, ...]:
        """Trials enqueued and not yet asked for (every host's)."""
        return tuple(t for t in self.trials if t.state is TrialState.WAITING)

    @cached_property
    def running(self) -> tuple[FrozenTrial, ...]:
        """Trials running now (every host's)."""
        return tuple(t for t in self.trials if t.state is TrialState.RUNNING)

    @cached_property
    def tried(self) -> frozenset[ConfigKey]:
        """Configs finished (measured or skipped), running or queued, on the space's grid: what
        runs elsewhere now is as tried as what finished."""
        keys = {config_key(self.space.snap(r.params)) for _, r in self.finished if r.params}
        keys |= {config_key(self.space.snap(t.params)) for t in (*self.waiting, *self.running) if t.params}
        return frozenset(keys)

    @cached_property
    def measured(self) -> dict[ConfigKey, int]:
        """Configs launched (``ok`` or ``failed``), on the space's grid → the first trial that did."""
        out: dict[ConfigKey, int] = {}
        for number, record in self.finished:
            if record.params and record.outcome in ("ok", "failed"):
                out.setdefault(config_key(self.space.snap(record.params)), number)
        return out

    @cached_property
    def held(self) -> frozenset[ConfigKey]:
        """Configs the study holds a skip of (any host's, any run's), on the space's grid."""
        return frozenset(config_key(self.space.snap(r.params)) for _, r in self.finished
                         if r.params and r.outcome == "skipped")

    @cached_property
    def pending(self) -> tuple[tuple[dict[str, Any], Prediction], ...]:
        """``(params, prediction)`` of the planner's trials running now (other hosts': this host
        runs one trial at a time and decides between them)."""
        return tuple((dict(t.params), Prediction.model_validate(t.user_attrs.get(PREDICTION_ATTR) or {}))
                     for t in self.running
                     if t.user_attrs.get(KIND_ATTR) == "predicted" and t.params)

    @cached_property
    def repeats(self) -> frozenset[int]:
        """Trials re-measured already, or being re-measured or queued for it on any host."""
        done = {r.repeat_of for _, r in self.finished if r.repeat_of is not None}
        done |= {int(t.user_attrs[REPEAT_ATTR]) for t in (*self.waiting, *self.running)
                 if t.user_attrs.get(REPEAT_ATTR) is not None}
        return frozenset(done)

    @cached_property
    def planned(self) -> int:
        """The planner's trials in the study (finished and running, every host's)."""
        done = sum(1 for _, r in self.finished if r.kind == "predicted")
        return done + sum(1 for t in self.running if t.user_attrs.get(KIND_ATTR) == "predicted")

    @cached_property
    def band_floor(self) -> int:
        """The least context capacity that can still win on the policy
        (:func:`tuner.study.best.band_floor` of :attr:`finished`)."""
        return band_floor(self.finished, self.settings.objective)

    @cached_property
    def calibration(self) -> Calibration:
        """The memory and SLO models calibrated on :attr:`finished` (:class:`Calibration`)."""
        return Calibration.of(self.finished, self.space, self.settings)
