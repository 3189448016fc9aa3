"""The sampler's proposals, drawn and screened in memory before anything is written to the study.

Most of what a sampler proposes late in a study is skipped without a restart: it is below the best
capacity band, proved to fail by a memory failure, or was measured already
(:func:`tuner.study.loop.skip_reason`, :meth:`tuner.study.planner.Planner.screen`). Asking the
shared study for such a trial costs a dozen storage round trips (create the trial, one write per
param, the sampler's read of every trial, the record, three constraints, the tell); on a shared
PostgreSQL study that is a second of a host's time per skip, with several skips per launch.

So the sampler runs on a :class:`ProposalMirror`: an in-memory Optuna study holding a copy of the
shared study's trials (finished ones, and other hosts' RUNNING ones for the constant liar), kept up
to date incrementally from the loop's one read per decision. A proposal the screens reject is told
PRUNED there (so the sampler moves on, as it would on the shared study) and stored in the shared
study as one finished trial, in one write (:func:`tuner.study.optuna_io.add_record`); a proposal
that passes is handed to the shared study as an enqueued trial and claimed there like any other.
The sampler sees the same trials either way, so the search is the sampler's own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import optuna
from optuna.samplers import BaseSampler
from optuna.storages import InMemoryStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

__all__ = ["ProposalMirror"]

_COPIED_STATES = (TrialState.COMPLETE, TrialState.PRUNED)


def _key(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(params.items()))


class ProposalMirror:
    """An in-memory copy of a study for its sampler: propose, screen, then write what stays.

    Args:
        directions: The shared study's directions.
        sampler: The sampler that proposes (the study's kind; its own instance and seed).
    """

    def __init__(self, directions: Iterable[StudyDirection], sampler: BaseSampler) -> None:
        self.study = optuna.create_study(storage=InMemoryStorage(), sampler=sampler, directions=list(directions))
        self._copied: set[int] = set()
        self._running: dict[int, int] = {}  # shared trial number -> mirror trial number (RUNNING)
        self._own_skips: Counter[tuple[tuple[str, Any], ...]] = Counter()

    def sync(self, trials: Iterable[FrozenTrial]) -> None:
        """Bring the mirror up to date with ``trials`` (the shared study's, one read): finished
        trials are copied once; RUNNING ones with params are copied as RUNNING (the constant
        liar's) and replaced by their finished copy, or dropped (FAIL), when they end."""
        for trial in trials:
            if trial.number in self._copied:
                continue
            if trial.state in _COPIED_STATES:
                self._end_running(trial.number)
                self._copied.add(trial.number)
                key = _key(trial.params)
                if trial.state is TrialState.PRUNED and self._own_skips[key] > 0:
                    self._own_skips[key] -= 1  # this mirror's own skip, told here already
                    continue
                self.study.add_trial(trial)
            elif trial.state is TrialState.RUNNING:
                if trial.params and trial.number not in self._running:
                    self.study.add_trial(trial)
                    self._running[trial.number] = len(self.study.get_trials(deepcopy=False)) - 1
            elif trial.state is TrialState.FAIL:
                self._end_running(trial.number)
                self._copied.add(trial.number)

    def ask(self) -> optuna.Trial:
        """A trial of the mirror for the sampler to fill (``Space.suggest``)."""
        return self.study.ask()

    def skipped(self, trial: optuna.Trial, tell: Any) -> None:
        """``tell(mirror_study, trial)`` stores the skip on the mirror's trial (PRUNED); the shared
        copy the caller writes is recognised in a later :meth:`sync` and not copied again."""
        tell(self.study, trial)
        self._own_skips[_key(trial.params)] += 1

    def release(self, trial: optuna.Trial) -> None:
        """Drop a proposal that goes to the shared study (it comes back as RUNNING on sync)."""
        self.study.tell(trial, state=TrialState.FAIL)

    def _end_running(self, number: int) -> None:
        mirrored = self._running.pop(number, None)
        if mirrored is not None:
            self.study.tell(mirrored, state=TrialState.FAIL)
