"""The tuning run: stop rules, then view → decide → claim → run → record, until a stop.

The stop rules are objects of their own (:mod:`tuner.study.stops`: the trial cap, the budget, the
maintenance window, the streaks), asked in one place (:meth:`StudyRun.can_continue`).

One run of ``tuner run`` is one :class:`StudyRun`, in the shape of Optuna's own ``_optimize``: open
(or resume) the study, check the environment, recover trials a killed run left RUNNING, measure
the baseline (the unit's current flags; its record fixes the space), then repeat until the budget
or the trial cap is spent::

    view     one read of the study (every host's trials): tuner.study.view.StudyView
    decide   the queue, the planner's proposers, else the sampler: tuner.study.decide
    claim    screens, then under the study's claim lock: measured or claimed by another host?
    run      the runner (tuner.trial.TrialExecutor) restarts the service and measures
    record   tell Optuna: tuner.study.record.Recorder

The loop chooses no parameter and stores nothing itself: the proposers and screens decide, the
recorder stores, the hosts module coordinates hosts (:mod:`tuner.study.hosts`), and progress goes
to a listener (:class:`tuner.study.progress.RunProgress`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import optuna
from sqlalchemy.exc import SQLAlchemyError

from tuner.config import TunerConfig
from tuner.errors import ServiceControlError, StudyError
from tuner.records import TrialRecord, now_iso
from tuner.sglang.failures import FailureClass
from tuner.study.baseline import claim_baseline, could_not_start, fix_space
from tuner.study.best import best_by, probe_floor
from tuner.study.budget import Budget, budget_name, require_one_trial
from tuner.study.decide import Decider, Skip
from tuner.study.decide.chain import build_chain
from tuner.study.decide.sampler import Draw, ProposalMirror, Sampler
from tuner.study.hostcheck import ranks_of
from tuner.study.hosts import (
    Reaped,
    Section,
    TrialHeartbeat,
    claim_trial,
    host_name,
    reap_stale,
    same_environment,
)
from tuner.study.job import TrialJob, TrialRunner, quality_context
from tuner.study.optuna_io import (
    KIND_ATTR,
    PHASE_ATTR,
    PREDICTION_ATTR,
    REPEAT_ATTR,
    SPACE_ATTR,
    make_sampler,
    study_info,
)
from tuner.study.outage import ResultJournal, db_reason, impatient, storage_refuses
from tuner.study.progress import Progress, RunProgress, RunSummary
from tuner.study.record import server_reason
from tuner.study.session import Opened, open_run
from tuner.study.space import Space
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
)
from tuner.study.storage import (
    show_command,
    storage_errors,
    study_storage_url,
)
from tuner.study.view import StudyView
from tuner.study.warm import is_fresh, warm_start
from tuner.units import MaintenanceWindow, format_duration

__all__ = ["MAX_INVALID_IN_A_ROW", "MAX_REPEATS_IN_A_ROW", "MAX_SKIPS_IN_A_ROW", "Streaks", "StudyRun", "restored_text",
           "run_study"]

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
        if budget_s is None and max_trials is None:
            raise StudyError("no --budget and no --trials given", hint="pass e.g. --budget 4h or --trials 20")
        self.config = config
        self.runner = runner
        self.options = _Options(budget_s, max_trials, allow_mixed_environment, use_planner, journal)
        self.clock = clock
        self.budget = Budget(budget_s, reserve_s=config.budget.restore_reserve_s, clock=clock)
        self.summary = RunSummary(study_name=config.study.name, storage_url=storage_url or study_storage_url(config),
                                  host=host_name())
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
        started = self.clock()
        with storage_errors(self.summary.storage_url):
            opened = self.open()
            self.summary.baseline = self.baseline()
            if not self.stopped:
                self.warm_start()
            try:
                if not self.stopped:  # a stop before the baseline (the window) leaves nothing to decide
                    decider, sampler = self.decider(self.space())
                while not self.stopped and self.can_continue():
                    step = self.decide(decider, sampler)
                    if step is not None:
                        self.check_invalid_streak(step[0].number, self.launch(*step))
                opened.recorder.flush()
            finally:
                opened.recorder.close()  # an interrupted run's last skips are stored, not raised over it
        self.summary.best = best_by(self.finished(), self.config.objective)
        self.summary.elapsed_s = self.clock() - started
        return self.summary

    def open(self) -> Opened:
        """Open the run (:func:`tuner.study.session.open_run`), then check the budget holds one trial."""
        self.opened = open_run(self.config, self.runner, self.summary, self.progress,
                               allow_mixed_environment=self.options.allow_mixed_environment, journal=self.options.journal)
        if self.options.budget_s is not None:
            require_one_trial(self.options.budget_s, self.cost_s(), reserve_s=self.config.budget.restore_reserve_s,
                              name=budget_name(self.config, self.options.budget_s))
        return self.opened

    def baseline(self) -> tuple[int, TrialRecord] | None:
        """The study's baseline (the service's own flags), measured now when the study has none of
        this environment (once per study: a host waits while another measures it). Its record
        fixes the space (:func:`tuner.study.baseline.fix_space`).

        Raises:
            StudyError: The baseline could not start for a reason other than memory.
        """
        opened = self._opened()
        study, environment = opened.study, opened.environment
        trial, found = claim_baseline(study, environment, self.summary.host, claim=self.claim,
                                      can_continue=self.can_continue, own_environment=self._own_environment,
                                      on_wait=lambda text: self.progress.note(None, text, phase="waiting"))
        if trial is None:
            return found
        job = TrialJob(number=trial.number, kind="baseline", context_tokens=opened.context_tokens, started_at=now_iso())
        record = self.run_trial(trial, job)
        space = fix_space(study, trial, record, self.config, environment, opened.context_tokens,
                          host=self.runner.host_memory(), ranks=ranks_of(self.runner.baseline_argv()),
                          own_environment=self._own_environment(), argv=self.runner.baseline_argv())
        self.progress.note(trial.number, f"hierarchical cache {space.hicache_reason}")
        left_out = [reason.split(":", 1)[0] for reason in space.lever_reasons if ": not derived:" in reason]
        for reason in space.lever_reasons:
            if ": not derived:" not in reason:
                self.progress.note(trial.number, f"structural lever {reason}")
        if left_out:  # one short line; `tuner run --dry-run` prints each reason with its source
            self.progress.note(trial.number, f"structural levers not derived: {', '.join(left_out)} "
                                             "(`tuner run --dry-run` says why)")
        record = self.record(trial, job, record)
        if could_not_start(record):
            raise StudyError(
                f"the baseline (trial {trial.number}, the service's own flags) could not start "
                f"({record.failure_class.value if record.failure_class else 'failed'}): "
                f"{server_reason(record)}; the service was restored to its original flags",
                hint=f"fix the service command or environment and run again (`{show_command(self.config, self.summary.storage_url, trial.number)}` has the log)",
            )
        return trial.number, record

    def space(self) -> Space:
        """The study's resolved space (stored when its baseline was measured).

        Raises:
            StudyError: The study has no baseline to derive it from.
        """
        data = self._opened().study.user_attrs.get(SPACE_ATTR)
        if data is None:
            raise StudyError(
                f"study {self.config.study.name!r} has no baseline trial to derive its search space from",
                hint="run again with a budget long enough for one trial",
            )
        return Space.model_validate(data)

    def decider(self, space: Space) -> tuple[Decider, Sampler]:
        """This run's decision chain (:func:`tuner.study.decide.chain.build_chain`); on a shared
        study each host's sampler has a seed of its own."""
        opened = self._opened()
        seed = self.config.study.seed + (zlib.crc32(self.summary.host.encode()) % 1_000_003 if opened.shared else 0)
        mirror = ProposalMirror(opened.study.directions, make_sampler(self.config.study.sampler, seed), space,
                                self.summary.host)
        if opened.prior is not None and opened.prior.trials:
            mirror.add_prior(opened.prior.trials)
        return build_chain(self.config, mirror, read_host=self.runner.host_memory,
                           version=str(opened.environment.get("sglang_version") or "0.5.5"),
                           argv=self.runner.baseline_argv(), use_planner=self.options.use_planner, on_skip=self.on_draw,
                           gpu=opened.environment.get("gpu_name"))

    def warm_start(self) -> None:
        """Reuse another study's fingerprint of this deployment (:mod:`tuner.study.warm`): the
        models' settings start from its checks; the sampler gets its measured trials."""
        opened = self._opened()
        baseline = self.summary.baseline
        with self.claim(reap=False):  # hosts starting together: one looks up and enqueues, the others read it
            prior = warm_start(opened.study, self.summary.storage_url, opened.deployment, workload=opened.workload,
                               baseline=baseline[1] if baseline else None, config=self.config, space=self.space(),
                               fresh=is_fresh(self.finished()))
        self.opened = dataclasses.replace(opened, prior=prior, settings=prior.settings(opened.settings, self.space()))
        self.view = None
        if prior.warm.source is not None or prior.warm.not_used:  # nothing found: nothing to say
            self.progress.note(None, prior.warm.line())

    # ---- one step: decide, claim ------------------------------------------------------------------

    def decide(self, decider: Decider, sampler: Sampler) -> tuple[optuna.Trial, TrialJob] | None:
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
        kind = str(trial.user_attrs.get(KIND_ATTR, "sampled"))
        params = view.space.suggest(trial)
        prediction = dict(trial.user_attrs.get(PREDICTION_ATTR) or {})
        repeat_of = trial.user_attrs.get(REPEAT_ATTR)
        job = TrialJob(number=trial.number, kind=kind, params=params, prediction=prediction,
                       context_tokens=opened.context_tokens, started_at=now_iso(),
                       capacity_floor=0 if repeat_of is not None else probe_floor(view.finished, self.config.budget.probe_only_below,
                                                                        self.config.objective.capacity),
                       repeat_of=None if repeat_of is None else int(repeat_of), **quality_context(view.finished))
        skip = None if repeat_of is not None else decider.screen(params, kind, view)
        if skip is None:  # RUNNING with its params, host and heartbeat before the lock goes
            found = claim_trial(opened.study, trial, self.summary.host, opened.environment, hold=self.claim,
                                check=repeat_of is None)
            if isinstance(found, Reaped):  # another host failed it while this one chose: choose again
                return None
            skip = Skip(*found) if found is not None else None
        if skip is not None:
            opened.recorder.skip(trial, params, kind, prediction, skip)
            self.count_skip(trial.number, params, kind, skip.reason)
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
        self.stop_on(self.streaks.skip(self._launched()))

    def _launched(self) -> int:
        """The study's launched trials (finished with a result, every host's) in this decision's
        view: a change resets the skip streak."""
        return sum(1 for _, r in self.finished() if r.outcome in ("ok", "failed"))

    # ---- run, record ------------------------------------------------------------------------------

    def launch(self, trial: optuna.Trial, job: TrialJob) -> TrialRecord:
        """Run ``job`` through the runner and record it (a restart of the service); see
        :meth:`run_trial` for the errors."""
        return self.record(trial, job, self.run_trial(trial, job))

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
                try:
                    with impatient():  # for readers only: a trial never waits for the database for it
                        trial.set_user_attr(PHASE_ATTR, name)
                except (optuna.exceptions.StorageInternalError, SQLAlchemyError) as err:
                    # a full disk is named once, by the result's write that fails after it
                    (_log.debug if storage_refuses(err) else _log.warning)(
                        "trial %d: phase %s not stored: %s", trial.number, name, db_reason(err))
            self.progress.phase(job, name, detail)

        def on_reaped(numbers: list[int]) -> None:
            self.summary.recovered.extend(numbers)
            self.progress.note(None, self._reaped_text(numbers), phase="reaped", in_trial=True)

        try:
            with TrialHeartbeat(opened.study, trial.number, on_reaped=on_reaped):
                record = self.runner.run(job, on_phase)
        except (KeyboardInterrupt, ServiceControlError) as err:
            opened.recorder.interrupted(trial, job, err, elapsed_s=self.clock() - begun)
            raise
        finally:
            self.progress.trial_aborted()
        if record.failure_class is FailureClass.JOURNAL_UNREADABLE:
            raise opened.recorder.journal_lost(trial, job, record)
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

    def check_invalid_streak(self, number: int, record: TrialRecord) -> None:
        """Stop the run after :data:`MAX_INVALID_IN_A_ROW` ``invalid_arguments`` failures in a row.

        Raises:
            StudyError: The streak is reached (the message quotes the server's reason).
        """
        if self.streaks.result(record):
            raise StudyError(
                f"{self.streaks.invalid} trials in a row (the last {number}) were rejected as invalid_arguments: "
                f"{server_reason(record)}; the service was restored to its original flags",
                hint=f"fix the service command or the [space] and run again (`{show_command(self.config, self.summary.storage_url, number)}` has the log)",
            )

    def stop_on(self, stop: Stop | None) -> bool:
        """:meth:`stop` on a rule's :class:`~tuner.study.stops.Stop`; whether there was one."""
        if stop is not None:
            self.stop(stop.reason, stop.detail)
        return stop is not None

    def stop(self, reason: str, detail: str = "") -> None:
        """Record the stop reason (and ``detail``, a line saying why), end the loop after this
        step, and tell the listener."""
        self.summary.stop_reason = reason
        self.summary.stop_detail = detail
        self.stopped = True
        self.progress.stop(reason, detail)

    # ---- shared state --------------------------------------------------------------------------

    def read(self) -> StudyView:
        """This decision's view of the study (read once, until a launch is recorded or the next
        decision begins): on a shared PostgreSQL study each read is a round trip per table."""
        if self.view is None:
            opened = self._opened()
            self.view = StudyView.read(opened.study, self.space(), opened.settings, opened.records)
        return self.view

    def finished(self) -> Sequence[tuple[int, TrialRecord]]:
        """``(number, record)`` of the study's finished trials: this decision's view's, or before
        the baseline fixed the space, read now."""
        opened = self.opened
        if opened is None:
            return ()
        if self.view is None and SPACE_ATTR not in opened.study.user_attrs:
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
                self.summary.recovered.extend(reaped)
                self.progress.note(None, self._reaped_text(reaped), phase="reaped")
            yield section

    def _reaped_text(self, numbers: list[int]) -> str:
        return (f"trial(s) {numbers} of another host had no heartbeat for {self.config.storage.grace_period_s} s: "
                "marked FAIL, params queued again")

    def _own_environment(self) -> bool:
        """Whether this run's environment is the study's own (not a mixed-in host)."""
        opened = self._opened()
        info = study_info(opened.study)
        return info is None or same_environment(info.environment, opened.environment)

    def _opened(self) -> Opened:
        if self.opened is None:
            raise RuntimeError("StudyRun.open() was not called")
        return self.opened


def run_study(config: TunerConfig, runner: TrialRunner, **options: Any) -> RunSummary:
    """Run (or resume) the study until the budget, the trial cap, or the search runs out.

    ``StudyRun(config, runner, **options).run()``; see :class:`StudyRun` for the options and
    :meth:`StudyRun.run` for the result and the raised errors.
    """
    return StudyRun(config, runner, **options).run()


def restored_text(config: TunerConfig, when: datetime) -> str:
    """How the run's final restore ended, for :attr:`RunSummary.service`: ``restored to its
    original flags``, and under ``[service] window`` the time it ended (``when``, local) and whether
    inside the window or how long after it closed (a trial that ran past its estimate)."""
    text = "restored to its original flags"
    if config.service.window is None:
        return text
    window = MaintenanceWindow.parse(config.service.window)
    late_s = window.seconds_since_close(when)
    if late_s <= 0:
        return f"{text} at {when:%H:%M:%S}, inside the maintenance window {window.text}"
    return (f"{text} at {when:%H:%M:%S}, {format_duration(late_s)} after the maintenance window {window.text} "
            "closed (the last trial ran past its estimate)")
