"""The sampler: TPE's proposals, drawn and screened in memory before anything is written to the study.

Most of what a sampler proposes late in a study is skipped without a restart: it is below the best
capacity band, proved to fail by a memory failure, or was measured already
(:mod:`tuner.study.decide.screens`). Asking the
shared study for such a trial costs a dozen storage round trips (create the trial, one write per
param, the sampler's read of every trial, the record, three constraints, the tell); on a shared
PostgreSQL study that is a second of a host's time per skip, with several skips per launch.

So the sampler runs on a :class:`ProposalMirror`: an in-memory Optuna study holding a copy of the
shared study's trials (finished ones, and other hosts' RUNNING ones for the constant liar), kept up
to date incrementally from the loop's one read per decision. A proposal the screens reject is told
PRUNED there (so the sampler moves on, as it would on the shared study) and stored in the shared
study as one finished trial, in one write made by a background thread
(:class:`tuner.study.record.SkipWriter`), once per config in the study (a host-memory skip once
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
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optuna
from optuna.samplers import BaseSampler
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from tuner.records import RECORD_ATTR
from tuner.study.decide import Draw, Proposal, Screen, first_skip
from tuner.study.optuna_io import HOST_ATTR, tell_record
from tuner.study.space import Space, config_key
from tuner.study.view import ConfigKey, StudyView

__all__ = ["PROPOSALS_PER_DECISION", "Sampler", "ProposalMirror"]

PROPOSALS_PER_DECISION = 16
"""The sampler's proposals screened per decision before the loop reads the study again."""

_COPIED_STATES = (TrialState.COMPLETE, TrialState.PRUNED)


class Sampler:
    """The sampler's next proposal that passes the screens (the chain's last
    :class:`~tuner.study.decide.Proposer`).

    The sampler proposes on the in-memory :class:`ProposalMirror` of the study (the constant liar
    seeing every host's RUNNING trials); a proposal that needs no restart is handed to
    ``on_skip`` (the loop stores it in the background, counts it and tells the user) and the
    next one is drawn, at most :data:`PROPOSALS_PER_DECISION` per decision. A draw of a config
    measured already, or skipped by this run already, is told to the mirror only: late in a study,
    when most draws repeat, they cost no write. A skip of a config the study holds a skip of
    already (another host's, or an earlier run's) is this run's decision but not written again.

    Args:
        mirror: The study's in-memory mirror.
        screens: The screens a sampled config passes, in order.
        on_skip: Records a rejected draw; returns whether the run goes on (``False``: stop drawing).
    """

    def __init__(self, mirror: ProposalMirror, screens: Sequence[Screen], on_skip: Callable[[Draw], bool]) -> None:
        self.mirror = mirror
        self.screens = tuple(screens)
        self.on_skip = on_skip
        self.skipped: set[ConfigKey] = set()  # configs this run stored a skip of

    def propose(self, view: StudyView) -> Proposal | None:
        """The first draw that passes every screen, as Optuna params, or ``None``."""
        space = view.space
        self.mirror.sync(view.trials)
        for _ in range(PROPOSALS_PER_DECISION):
            trial = self.mirror.ask()
            params = space.suggest(trial)
            key = config_key(space.snap(params))
            skip = first_skip(self.screens, params, view)
            if skip is None:
                self.mirror.release(trial)
                return Proposal(params=dict(trial.params), kind="sampled")
            record = skip.record(params, "sampled")
            # The study holds each skip once: a draw of a config measured already, or skipped by
            # this run already, is told to the mirror (the sampler moves on) and not written again;
            # one another host (or run) stored is not written again either, but is this run's skip.
            again = key in self.skipped or key in view.measured
            write = not again and (key not in view.held or bool(params.get("enable_hierarchical_cache")))
            self.mirror.skipped(trial, lambda mirror, t, r=record: tell_record(mirror, t, r), stored=write)
            self.skipped.add(key)
            draw = Draw(params=params, optuna_params=dict(trial.params), distributions=dict(trial.distributions), skip=skip,
                        record=record, write=write, repeat=again)
            if not self.on_skip(draw):
                return None
        return None


class ProposalMirror:
    """An in-memory copy of a study for its sampler: propose, screen, then write what stays.

    Args:
        directions: The shared study's directions.
        sampler: The sampler that proposes (the study's kind; its own instance and seed).
        space: The study's space: copies get the knobs a trial lacks on its grid (``None``: as stored).
        host: This host's name (:data:`tuner.study.optuna_io.HOST_ATTR`): other hosts' skips are not
            copied (``None``: every trial is).
    """

    def __init__(self, directions: Iterable[StudyDirection], sampler: BaseSampler, space: Space | None = None,
                 host: str | None = None) -> None:
        self.study = optuna.create_study(sampler=sampler, directions=list(directions))  # in memory
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

    def add_prior(self, trials: Iterable[FrozenTrial]) -> int:
        """Add an earlier study's measured trials as the sampler's prior knowledge (Optuna's
        ``add_trials``; the warm start, :mod:`tuner.study.warm`): they shape its proposals and are
        never told to the shared study. Returns how many were added."""
        prior = [self._complete(t) for t in trials]
        self.study.add_trials(prior)
        return len(prior)

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
