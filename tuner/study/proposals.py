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
study as one finished trial, in one write (:func:`tuner.study.optuna_io.add_record`) made by a
background thread (:class:`SkipWriter`), once per config in the study (a host-memory skip once
per host); a proposal that passes is handed to the shared study as an enqueued trial and claimed there like any other.
The sampler sees the same trials either way, so the search is the sampler's own, with one
addition: a trial without a knob the space searches on every trial (the baseline, which runs the
unit's own flags: SGLang's default ``max_running_requests`` is no flag) is copied with that knob
on the space's grid (:meth:`tuner.study.space.Space.snap`: the default at the space's top).
Multivariate TPE models only the knobs every trial has (Optuna's ``IntersectionSearchSpace``):
without the fill it sampled ``max_running_requests`` apart from ``mem_fraction_static``, though
the two set the context capacity together, and paid a second Parzen pass per draw for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import optuna
from optuna.samplers import BaseSampler
from optuna.storages import InMemoryStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from tuner.records import RECORD_ATTR, TrialRecord
from tuner.study.hosts import HOST_ATTR
from tuner.study.optuna_io import add_record
from tuner.study.space import Space, config_key

__all__ = ["ProposalMirror", "SkipWriter"]

_COPIED_STATES = (TrialState.COMPLETE, TrialState.PRUNED)


class ProposalMirror:
    """An in-memory copy of a study for its sampler: propose, screen, then write what stays.

    Args:
        directions: The shared study's directions.
        sampler: The sampler that proposes (the study's kind; its own instance and seed).
        space: The study's space: copies get the knobs a trial lacks on its grid (``None``: as stored).
        host: This host's name (:data:`tuner.study.hosts.HOST_ATTR`): other hosts' skips are not
            copied (``None``: every trial is).
    """

    def __init__(self, directions: Iterable[StudyDirection], sampler: BaseSampler, space: Space | None = None,
                 host: str | None = None) -> None:
        self.study = optuna.create_study(storage=InMemoryStorage(), sampler=sampler, directions=list(directions))
        self.space = space
        self.host = host
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
                key = config_key(trial.params)
                if trial.state is TrialState.PRUNED and self._own_skips[key] > 0:
                    self._own_skips[key] -= 1  # this mirror's own skip, told here already
                    continue
                if self._others_skip(trial):
                    continue
                self.study.add_trial(self._complete(trial))
            elif trial.state is TrialState.RUNNING:
                if trial.params and trial.number not in self._running:
                    self.study.add_trial(self._complete(trial))
                    self._running[trial.number] = len(self.study.get_trials(deepcopy=False)) - 1
            elif trial.state is TrialState.FAIL:
                self._end_running(trial.number)
                self._copied.add(trial.number)

    def ask(self) -> optuna.Trial:
        """A trial of the mirror for the sampler to fill (``Space.suggest``)."""
        return self.study.ask()

    def skipped(self, trial: optuna.Trial, tell: Any, *, stored: bool = True) -> None:
        """``tell(mirror_study, trial)`` stores the skip on the mirror's trial (PRUNED); the shared
        copy the caller writes (``stored``) is recognised in a later :meth:`sync` and not copied
        again."""
        tell(self.study, trial)
        if stored:
            self._own_skips[config_key(trial.params)] += 1

    def release(self, trial: optuna.Trial) -> None:
        """Drop a proposal that goes to the shared study (it comes back as RUNNING on sync)."""
        self.study.tell(trial, state=TrialState.FAIL)

    def _others_skip(self, trial: FrozenTrial) -> bool:
        """Whether ``trial`` is another host's skip (PRUNED, outcome ``skipped``), which the mirror
        leaves out: a skip is what the screens conclude from the measured trials, which every
        host's mirror holds, so this host's screens say the same of that config; copied, every
        host's sampler paid for every host's skips (TPE's cost per draw grows with the trials it
        holds, and four hosts on one box held four times the skips)."""
        if self.host is None or trial.state is not TrialState.PRUNED:
            return False
        record = trial.user_attrs.get(RECORD_ATTR) or {}
        return record.get("outcome") == "skipped" and trial.user_attrs.get(HOST_ATTR, self.host) != self.host

    def _complete(self, trial: FrozenTrial) -> FrozenTrial:
        """``trial`` with the searched knobs it lacks filled in on the space's grid (see the module)."""
        if self.space is None:
            return trial
        snapped = self.space.snap(trial.params)
        missing = [name for name in snapped if name not in trial.params]
        if not missing:
            return trial
        distributions = self.space.distributions()
        return optuna.trial.create_trial(
            state=trial.state, values=trial.values, params={**trial.params, **{k: snapped[k] for k in missing}},
            distributions={**trial.distributions, **{k: distributions[k] for k in missing}},
            user_attrs=trial.user_attrs, constraints=trial.constraints)

    def _end_running(self, number: int) -> None:
        mirrored = self._running.pop(number, None)
        if mirrored is not None:
            self.study.tell(mirrored, state=TrialState.FAIL)


class SkipWriter:
    """Stores the sampler's skipped proposals in the shared study from one background thread, in
    the order they were skipped.

    A skip is a decision, not a measurement, and the loop goes on drawing while it is written: on
    a shared PostgreSQL study with four hosts on one box, a write (:func:`add_record`) took about
    80 ms beside the sampler's own draw, and late in a study most draws are skipped.
    Optuna's ``RDBStorage`` and ``InMemoryStorage`` are thread-safe.

    Args:
        study: The shared study.
    """

    def __init__(self, study: optuna.Study) -> None:
        self._study = study
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tuner-skips")
        self._pending: list[Future[int]] = []

    def store(self, params: Mapping[str, Any], distributions: Mapping[str, Any], record: TrialRecord,
              user_attrs: Mapping[str, Any]) -> None:
        """Queue one skipped trial (:func:`add_record`'s arguments).

        Raises:
            Exception: What an earlier write raised (a storage error: the database stopped answering).
        """
        pending = []
        for future in self._pending:  # each future looked at once: one that ends meanwhile waits for the next call
            if future.done():
                future.result()
            else:
                pending.append(future)
        self._pending = pending
        self._pending.append(self._pool.submit(add_record, self._study, dict(params), dict(distributions),
                                               record, dict(user_attrs)))

    def flush(self) -> None:
        """Wait until every queued skip is stored.

        Raises:
            Exception: What a write raised.
        """
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Wait for the queued writes and end the thread (errors are :meth:`flush`'s to raise)."""
        self._pool.shutdown(wait=True)
