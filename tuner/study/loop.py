"""The tuning run: stop rules, then view → decide → claim → run → record, until a stop.

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
from datetime import datetime, timedelta
from typing import Any

import optuna
from sqlalchemy.exc import SQLAlchemyError

from tuner.config import TunerConfig, check_url_matches_port
from tuner.errors import ServiceControlError, StudyError
from tuner.load.workloads import build_workload
from tuner.records import StudyInfo, TrialRecord, now_iso
from tuner.sglang.failures import FailureClass
from tuner.study.baseline import claim_baseline, could_not_start, fix_space
from tuner.study.best import best_by, probe_floor
from tuner.study.budget import Budget, budget_name, require_one_trial, restore_cost_s
from tuner.study.calibration import ModelSettings
from tuner.study.decide import Decider, Skip
from tuner.study.decide.chain import build_chain
from tuner.study.decide.sampler import Draw, ProposalMirror, Sampler
from tuner.study.fingerprint import DeploymentKey, deployment_key, fingerprint_of, save_fingerprint, workload_key
from tuner.study.hostcheck import ranks_of
from tuner.study.hosts import (
    ClaimLock,
    Section,
    TrialHeartbeat,
    claim_trial,
    host_name,
    is_postgres,
    reap_stale,
    recover_own,
    same_environment,
    schema_lock,
    study_heartbeat,
)
from tuner.study.job import TrialJob, TrialRunner, quality_context
from tuner.study.optuna_io import (
    KIND_ATTR,
    PHASE_ATTR,
    PREDICTION_ATTR,
    REPEAT_ATTR,
    SPACE_ATTR,
    ensure_study_info,
    make_sampler,
    open_study,
    study_info,
)
from tuner.study.outage import ResultJournal, db_reason, impatient, storage_refuses
from tuner.study.progress import Progress, RunProgress, RunSummary
from tuner.study.record import Recorder, server_reason
from tuner.study.space import Space
from tuner.study.storage import (
    check_run_storage,
    check_storage_folder,
    open_artifacts_folder,
    open_storage,
    show_command,
    storage_errors,
    study_storage_url,
)
from tuner.study.view import RecordCache, StudyView
from tuner.study.warm import Prior, is_fresh, warm_start
from tuner.units import MaintenanceWindow, format_duration

__all__ = ["MAX_INVALID_IN_A_ROW", "MAX_REPEATS_IN_A_ROW", "MAX_SKIPS_IN_A_ROW", "Streaks", "StudyRun", "restored_text",
           "run_study"]

_log = logging.getLogger(__name__)

MAX_INVALID_IN_A_ROW = 3
"""Launched trials failing with ``invalid_arguments`` one after another that stop the run: the
command itself is wrong (or the environment), not the candidate."""
MAX_REPEATS_IN_A_ROW = 200
"""The sampler's draws in a row of configs measured or skipped already (no launch and no new
skip between them) after which the search counts as exhausted: it finds nothing new in the
space. Skips of new configs do not count: a sampler exploring below the capacity band is not
done (with four hosts, 200 skips in a row happened mid-study)."""
MAX_SKIPS_IN_A_ROW = 50
"""New skips in a row (configs skipped without a restart, each stored once) with no launch
between them, on any host of the study, after which the run stops as exhausted: the planner
has nothing left and every config the sampler draws is proved or predicted not worth a
restart. This is the rule that bounds skips, so the trial cap (``--trials``) counts launches
only. Why 50: with a bound of 100, the decision trace's studies (``tests/study/golden/
decision-trace.txt``, 36 studies at 20 launches) made 33 launches after 50 or more new skips in a
row, and by their figures one changed the chosen best (the planner now proposes that config at
launch 5); the trace was 7.2k lines and 4 CPU minutes, 3.5k and 2 with 50. Without the rule,
studies whose useful configs were spent drew thousands of new skips (every fraction step × chunk
× slot count the screens refuse) before :data:`MAX_REPEATS_IN_A_ROW` stopped them."""


@dataclass
class Streaks:
    """The loop's counts in a row that stop a run (the state of its stop rules).

    Attributes:
        invalid: Launches in a row that failed ``invalid_arguments`` (:data:`MAX_INVALID_IN_A_ROW`).
        repeats: Sampler draws in a row of configs measured or skipped already, with no launch and
            no new skip between them (:data:`MAX_REPEATS_IN_A_ROW`).
        skips: New skips in a row with no launch of any host between them (:data:`MAX_SKIPS_IN_A_ROW`).
        launched_seen: The study's launched trials (every host's) when ``skips`` last counted.
    """

    invalid: int = 0
    repeats: int = 0
    skips: int = 0
    launched_seen: int = 0


@dataclass(frozen=True)
class _Options:
    """The run's options (see :class:`StudyRun`)."""

    budget_s: float | None
    max_trials: int | None
    allow_mixed_environment: bool
    use_planner: bool
    journal: ResultJournal | None


@dataclass(frozen=True)
class _Opened:
    """What :meth:`StudyRun.open` opened: the study and what works on it."""

    study: optuna.Study
    claims: ClaimLock
    recorder: Recorder
    shared: bool
    environment: dict[str, Any]
    context_tokens: int
    settings: ModelSettings
    records: RecordCache
    deployment: DeploymentKey
    workload: str
    prior: Prior | None = None


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
        self.opened: _Opened | None = None
        self.view: StudyView | None = None  # this decision's read of the study (None: read again)
        self.streaks = Streaks()
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
        objective = self.config.objective
        self.summary.best = best_by(self.finished(), objective)
        self.summary.elapsed_s = self.clock() - started
        return self.summary

    def open(self) -> _Opened:
        """Check storage and target, open the study, store or check its environment, recover
        RUNNING trials, check the budget holds one trial, and open the artifact store."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        config, url = self.config, self.summary.storage_url
        check_storage_folder(url, config.study.name)
        check_run_storage(url, config.study.name)
        check_url_matches_port(self.runner.target().get("url"), self.runner.baseline_argv())
        own_beat = (config.storage.heartbeat_interval_s, config.storage.grace_period_s)
        storage = open_storage(url, heartbeat_interval_s=own_beat[0], grace_period_s=own_beat[1],
                               outage_s=config.storage.outage_s)
        environment = self.runner.environment()
        context_tokens = config.objective.context_tokens or build_workload(config.workload, seed=config.study.seed).context_tokens
        new = StudyInfo(environment=environment, target=self.runner.target(), baseline_argv=self.runner.baseline_argv(),
                        policy=config.objective.model_dump(mode="json"), context_tokens=context_tokens,
                        config_path=config.path)
        with schema_lock(url):  # hosts starting together: one creates the study and its info
            study = open_study(config.study.name, storage, make_sampler(config.study.sampler, config.study.seed))
            info = ensure_study_info(study, new, allow_mixed=self.options.allow_mixed_environment)
            beat = study_heartbeat(study, *own_beat)
        if beat != own_beat:  # one rule per study for when a trial is dead: the study's
            self.progress.note(None, f"the study's trials beat every {beat[0]} s with a {beat[1]} s grace period "
                               f"(set by its first host); this host's [storage] {own_beat[0]} s / {own_beat[1]} s "
                               "are not used")
            storage = open_storage(url, heartbeat_interval_s=beat[0], grace_period_s=beat[1],
                                   outage_s=config.storage.outage_s)
            study = open_study(config.study.name, storage, make_sampler(config.study.sampler, config.study.seed))
        shared = is_postgres(storage)
        recorder = Recorder(study, open_artifacts_folder(config, url), self.summary.host, environment, journal=self.options.journal)
        replayed = recorder.replay()  # before recovery: a kept result is stored, not re-run
        if replayed:
            self.progress.note(None, f"stored the result(s) of trial(s) {', '.join(map(str, replayed))} that the "
                               "last run kept in its result journal but did not finish storing (it was stopped, or "
                               "the database did not answer)", phase="recovered")
        self.summary.recovered = recover_own(study, self.summary.host, shared=shared) + reap_stale(study)
        context_tokens = info.context_tokens or context_tokens
        self.opened = _Opened(study=study, claims=ClaimLock.of(study), recorder=recorder, shared=shared,
                              environment=environment, context_tokens=context_tokens,
                              settings=ModelSettings.for_config(config, context_tokens, environment.get("sglang_version")),
                              records=RecordCache(),
                              deployment=deployment_key(environment, self.runner.baseline_argv(), config),
                              workload=workload_key(config, context_tokens))
        if self.options.budget_s is not None:
            require_one_trial(self.options.budget_s, self.cost_s(), reserve_s=config.budget.restore_reserve_s,
                              name=budget_name(config, self.options.budget_s))
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
        """The next trial to launch and its job, or ``None`` (a skip was stored, or the sampler's
        draws of this decision were all skipped).

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
        streaks = self.streaks
        if not stored:
            streaks.repeats += 1
            if streaks.repeats >= MAX_REPEATS_IN_A_ROW:
                self.stop("exhausted", f"the sampler drew {streaks.repeats} configs in a row that were measured "
                                       "or skipped already: nothing new in the space")
            return
        streaks.repeats = 0
        self.summary.count_skip(text)
        self.progress.skip(number, params, kind, text)
        launched = self._launched()
        if launched != streaks.launched_seen:  # another host launched since: its result may open new configs
            streaks.launched_seen, streaks.skips = launched, 0
        streaks.skips += 1
        if streaks.skips >= MAX_SKIPS_IN_A_ROW:
            self.stop("exhausted", f"{streaks.skips} new configs in a row were skipped without a restart "
                                   "(proved or predicted not worth one) and no host launched one: nothing left "
                                   "worth a launch")

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
        self.streaks.repeats = self.streaks.skips = 0
        if record.duration_s is None:
            record = record.model_copy(update={"duration_s": self.clock() - begun})
        return record.model_copy(update={"repeat_of": job.repeat_of}) if job.repeat_of is not None else record

    def record(self, trial: optuna.Trial, job: TrialJob, record: TrialRecord) -> TrialRecord:
        """Tell ``record`` (:meth:`tuner.study.record.Recorder.tell`), read the study afresh, tell
        the listener."""
        opened = self._opened()
        record = opened.recorder.tell(trial, record)
        self.view = None
        if record.outcome in ("ok", "failed"):  # the deployment's fingerprint, with this start's facts
            fingerprint = fingerprint_of(self.config.study.name, opened.deployment, self.finished(),
                                         workload=opened.workload, context_tokens=opened.context_tokens)
            try:
                with impatient():  # for later studies only: a run never waits for the database for it
                    save_fingerprint(opened.study, fingerprint)
            except (optuna.exceptions.StorageInternalError, SQLAlchemyError) as err:
                _log.warning("trial %d: fingerprint not stored: %s", trial.number, db_reason(err))
        self.progress.trial_end(job, record)
        return record

    # ---- stopping ------------------------------------------------------------------------------

    def can_continue(self) -> bool:
        """Whether the trial cap (launches) and the budget leave room for one more trial (else
        :meth:`stop`)."""
        max_trials = self.options.max_trials
        if max_trials is not None and self.summary.trials_run >= max_trials:
            self.stop("trials")
            return False
        if not self.budget.fits(self.cost_s()):
            self.stop("budget")
            return False
        return self.in_window()

    def in_window(self) -> bool:
        """``[service] window``: whether the next trial may start now. It may when the window is
        open and the trial's estimated cost (:meth:`cost_s`) plus the final restore's
        (:func:`tuner.study.budget.restore_cost_s`) end before it closes, so no restart (the
        trial's nor the restore's) falls outside it. Otherwise the run waits for the next opening
        (``outside_window = "wait"``, the budget holding the wait and a trial, the window long
        enough for both) or stops as ``window``; a line says which."""
        service = self.config.service
        if service.window is None:
            return True
        window = MaintenanceWindow.parse(service.window)
        now = datetime.now()
        trial_s, restore_s = self.cost_s(), restore_cost_s(self.config)
        left_s = window.seconds_until_close(now)
        if left_s >= trial_s + restore_s:
            return True
        if left_s > 0:
            where = (f"the maintenance window {window.text} (local time) closes in {format_duration(left_s)}, before the "
                     f"next trial (about {format_duration(trial_s)}) and the final restore (about "
                     f"{format_duration(restore_s)}) would end")
            wait_s = left_s + window.seconds_until_open(now + timedelta(seconds=left_s + 1)) + 1
        else:
            where = f"outside the maintenance window {window.text} (local time)"
            wait_s = window.seconds_until_open(now)
        fits = window.length_s() >= trial_s + restore_s
        if service.outside_window == "wait" and fits and self.budget.fits(wait_s + trial_s):
            self.progress.note(None, f"{where}: waiting {format_duration(wait_s)} until it opens; no restart before",
                               phase="waiting")
            time.sleep(wait_s)
            return True
        why = ("[service] outside_window = \"stop\"" if service.outside_window == "stop"
               else f"the window ({format_duration(window.length_s())}) is shorter than a trial and the restore" if not fits
               else f"the budget does not hold the {format_duration(wait_s)} until it opens and a trial")
        self.progress.note(None, f"{where} ({why}): stopping, no restart started")
        self.stop("window")
        return False

    def check_invalid_streak(self, number: int, record: TrialRecord) -> None:
        """Stop the run after :data:`MAX_INVALID_IN_A_ROW` ``invalid_arguments`` failures in a row.

        Raises:
            StudyError: The streak is reached (the message quotes the server's reason).
        """
        invalid = record.outcome == "failed" and record.failure_class is FailureClass.INVALID_ARGUMENTS
        self.streaks.invalid = self.streaks.invalid + 1 if invalid else 0
        if self.streaks.invalid >= MAX_INVALID_IN_A_ROW:
            raise StudyError(
                f"{self.streaks.invalid} trials in a row (the last {number}) were rejected as invalid_arguments: "
                f"{server_reason(record)}; the service was restored to its original flags",
                hint=f"fix the service command or the [space] and run again (`{show_command(self.config, self.summary.storage_url, number)}` has the log)",
            )

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

    def _opened(self) -> _Opened:
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
