"""The tuning run: open → baseline → while no stop: decide → claim → run → tell → hooks.

One run of ``tuner run`` is one :class:`StudyRun`, in the shape of Optuna's own ``_optimize``; each
step is owned by the module named, the loop only orders them::

    open      storage, study, environment, journal replay, recovery: tuner.study.session.opened_run
    baseline  the unit's current flags, once per study; its record fixes the space: tuner.study.baseline
    warm      another study's fingerprint of this deployment: tuner.study.session.with_prior
    stop?     the trial cap, the budget, the maintenance window, the streaks: tuner.study.stops
    decide    one read of the study (tuner.study.view.StudyView); the queue, the planner's
              proposers, else the sampler (tuner.study.decide, built by tuner.study.session.decision_chain)
    claim     the screens, then under the study's claim lock: measured or claimed by another host?
              (tuner.study.hosts); the job (tuner.study.job.job_for)
    run       the runner (tuner.trial.TrialExecutor) restarts the service and measures, the trial
              beating as this host's; an interrupt is stored (tuner.study.record.Recorder)
    tell      tell Optuna: tuner.study.record.Recorder
    hooks     the opening's after-tell listeners (tuner.study.hooks), then the progress listener

The loop chooses no parameter and stores nothing itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from tuner.config import TunerConfig
from tuner.records import TrialRecord, now_iso
from tuner.study.baseline import check_started, claim_baseline, fix_space, has_space, space_notes, stored_space
from tuner.study.budget import Budget
from tuner.study.decide import Decider, Draw, Proposer, Skip
from tuner.study.hosts import (
    Reaped,
    Section,
    TrialHeartbeat,
    claim_trial,
    own_environment,
    reap_stale,
    reaped_text,
)
from tuner.study.job import TrialJob, TrialRunner, job_for
from tuner.study.outage import ResultJournal
from tuner.study.progress import Progress, RunProgress, RunSummary
from tuner.study.session import Opened, decision_chain, opened_run, run_summary, with_prior
from tuner.study.stops import (
    MAX_INVALID_IN_A_ROW,
    MAX_REPEATS_IN_A_ROW,
    MAX_SKIPS_IN_A_ROW,
    BudgetLeft,
    Stop,
    Streaks,
    TrialCap,
    Window,
    first_stop,
    require_a_stop,
)
from tuner.study.view import StudyView

__all__ = ["MAX_INVALID_IN_A_ROW", "MAX_REPEATS_IN_A_ROW", "MAX_SKIPS_IN_A_ROW", "Streaks", "StudyRun", "run_study"]

_log = logging.getLogger(__name__)

@dataclass(frozen=True)
class _Options:
    """The run's options (see :class:`StudyRun`)."""

    budget_s: float | None
    max_trials: int | None
    allow_mixed_environment: bool
    use_planner: bool
    journal: ResultJournal | None


class StudyRun:
    """One run of a study: the stop rules, and one decision, launch and record per step.

    Args:
        config: The validated config.
        runner: Runs one trial (:class:`tuner.trial.TrialExecutor`, on a server or offline).
        budget_s: Wall-clock budget in seconds (``None``: unbounded, then ``max_trials`` must be
            given).
        max_trials: Cap on trials launched in this run (restarts of the service; a skipped proposal
            costs no restart and does not count, so a study's launches reach the cap).
        allow_mixed_environment: Add trials even if the environment differs from the study's.
        storage_url: Override of the config's storage URL (``:memory:`` for the benchmark).
        on_progress: Receives :class:`~tuner.study.progress.Progress` events.
        clock: Monotonic clock in seconds (injectable).
        use_planner: Ask the planner's proposers and screens (off: the sampler alone, for the
            search-quality benchmark's comparison).
        journal: Where launched trials' results are kept until the database has them
            (:class:`tuner.study.outage.ResultJournal`; ``None``: memory only).

    Raises:
        StudyError: Neither budget nor trial cap given.
    """

    def __init__(self, config: TunerConfig, runner: TrialRunner, *, budget_s: float | None = None,
                 max_trials: int | None = None, allow_mixed_environment: bool = False, storage_url: str | None = None,
                 on_progress: Callable[[Progress], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 use_planner: bool = True, journal: ResultJournal | None = None) -> None:
        require_a_stop(budget_s, max_trials)
        self.config = config
        self.runner = runner
        self.options = _Options(budget_s, max_trials, allow_mixed_environment, use_planner, journal)
        self.clock = clock
        self.budget = Budget(budget_s, reserve_s=config.budget.restore_reserve_s, clock=clock)
        self.summary = run_summary(config, storage_url)
        self.progress = RunProgress(on_progress, self.summary, self.budget, self.cost_s, max_trials=max_trials,
                                    clock=clock)
        self.opened: Opened | None = None
        self.view: StudyView | None = None  # this decision's read of the study (None: read again)
        self.streaks = Streaks()
        self.rules = (TrialCap(max_trials, lambda: self.summary.trials_run), BudgetLeft(self.budget, self.cost_s),
                      Window(config, self.budget, self.cost_s, self.progress))
        self.stopped = False

    # ---- the run -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Open the study, measure the baseline, then decide, launch and record until a stop.

        Returns:
            The summary, with the best trial chosen by the config's policy.

        Raises:
            StudyError: Storage (an explicit SQLite folder that does not exist), environment
                mismatch, ``[service] url`` not on the command's ``--port``; after the trial is
                stored: the baseline could not start for a reason other than memory, or
                :data:`MAX_INVALID_IN_A_ROW` trials in a row failed ``invalid_arguments`` (the
                message quotes the server log's error line).
            ConfigError: ``budget_s`` is shorter than one trial's estimated cost.
            KeyboardInterrupt: Ctrl-C or SIGTERM; the trial in flight is stored as FAIL with its
                partial record and its params re-enqueued.
        """
        started, options = self.clock(), self.options
        with opened_run(self.config, self.runner, self.summary, self.progress, journal=options.journal,
                        allow_mixed_environment=options.allow_mixed_environment) as opened:
            self.opened = opened
            self.budget.require_one(self.cost_s, self.config)
            self.summary.baseline = self.baseline()
            if not self.stopped:
                self.warm_start()
            try:
                if not self.stopped:  # a stop before the baseline (the window) leaves nothing to decide
                    space = stored_space(opened.study, self.config.study.name)
                    decider, sampler = decision_chain(self._opened(), self.config, self.runner, space,
                                                      self.summary.host, use_planner=options.use_planner,
                                                      on_skip=self.on_draw)
                while not self.stopped and self.can_continue():
                    step = self.decide(decider, sampler)
                    if step is not None:  # launch: a restart of the service
                        self.streaks.check(step[0].number, self.record(*step, self.run_trial(*step)), self.config,
                                           self.summary.storage_url)
                opened.recorder.flush()
            finally:
                opened.recorder.close()  # an interrupted run's last skips are stored, not raised over it
        self.summary.finish(self.finished(), self.config.objective, self.clock() - started)
        return self.summary

    def baseline(self) -> tuple[int, TrialRecord] | None:
        """The study's baseline (the service's own flags), measured now when the study has none of
        this environment (once per study: a host waits while another measures it). Its record
        fixes the space (:func:`tuner.study.baseline.fix_space`).

        Raises:
            StudyError: The baseline could not start for a reason other than memory.
        """
        opened = self._opened()
        study, environment, argv = opened.study, opened.environment, self.runner.baseline_argv()
        trial, found = claim_baseline(study, environment, self.summary.host, claim=self.claim,
                                      can_continue=self.can_continue,
                                      own_environment=lambda: own_environment(study, environment),
                                      on_wait=lambda text: self.progress.note(None, text, phase="waiting"))
        if trial is None:
            return found
        job = TrialJob(number=trial.number, kind="baseline", context_tokens=opened.context_tokens, started_at=now_iso())
        record = self.run_trial(trial, job)
        space = fix_space(study, trial, record, self.config, environment, opened.context_tokens,
                          host=self.runner.host_memory(), own_environment=own_environment(study, environment), argv=argv)
        for line in space_notes(space):
            self.progress.note(trial.number, line)
        record = self.record(trial, job, record)
        check_started(record, trial.number, self.config, self.summary.storage_url)
        return trial.number, record

    def warm_start(self) -> None:
        """Reuse another study's fingerprint of this deployment (:func:`tuner.study.session.with_prior`):
        the models' settings start from its checks; the sampler gets its measured trials."""
        opened = self._opened()
        with self.claim(reap=False):  # hosts starting together: one looks up and enqueues, the others read it
            self.opened, line = with_prior(opened, self.config, self.summary.storage_url,
                                           baseline=self.summary.baseline, finished=self.finished(),
                                           space=stored_space(opened.study, self.config.study.name))
        self.view = None
        if line is not None:
            self.progress.note(None, line)

    # ---- one step: decide, claim ------------------------------------------------------------------

    def decide(self, decider: Decider, sampler: Proposer) -> tuple[optuna.Trial, TrialJob] | None:
        """The next trial to launch and its job, or ``None`` (a skip was stored, the sampler's draws
        of this decision were all skipped, or another host failed the asked trial: choose again).

        The planner decides under the study's claim lock (on a shared study), from a read made
        inside it, and its proposal is enqueued and asked before the lock goes: the next host's
        planner sees it as running and proposes what is useful given it, never the same plan. The
        sampler draws outside the lock. Every asked trial passes the screens, then is claimed under
        the lock: the first host to claim a config launches it, a later one skips it."""
        opened = self._opened()
        planning = decider.planning(self.read())
        with self.claim(reap=False) if planning and opened.shared else contextlib.nullcontext():
            self.view = None  # one read of the study per decision: every host's trials as of now
            view = self.read()
            proposal = decider.plan(view)
            trial = opened.recorder.ask(proposal) if proposal is not None else None
        if trial is None:
            proposal = sampler.propose(view)
            if proposal is None:
                return None
            trial = opened.recorder.ask(proposal)  # the oldest waiting trial (another host's: no matter)
        job = job_for(trial, view, self.config, opened.context_tokens)
        skip = None if job.repeat_of is not None else decider.screen(job.params, job.kind, view)
        if skip is None:  # RUNNING with its params, host and heartbeat before the lock goes
            found = claim_trial(opened.study, trial, self.summary.host, opened.environment, hold=self.claim,
                                check=job.repeat_of is None)
            if isinstance(found, Reaped):  # another host failed it while this one chose: choose again
                return None
            skip = Skip(*found) if found is not None else None
        if skip is not None:
            opened.recorder.skip(trial, job.params, job.kind, job.prediction, skip)
            self.count_skip(trial.number, job.params, job.kind, skip.reason)
            return None
        return trial, job

    def on_draw(self, draw: Draw) -> bool:
        """A sampler's rejected draw: stored (a new skip, in the background) and counted; whether
        the run goes on."""
        if draw.write:
            self._opened().recorder.store_draw(draw)
        self.count_skip(None, draw.params, "sampled", draw.skip.reason, stored=not draw.repeat)
        return not self.stopped and self.can_continue()

    def count_skip(self, number: int | None, params: dict[str, Any], kind: str, text: str, *, stored: bool = True) -> None:
        """Count a skip (trial ``number``; ``None``: a sampler's draw) and tell the listener. A draw
        not ``stored`` (a config measured or skipped already) is no trial: it only counts towards
        :data:`MAX_REPEATS_IN_A_ROW`; a stored (new) skip counts towards
        :data:`MAX_SKIPS_IN_A_ROW`. Either streak stops the run as exhausted, with a line saying
        which (:attr:`RunSummary.stop_detail`)."""
        if not stored:
            self.stop_on(self.streaks.repeat())
            return
        self.summary.count_skip(text)
        self.progress.skip(number, params, kind, text)
        launched = sum(1 for _, r in self.finished() if r.outcome in ("ok", "failed"))  # every host's: a change resets
        self.stop_on(self.streaks.skip(launched))

    # ---- run, record ------------------------------------------------------------------------------

    def run_trial(self, trial: optuna.Trial, job: TrialJob) -> TrialRecord:
        """Run ``job`` through the runner, its trial beating as this host's.

        Raises:
            KeyboardInterrupt: After storing the partial record as FAIL and re-enqueueing the params.
            ServiceControlError: The service could not be changed (its drop-in folder became
                unwritable); stored and re-enqueued the same way, and the run stops.
            StudyError: The journal stopped answering during the trial (stored as FAIL with
                ``journal_unreadable``, re-enqueued): the run stops instead of measuring blind.
        """
        opened = self._opened()
        self.progress.trial_start(job)
        begun = self.clock()

        def on_phase(name: str, detail: Any = None) -> None:
            if detail is None:  # a phase begins (main thread); its progress ticks are not stored
                opened.recorder.phase(trial, name)
            self.progress.phase(job, name, detail)

        try:
            with (opened.recorder.interruptible(trial, job, lambda: self.clock() - begun),
                  TrialHeartbeat(opened.study, trial.number, on_reaped=lambda numbers: self.reaped(numbers, True))):
                record = self.runner.run(job, on_phase)
        finally:
            self.progress.trial_aborted()
        opened.recorder.check_journal(trial, job, record)
        self.summary.trials_run += 1
        self.streaks.launch()
        if record.duration_s is None:
            record = record.model_copy(update={"duration_s": self.clock() - begun})
        return record.model_copy(update={"repeat_of": job.repeat_of}) if job.repeat_of is not None else record

    def record(self, trial: optuna.Trial, job: TrialJob, record: TrialRecord) -> TrialRecord:
        """Tell ``record`` (:meth:`tuner.study.record.Recorder.tell`), read the study afresh, call the
        opening's listeners (:mod:`tuner.study.hooks`), tell the progress listener."""
        opened = self._opened()
        record = opened.recorder.tell(trial, record)
        self.view = None
        for listener in opened.after_tell:  # tuner.study.hooks: the deployment's fingerprint, ...
            listener.after_tell(trial.number, record, self.finished())
        self.progress.trial_end(job, record)
        return record

    # ---- stopping ------------------------------------------------------------------------------

    def can_continue(self) -> bool:
        """Whether the stop rules (:mod:`tuner.study.stops`: the trial cap, the budget, the
        maintenance window, which may wait for it to open) leave room for one more trial (else
        :meth:`stop`)."""
        return not self.stop_on(first_stop(self.rules))

    def stop_on(self, stop: Stop | None) -> bool:
        """Whether a rule stops the run (its :class:`~tuner.study.stops.Stop`, else ``None``): its
        reason and line are recorded, the loop ends after this step, and the listener is told."""
        if stop is not None:
            self.summary.stop_reason, self.summary.stop_detail, self.stopped = stop.reason, stop.detail, True
            self.progress.stop(stop.reason, stop.detail)
        return stop is not None

    # ---- shared state --------------------------------------------------------------------------

    def read(self) -> StudyView:
        """This decision's view of the study (read once, until a launch is recorded or the next
        decision begins): on a shared PostgreSQL study each read is a round trip per table. Its
        :attr:`~tuner.study.view.StudyView.space` is the study's space, stored by the baseline.

        Raises:
            StudyError: The study has no baseline (:func:`tuner.study.baseline.stored_space`).
        """
        if self.view is None:
            opened = self._opened()
            space = stored_space(opened.study, self.config.study.name)
            self.view = StudyView.read(opened.study, space, opened.settings, opened.records)
        return self.view

    def finished(self) -> Sequence[tuple[int, TrialRecord]]:
        """``(number, record)`` of the study's finished trials: this decision's view's, or before
        the baseline fixed the space, read now."""
        opened = self.opened
        if opened is None:
            return ()
        if self.view is None and not has_space(opened.study):
            return opened.records.finished(opened.study.get_trials(deepcopy=False))
        return self.read().finished

    def cost_s(self) -> float:
        """The next trial's expected cost in seconds (:meth:`tuner.study.budget.Budget.estimate`)."""
        durations = [r.duration_s or 0.0 for _, r in self.finished() if r.outcome in ("ok", "failed")]
        return Budget.estimate(durations, self.runner.prior_cost_s()).seconds

    @contextlib.contextmanager
    def claim(self, *, reap: bool = True) -> Iterator[Section]:
        """The study's claim lock for one ``with`` block (a no-op off PostgreSQL); yields its
        :class:`~tuner.study.hosts.Section`.

        Other hosts' dead trials are reaped first (unless ``reap`` is false), so their params are
        queued before this host chooses."""
        opened = self._opened()
        with opened.claims.held() as section:
            reaped = reap_stale(opened.study) if reap else []
            if reaped:
                self.view = None
                self.reaped(reaped)
            yield section

    def reaped(self, numbers: list[int], in_trial: bool = False) -> None:
        """Other hosts' dead trials ``numbers`` were failed (their params queued again): counted
        and told (``in_trial``: by this host's trial heartbeat, during a trial)."""
        self.summary.recovered.extend(numbers)
        self.progress.note(None, reaped_text(numbers, self.config.storage.grace_period_s), phase="reaped",
                           in_trial=in_trial)

    def _opened(self) -> Opened:
        if self.opened is None:
            raise RuntimeError("StudyRun.run() has not opened the study yet")
        return self.opened


def run_study(config: TunerConfig, runner: TrialRunner, **options: Any) -> RunSummary:
    """Run (or resume) the study until the budget, the trial cap, or the search runs out.

    ``StudyRun(config, runner, **options).run()``; see :class:`StudyRun` for the options and
    :meth:`StudyRun.run` for the result and the raised errors.
    """
    return StudyRun(config, runner, **options).run()
