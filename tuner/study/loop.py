"""The tuning run: the loop that asks, skips or launches, tells, and stops inside the budget.

One run of ``tuner run`` is one :class:`StudyRun`: open (or resume) the study, check the
environment, recover trials a killed run left RUNNING, measure the baseline (the unit's current
flags), then repeat until the budget or the trial cap is spent: take the next enqueued trial, else
the planner's memory-model candidate (:class:`tuner.study.planner.Planner`), else the sampler's;
skip without a restart what an earlier failure proves infeasible (or what was already measured);
run the rest through a :class:`TrialRunner`; tell Optuna. The runner is the seam:
:class:`tuner.trial.TrialExecutor` runs each trial on a server under test (a real or simulated
service restarted by its launcher; in the tests, the simulator's offline evaluation).

The steps, one method each (the shape of Optuna's own ``_optimize``/``_run_trial``)::

    run()        open → baseline() → while can_continue(): next_trial() → skip() or launch() → summary
    baseline()   the service's own flags, once per study; its resolved knobs fix the space
    next_trial() ask Optuna, after enqueueing the planner's candidate when nothing waits
    skip()       tell PRUNED with the proving trial (no restart)
    launch()     run the trial through the runner, then tell()
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

import optuna
from optuna.artifacts import FileSystemArtifactStore, upload_artifact
from optuna.trial import TrialState
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import SQLAlchemyError

from tuner.config import TunerConfig, check_url_matches_port
from tuner.errors import ServiceControlError, StudyError, first_line
from tuner.load.workloads import build_workload, estimate_reuse
from tuner.records import Constraints, StudyInfo, TrialRecord
from tuner.sglang.failures import STARTUP_MEMORY_FAILURES, FailureClass
from tuner.sglang.flags import FlagTable
from tuner.sglang.hicache import HostMemory
from tuner.sglang.logs import log_error_line
from tuner.sglang.memory import KVCapacityModel, must_fail
from tuner.study.best import BestChoice, choose_best
from tuner.study.budget import Budget, reachable_slots, require_one_trial
from tuner.study.hostcheck import host_skip_reason, ranks_of
from tuner.study.hosts import (
    HOST_ATTR,
    ClaimLock,
    TrialHeartbeat,
    heartbeat_interval,
    host_name,
    is_postgres,
    reap_stale,
    recover_own,
    same_environment,
    schema_lock,
)
from tuner.study.optuna_io import (
    ENVIRONMENT_ATTR,
    KIND_ATTR,
    PHASE_ATTR,
    PREDICTION_ATTR,
    SPACE_ATTR,
    add_record,
    check_environment,
    fail_trial,
    make_sampler,
    open_study,
    record_of,
    records,
    save_study_info,
    set_baseline_params,
    study_info,
    tell_record,
)
from tuner.study.planner import Candidate, Planner
from tuner.study.proposals import ProposalMirror, SkipWriter
from tuner.study.space import HICACHE_KNOBS, HiCacheChoice, Space, config_key, decide_hicache, resolve_space
from tuner.study.storage import (
    check_artifacts_folder,
    check_run_storage,
    check_storage_folder,
    open_storage,
    storage_errors,
    study_artifacts_dir,
    study_storage_url,
)

__all__ = [
    "MAX_INVALID_IN_A_ROW",
    "TrialJob",
    "TrialRunner",
    "PhaseProgress",
    "Progress",
    "RunSummary",
    "StudyRun",
    "run_study",
    "skip_reason",
    "describe",
    "resolve_study_space",
    "study_hicache",
    "claimed_reason",
    "quote_server_log",
]

MAX_INVALID_IN_A_ROW = 3
"""Launched trials failing with ``invalid_arguments`` one after another that stop the run: the
command itself is wrong (or the environment), not the candidate."""
MAX_NOISE_REPEATS = 2
"""Configs a study re-measures at most to measure the throughput noise (:meth:`StudyRun.noise_repeat`)."""
LATE_ATTR = "tuner.stored_late_for"
"""Trial user attribute: the trial (marked FAIL by another host while this one was cut off from the
database) whose result this trial stores."""
REPEAT_ATTR = "tuner.repeat_of"
"""Trial user attribute: the trial a deliberate re-measurement repeats."""
_PROPOSALS_PER_DECISION = 16
"""The sampler's proposals screened per decision before the loop reads the study again."""
MAX_REPEATS_IN_A_ROW = 200
"""The sampler's draws in a row of configs measured or skipped already (no launch and no new
skip between them) after which the search counts as exhausted: it finds nothing new in the
space. Skips of new configs do not count: a sampler exploring below the capacity band is not
done (with four hosts, 200 skips in a row happened mid-study)."""

_log = logging.getLogger(__name__)


class TrialJob(BaseModel):
    """What the runner is asked to do for one trial.

    Attributes:
        number: Optuna trial number.
        kind: ``baseline``, ``predicted``, ``sampled`` or ``enqueued``.
        params: Knobs to set by SGLang field name; empty for the baseline (the argv as it is).
        prediction: The planner's prediction, stored in the record.
        context_tokens: The context length of context capacity.
        capacity_floor: Capacity-first fidelity: when the boot probe shows a context capacity
            below this, the full load is skipped (0 = always load).
        started_at: ISO time the trial started.
        repeat_of: The trial this one re-measures (the noise), or ``None``.
    """

    model_config = ConfigDict(frozen=True)

    number: int
    kind: str
    params: dict[str, Any] = Field(default_factory=dict)
    prediction: dict[str, Any] = Field(default_factory=dict)
    context_tokens: int
    capacity_floor: int = 0
    started_at: str = ""
    repeat_of: int | None = None


class TrialRunner(Protocol):
    """Runs one trial end to end and returns its record (objectives, constraints, everything)."""

    def environment(self) -> dict[str, Any]:
        """``sglang_version``, ``gpu_name``, ``gpu_count``, ``driver_version``, ``model``, and
        ``gpu_total_mib`` when known."""
        ...

    def target(self) -> dict[str, Any]:
        """``launcher``, ``unit`` or ``command``, ``url``."""
        ...

    def baseline_argv(self) -> list[str]:
        """The command line the service runs before the study."""
        ...

    def prior_cost_s(self) -> float:
        """The cost of one trial in seconds before any history exists."""
        ...

    def run(self, job: TrialJob, on_phase: Callable[..., None]) -> TrialRecord:
        """Run ``job``; call ``on_phase(name)`` as each phase starts, and ``on_phase(name,
        PhaseProgress(...))`` as a long phase advances (optional). Never raises for a failed
        server: a failure is a record with ``outcome="failed"``."""
        ...

    # Optional: ``host_memory() -> tuner.sglang.hicache.HostMemory | None``, the host's reading
    # before a launch; a runner without it gets no host-memory check (see :meth:`StudyRun.host_check`).


class PhaseProgress(BaseModel):
    """How far a long phase has come (what the runner can tell; every field optional).

    Attributes:
        line: The last SGLang log line of a start (``Load weight end. ...``), ANSI and prefixes stripped.
        stage: The startup stage that line marks (:attr:`tuner.sglang.logs.LogWatcher.phase`).
        requests_done: Requests finished (ok or errored) in a load phase so far.
        requests_expected: Requests the phase is expected to finish (a closed loop's measured
            window holds at least one per client stream; ``None`` when not known).
        elapsed_s: Seconds since the phase began.
        duration_s: The phase's planned length in seconds (``None`` when open-ended).
    """

    model_config = ConfigDict(frozen=True)

    line: str | None = None
    stage: str | None = None
    requests_done: int | None = None
    requests_expected: int | None = None
    elapsed_s: float | None = None
    duration_s: float | None = None


class Progress(BaseModel):
    """A progress event for the CLI (and ``tuner run --json-progress``, one JSON object per event).

    Attributes:
        event: ``trial_start``, ``phase`` (a phase begins or advances), ``trial_end``, ``skip``,
            ``stop``, ``note`` (a decision worth a line, e.g. whether the hierarchical cache is
            searched and why).
        number: Trial number (Optuna); ``None`` for a note about the shared study (waiting for
            another host's baseline, another host's dead trial reaped).
        kind: ``baseline``, ``predicted``, ``sampled`` or ``enqueued`` (trial events).
        index: This run's trial count so far (1-based; skips included).
        launch: This run's launches (restarts) so far, the one in flight included.
        expected: About how many launches this run will make in all (``None``: unbounded): from
            the budget left and the study's measured trial costs, recomputed only when a trial
            starts, ends or is skipped (never mid-trial), and never below ``launch``.
        flags: The tuned flags of the trial under test (SGLang field names; empty for the
            baseline before it resolved them).
        phase: The current phase (``render``, ``start``, ``probe``, ``measure``, ``stress``, ``record``).
        detail: How far the phase has come (:class:`PhaseProgress`), when the runner says.
        eta_s: Seconds left in the budget.
        message: One line for the user.
    """

    model_config = ConfigDict(frozen=True)

    event: str
    number: int | None = None
    kind: str | None = None
    index: int = 0
    launch: int = 0
    expected: int | None = None
    flags: dict[str, Any] = Field(default_factory=dict)
    phase: str | None = None
    detail: PhaseProgress | None = None
    eta_s: float | None = None
    message: str = ""


class RunSummary(BaseModel):
    """What a run did and found.

    Attributes:
        study_name: The study.
        storage_url: Where it is stored.
        trials_run: Trials launched in this run (a restart each).
        trials_skipped: Trials skipped without a restart in this run.
        recovered: Trials a killed run of this host left RUNNING, or another host's trials silent for
            the grace period, marked FAIL (their params re-queued once).
        host: The host name this run recorded on its trials (:func:`tuner.study.hosts.host_name`).
        stop_reason: ``budget``, ``trials``, ``interrupted`` or ``exhausted``.
        baseline: The baseline's record (trial number, record).
        best: The chosen best and why (:func:`tuner.study.best.choose_best` under the config's
            ``[objective]``, over every trial of the study).
        elapsed_s: Wall-clock seconds of the run.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    study_name: str
    storage_url: str
    trials_run: int = 0
    trials_skipped: int = 0
    recovered: list[int] = Field(default_factory=list)
    host: str = ""
    stop_reason: str = "exhausted"
    baseline: tuple[int, TrialRecord] | None = None
    best: BestChoice | None = None
    elapsed_s: float = 0.0


class StudyRun:
    """One run of a study: the state the loop's steps share, and the steps as methods.

    Args:
        config: The validated config.
        runner: Runs one trial (real launcher or offline evaluation).
        budget_s: Wall-clock budget in seconds (``None``: unbounded, then ``max_trials`` must be
            given).
        max_trials: Cap on trials launched or skipped in this run.
        allow_mixed_environment: Add trials even if the environment differs from the study's.
        storage_url: Override of the config's storage URL (``:memory:`` for the benchmark).
        on_progress: Receives :class:`Progress` events.
        clock: Monotonic clock in seconds (injectable).
        use_planner: Enqueue the memory model's candidates (off: the sampler alone, for the
            search-quality benchmark's comparison).

    Raises:
        StudyError: Neither budget nor trial cap given.
    """

    def __init__(
        self,
        config: TunerConfig,
        runner: TrialRunner,
        *,
        budget_s: float | None = None,
        max_trials: int | None = None,
        allow_mixed_environment: bool = False,
        storage_url: str | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        use_planner: bool = True,
    ) -> None:
        if budget_s is None and max_trials is None:
            raise StudyError("no --budget and no --trials given", hint="pass e.g. --budget 4h or --trials 20")
        self.config = config
        self.runner = runner
        self.budget_s = budget_s
        self.max_trials = max_trials
        self.allow_mixed_environment = allow_mixed_environment
        self.url = storage_url or study_storage_url(config)
        self.emit = on_progress or (lambda _p: None)
        self.clock = clock
        self.use_planner = use_planner
        self.budget = Budget(budget_s, reserve_s=config.budget.restore_reserve_s, clock=clock)
        self.summary = RunSummary(study_name=config.study.name, storage_url=self.url)
        self.launched = 0
        self.handled = 0
        self.repeats_in_a_row = 0
        self.stopped = False
        self._skipped_keys: set[tuple[tuple[str, Any], ...]] = set()  # configs this run stored a skip of
        self.invalid_in_a_row = 0
        self.environment: dict[str, Any] = {}
        self._expected: int | None = None
        self._started = clock()
        self._current: TrialJob | None = None
        self.context_tokens = 0
        self.study: optuna.Study | None = None
        self.artifact_store: FileSystemArtifactStore | None = None
        self.host = host_name()
        self.summary.host = self.host
        self.shared = False
        self.claims: ClaimLock | None = None
        self._view: list[optuna.trial.FrozenTrial] | None = None
        self._history: list[tuple[int, TrialRecord]] | None = None
        self.mirror: ProposalMirror | None = None
        self.skip_writer: SkipWriter | None = None
        self._parsed: dict[int, TrialRecord | None] = {}

    # ---- the run -------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Open the study, measure the baseline, then ask/skip/launch/tell until a stop.

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
        with storage_errors(self.url):
            self.open()
            self.summary.baseline = self.baseline()
            space = self.space()
            planner = Planner(space, self.context_tokens, capacity_tolerance=self.config.objective.capacity_tolerance,
                              longest_input_tokens=_longest_input(self.config), budget=self.config.budget,
                              mean_request_tokens=_mean_request_tokens(self.config))
            seed = self.config.study.seed + (zlib.crc32(self.host.encode()) % 1_000_003 if self.shared else 0)
            self.mirror = ProposalMirror(self._study().directions, make_sampler(self.config.study.sampler, seed), space,
                                         self.host)
            self.skip_writer = SkipWriter(self._study())
            try:
                while not self.stopped and self.can_continue():
                    trial, job = self.next_trial(space, planner)
                    if trial is None or job is None:
                        continue
                    self.check_invalid_streak(trial.number, self.launch(trial, job))
                self.skip_writer.flush()
            finally:
                self.skip_writer.close()  # an interrupted run's last skips are stored, not raised over it
        self.summary.trials_run = self.launched
        objective = self.config.objective
        self.summary.best = choose_best(self.history(), policy=objective.policy,
                                        capacity_tolerance=objective.capacity_tolerance,
                                        throughput_noise=objective.throughput_noise)
        self.summary.elapsed_s = self.clock() - started
        return self.summary

    def open(self) -> None:
        """Check storage and target, open the study, store or check its environment, recover
        RUNNING trials, check the budget holds one trial, and open the artifact store."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        check_storage_folder(self.url, self.config.study.name)
        check_run_storage(self.url, self.config.study.name)
        check_url_matches_port(self.runner.target().get("url"), self.runner.baseline_argv())
        config = self.config
        storage = open_storage(self.url, heartbeat_interval_s=config.storage.heartbeat_interval_s,
                               grace_period_s=config.storage.grace_period_s)
        self.environment = self.runner.environment()
        context_tokens = config.objective.context_tokens or _context_tokens(config)
        with schema_lock(self.url):  # hosts starting together: one creates the study and its info
            self.study = study = open_study(config.study.name, storage,
                                            make_sampler(config.study.sampler, config.study.seed))
            info = study_info(study)
            if info is not None:
                check_environment(info.environment, self.environment, allow_mixed=self.allow_mixed_environment)
            else:
                info = StudyInfo(environment=self.environment, target=self.runner.target(),
                                 baseline_argv=self.runner.baseline_argv(), policy=config.objective.model_dump(mode="json"),
                                 context_tokens=context_tokens, config_path=config.path)
                save_study_info(study, info)
        self.shared = is_postgres(storage)
        self.claims = ClaimLock(storage, storage.get_study_id_from_name(config.study.name))
        self.summary.recovered = recover_own(study, self.host, shared=self.shared) + reap_stale(study)
        self.context_tokens = info.context_tokens or context_tokens
        if self.budget_s is not None:
            require_one_trial(self.budget_s, self.cost_s(), reserve_s=config.budget.restore_reserve_s)
        if self.url != ":memory:":
            check_artifacts_folder(config)
            folder = study_artifacts_dir(config)
            folder.mkdir(parents=True, exist_ok=True)
            self.artifact_store = FileSystemArtifactStore(str(folder))

    def baseline(self) -> tuple[int, TrialRecord] | None:
        """The study's baseline (the service's own flags), measured now when the study has none.

        Its resolved knobs fix the search space (the study attribute :data:`SPACE_ATTR`) and
        become its Optuna params.

        Raises:
            StudyError: The baseline could not start for a reason other than memory.
        """
        study = self._study()
        waited, waited_s = False, 0.0
        while True:
            with self._claim():
                found = self._own_baseline()
                if found is not None or not self.can_continue():
                    return found
                # The study attribute the baseline's tell stores first: a baseline of this
                # environment is done even if its trial is not in this host's view yet.
                done_elsewhere = SPACE_ATTR in study.user_attrs and self._study_environment()
                measuring = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                             if t.user_attrs.get(KIND_ATTR) == "baseline"
                             and same_environment(t.user_attrs.get(ENVIRONMENT_ATTR), self.environment)]
                if not measuring and not (done_elsewhere and waited_s < _BASELINE_VISIBLE_S):
                    trial = study.ask()
                    trial.set_user_attr(KIND_ATTR, "baseline")
                    self._own(trial)
                    break
            # Another host measures this environment's baseline now: once per study, not per host.
            waited_s += _WAIT_POLL_S
            if not waited and measuring:
                self.progress("phase", None, phase="waiting", message=(
                    f"waiting for the baseline (trial {measuring[0].number}) on host "
                    f"{measuring[0].user_attrs.get(HOST_ATTR, '?')}"))
            waited = True
            time.sleep(_WAIT_POLL_S)
        job = TrialJob(number=trial.number, kind="baseline", context_tokens=self.context_tokens, started_at=_now())
        def fix_space(record: TrialRecord) -> None:
            reader = getattr(self.runner, "host_memory", None)
            space = resolve_study_space(self.config, record, self.environment, self.context_tokens,
                                        host=reader() if callable(reader) else None,
                                        ranks=ranks_of(self.runner.baseline_argv()))
            stored = study.user_attrs.get(SPACE_ATTR)
            if stored is None or self._study_environment():
                study.set_user_attr(SPACE_ATTR, space.model_dump(mode="json"))
            else:  # a mixed-environment host's own baseline: the study keeps its space
                space = Space.model_validate(stored)
            set_baseline_params(trial, space, record.params)
            self.progress("note", trial.number, message=f"hierarchical cache {space.hicache_reason}")

        record = self.launch(trial, job, before_tell=fix_space)
        if _could_not_start(record):
            raise StudyError(
                f"the baseline (trial {trial.number}, the service's own flags) could not start "
                f"({record.failure_class.value if record.failure_class else 'failed'}): "
                f"{_server_reason(record)}; the service was restored to its original flags",
                hint=f"fix the service command or environment and run again (`{self.show_command(trial.number)}` has the log)",
            )
        return trial.number, record

    def space(self) -> Space:
        """The study's resolved space (stored when its baseline was measured).

        Raises:
            StudyError: The study has no baseline to derive it from.
        """
        data = self._study().user_attrs.get(SPACE_ATTR)
        if data is None:
            raise StudyError(
                f"study {self.config.study.name!r} has no baseline trial to derive its search space from",
                hint="run again with a budget long enough for one trial",
            )
        return Space.model_validate(data)

    def next_trial(self, space: Space, planner: Planner) -> tuple[optuna.Trial | None, TrialJob | None]:
        """Ask Optuna for the next trial (after enqueueing the planner's candidate, else the
        sampler's first proposal that passes the screens, when nothing waits); a trial that needs
        no restart is told as skipped here and has no job (nor a trial, when only the sampler's
        proposals were skipped, :meth:`propose`).

        The planner decides under the study's claim lock (on a shared study), from a read made
        inside it, and its candidate is enqueued and asked before the lock goes: the next host's
        planner sees it as running and proposes what is useful given it (``pending``,
        :meth:`tuner.study.planner.Planner.next`), never the same plan. The sampler's proposals are
        drawn outside the lock (:meth:`propose`)."""
        study = self._study()
        planning = self.use_planner and self._planned() < self.config.study.predicted_candidates
        with self._claim(reap=False) if planning and self.shared else contextlib.nullcontext():
            self.refresh()  # one read of the study per decision: every host's trials as of now
            done = self.history()
            waiting = [t for t in self.trials() if t.state is TrialState.WAITING]
            running = [t for t in self.trials() if t.state is TrialState.RUNNING]
            queued = bool(waiting)
            if not queued and planning:
                # Every host's trials count: what runs elsewhere now is as tried as what finished.
                tried = {config_key(space.snap(r.params)) for _, r in done if r.params}
                tried |= {config_key(space.snap(t.params)) for t in (*waiting, *running) if t.params}
                # Other hosts' planner trials in flight: what they are predicted to reach (believed).
                pending = [(dict(t.params), dict(t.user_attrs.get(PREDICTION_ATTR) or {}))
                           for t in running if t.user_attrs.get(KIND_ATTR) == "predicted" and t.params]
                candidate = planner.next(done, tried, pending=pending) or self.cache_candidate(space, done, tried)
                if candidate is not None:
                    study.enqueue_trial(candidate.params,
                                        user_attrs={KIND_ATTR: "predicted", PREDICTION_ATTR: candidate.prediction})
                    queued = True
                elif (repeat := self.noise_repeat(done, space, running=(*waiting, *running))) is not None:
                    number, params, why = repeat
                    study.enqueue_trial(params, user_attrs={KIND_ATTR: "predicted", REPEAT_ATTR: number,
                                                            PREDICTION_ATTR: {"why": why}})
                    queued = True
            if queued:
                trial = study.ask()  # the oldest waiting trial: RUNNING before the lock goes
        if not queued:
            proposed = self.propose(space, planner, done, running)
            if proposed is None:
                return None, None
            study.enqueue_trial(proposed, user_attrs={KIND_ATTR: "sampled"})
            trial = study.ask()  # the oldest waiting trial (a host's may be taken by another: no matter)
        kind = str(trial.user_attrs.get(KIND_ATTR, "sampled"))
        params = space.suggest(trial)
        prediction = dict(trial.user_attrs.get(PREDICTION_ATTR) or {})
        floor = self.capacity_floor(done)
        repeat_of = trial.user_attrs.get(REPEAT_ATTR)
        if repeat_of is not None:  # a deliberate re-measurement (the noise), not a wasted repeat
            with self._claim():
                self._own(trial)
            return trial, TrialJob(number=trial.number, kind=kind, params=params, prediction=prediction,
                                   context_tokens=self.context_tokens, started_at=_now(), repeat_of=int(repeat_of))
        reason = self.screen(params, done, space, planner, floor=self.band_floor(done) if kind == "sampled" else None)
        if reason is not None:
            self.skip(trial, params, kind, prediction, reason)
            return trial, None
        # Check and claim: under the study's lock, re-read what other hosts measured or claimed
        # since; the first to claim a config wins, a later host skips it (no restart).
        with self._claim():
            reason = claimed_reason(trial, study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)))
            if reason is None:
                self._own(trial)  # RUNNING with its params, host and heartbeat before the lock goes
        if reason is not None:
            self.skip(trial, params, kind, prediction, reason)
            return trial, None
        return trial, TrialJob(number=trial.number, kind=kind, params=params, prediction=prediction,
                               context_tokens=self.context_tokens, capacity_floor=floor, started_at=_now())

    def propose(self, space: Space, planner: Planner, done: Sequence[tuple[int, TrialRecord]],
                running: Sequence[optuna.trial.FrozenTrial]) -> dict[str, Any] | None:
        """The sampler's next proposal that passes the screens, as Optuna params, or ``None``.

        The sampler proposes on the in-memory mirror of the study (:mod:`tuner.study.proposals`,
        the constant liar seeing every host's RUNNING trials); a proposal that needs no restart
        (:func:`skip_reason`, :meth:`Planner.screen`, :meth:`host_check`, or the same config
        running on another host) is stored as a skipped trial in one write, by a background
        thread (:class:`~tuner.study.proposals.SkipWriter`), and the next one is drawn, at most
        :data:`_PROPOSALS_PER_DECISION` per decision. A draw of a config measured
        already, or skipped by this run already, is told to the mirror only: late in a study,
        when most draws repeat, they cost no write. A skip of a config the study holds a skip of
        already (another host's, or an earlier run's) is this run's decision (counted and shown)
        but not written again: the study holds each skip once.
        """
        if self.mirror is None or self.skip_writer is None:
            raise RuntimeError("StudyRun.run() did not open the sampler's mirror")
        self.mirror.sync(self.trials())
        others = {config_key(space.snap(t.params)): t for t in running if t.params and t.user_attrs.get(HOST_ATTR)}
        floor = self.band_floor(done)
        # Configs measured, and configs the study holds a skip of already (another host's, or an
        # earlier run's: the screens of every host conclude the same from the same measured
        # trials, so the study holds one; a host-memory skip, the hierarchical cache's pools,
        # :meth:`host_check`, is each host's own).
        measured: set[tuple[tuple[str, Any], ...]] = set()
        held: set[tuple[tuple[str, Any], ...]] = set()
        for _, r in done:
            if r.params and r.outcome in ("ok", "failed"):
                measured.add(config_key(space.snap(r.params)))
            elif r.params and r.outcome == "skipped":
                held.add(config_key(space.snap(r.params)))

        for _ in range(_PROPOSALS_PER_DECISION):
            trial = self.mirror.ask()
            params = space.suggest(trial)
            key = config_key(space.snap(params))
            reason = self.screen(params, done, space, planner, floor=floor)
            if reason is None and (other := others.get(key)) is not None:
                reason = (f"the same config is running on host {other.user_attrs.get(HOST_ATTR)} "
                          f"(trial {other.number})", other.number)
            if reason is None:
                self.mirror.release(trial)
                return dict(trial.params)
            record = _skip_record(params, "sampled", {}, reason)
            # The study holds each skip once: a draw of a config measured already, or skipped by
            # this run already, is told to the mirror (the sampler moves on) and not written again;
            # one another host (or run) stored is not written again either, but is this run's skip.
            again = key in self._skipped_keys or key in measured
            write = not again and (key not in held or bool(params.get("enable_hierarchical_cache")))
            self.mirror.skipped(trial, lambda mirror, t, r=record: tell_record(mirror, t, r), stored=write)
            # Stored in the background (SkipWriter), and no new read: the skip changes neither
            # ``done`` nor the cost estimate (launches only).
            if write:
                self.skip_writer.store(trial.params, trial.distributions, record, {HOST_ATTR: self.host})
            self._skipped_keys.add(key)
            self.skipped(None, params, "sampled", reason[0], stored=not again)
            if self.stopped or not self.can_continue():
                return None
        return None

    def screen(self, params: Mapping[str, Any], done: Sequence[tuple[int, TrialRecord]], space: Space,
               planner: Planner, *, floor: int | None) -> tuple[str, int] | None:
        """Why a config needs no restart, or ``None``: a proof (:func:`skip_reason`), then for a
        sampled config (``floor``: the capacity band's, :meth:`band_floor`; ``None`` for the
        planner's own candidates) the planner's predictions (:meth:`Planner.screen`), then this
        host's memory (:meth:`host_check`)."""
        reason = skip_reason(params, done, space)
        if reason is None and floor is not None and self.use_planner:
            reason = planner.screen(params, done, capacity_floor=floor)
        if reason is None:
            reason = self.host_check(params, done)
        return reason

    def cache_candidate(self, space: Space, done: Sequence[tuple[int, TrialRecord]],
                        tried: set[tuple[tuple[str, Any], ...]]) -> Candidate | None:
        """The best config so far with the hierarchical cache on, at the largest host pool of the
        space's grid that fits this host (:meth:`host_check`), once the planner has nothing left
        to propose; None when the space does not search the cache, the best already uses it, or
        that config was tried. What the cache buys is then measured on the same flags (§7)."""
        on = space.hicache_on()
        if not on:
            return None
        objective = self.config.objective
        choice = choose_best([(n, r) for n, r in done if r.params], policy=objective.policy,
                             capacity_tolerance=objective.capacity_tolerance,
                             throughput_noise=objective.throughput_noise)
        if choice is None:
            return None
        best = dict(choice.record.params)
        if best.get("enable_hierarchical_cache"):
            return None
        base = {k: v for k, v in best.items() if k not in HICACHE_KNOBS}
        grid: list[Any]
        if space.hicache_size is not None:
            knob, grid = "hicache_size", list(range(space.hicache_size[1], space.hicache_size[0] - 1, -1))
        elif space.hicache_ratio is not None:
            lo, hi = space.hicache_ratio
            knob, grid = "hicache_ratio", [round(hi - 0.5 * i, 6) for i in range(int(round((hi - lo) / 0.5)) + 1)]
        else:
            knob, grid = "", [None]
        for value in grid:
            params = space.snap({**base, **on, **({knob: value} if knob else {})})
            if config_key(params) in tried:
                return None
            if self.host_check(params, done) is None:
                return Candidate(params=params, prediction={
                    "why": f"the hierarchical cache on the best flags so far (trial {choice.number}), "
                           f"at the largest host pool that fits this host ({knob or 'default'} {value})",
                    "compare_with_trial": choice.number})
        return None

    def host_check(self, params: Mapping[str, Any], done: Sequence[tuple[int, TrialRecord]]) -> tuple[str, int] | None:
        """Why ``params``'s hierarchical-cache pools must not be launched on this host (per rank ×
        ranks against ``MemAvailable`` and the unit's ``MemoryMax``, with the margin and the
        arithmetic, :func:`tuner.study.hostcheck.host_skip_reason`), or None. Read before every
        launch; a runner without ``host_memory()`` is not checked."""
        if not params.get("enable_hierarchical_cache"):
            return None
        reader = getattr(self.runner, "host_memory", None)
        host = reader() if callable(reader) else None
        version = str(self.environment.get("sglang_version") or "0.5.5")
        argv = self.runner.baseline_argv()
        page = params.get("page_size") or _flag_int(argv, "--page-size") or 1
        return host_skip_reason(params, done, host, version=version, ranks=ranks_of(argv), page_size=int(page))

    def skip(self, trial: optuna.Trial, params: dict[str, Any], kind: str, prediction: dict[str, Any],
             reason: tuple[str, int]) -> None:
        """Tell ``trial`` PRUNED with the reason and the proving trial, without a restart."""
        trial.set_user_attr(HOST_ATTR, self.host)
        tell_record(self._study(), trial, _skip_record(params, kind, prediction, reason))
        self.skipped(trial.number, params, kind, reason[0])

    def skipped(self, number: int | None, params: dict[str, Any], kind: str, text: str, *, stored: bool = True) -> None:
        """Count a skip (trial ``number``; ``None``: a sampler's draw, stored in the background)
        and tell the CLI. A draw not ``stored`` (a config measured or skipped already) is no
        trial: it only counts towards :data:`MAX_REPEATS_IN_A_ROW`, after which the run stops
        as exhausted."""
        if not stored:
            self.repeats_in_a_row += 1
            if self.repeats_in_a_row >= MAX_REPEATS_IN_A_ROW:
                self.stop("exhausted")
            return
        self.repeats_in_a_row = 0
        self.summary.trials_skipped += 1
        self.handled += 1
        self.estimate()
        what = f"trial {number}" if number is not None else f"a {kind} config"
        self.progress("skip", number, kind=kind, flags=params, message=f"{what} skipped: {text}")

    def launch(self, trial: optuna.Trial, job: TrialJob,
               before_tell: Callable[[TrialRecord], None] | None = None) -> TrialRecord:
        """Run ``job`` through the runner and tell its record (a restart of the service).

        Raises:
            KeyboardInterrupt: After storing the partial record as FAIL and re-enqueueing the params.
            ServiceControlError: The service could not be changed (its drop-in folder became
                unwritable); stored and re-enqueued the same way, and the run stops.
            StudyError: The journal stopped answering during the trial (stored as FAIL with
                ``journal_unreadable``, re-enqueued): the run stops instead of measuring blind.
        """
        self._current = job
        self.estimate()
        self.progress("trial_start", job.number, index=self.handled + 1, message=f"trial {job.number} ({job.kind})")
        begun = self.clock()

        def on_phase(name: str, detail: PhaseProgress | None = None) -> None:
            if detail is None:  # a phase begins (main thread); its progress ticks are not stored
                trial.set_user_attr(PHASE_ATTR, name)
            self.progress("phase", job.number, index=self.handled + 1, phase=name, detail=detail,
                          message=f"trial {job.number}: {name}")

        def on_reaped(numbers: list[int]) -> None:
            self.summary.recovered.extend(numbers)
            self.progress("phase", None, index=self.handled + 1, phase="reaped", message=(
                f"trial(s) {numbers} of another host had no heartbeat for "
                f"{self.config.storage.grace_period_s} s: marked FAIL, params queued again"))

        try:
            with TrialHeartbeat(self._study(), self._trial_id(trial), on_reaped=on_reaped):
                record = self.runner.run(job, on_phase)
        except (KeyboardInterrupt, ServiceControlError) as err:
            why = ("interrupted (Ctrl-C or SIGTERM) during the trial" if isinstance(err, KeyboardInterrupt)
                   else f"not run: the service could not be changed ({err.message})")
            partial = TrialRecord(params=job.params, kind=_kind(job.kind), outcome="failed", failure_evidence=why,
                                  started_at=job.started_at, duration_s=self.clock() - begun)
            fail_trial(self._study(), trial, partial, requeue=bool(job.params))
            raise
        finally:
            self._current = None
        if record.failure_class is FailureClass.JOURNAL_UNREADABLE:
            # Not the candidate's failure: FAIL (not a measured trial) and measured again next run.
            fail_trial(self._study(), trial, record.model_copy(update={"artifacts": {}}), requeue=bool(job.params))
            _log.warning("trial %d: %s", job.number, record.failure_evidence)
            raise StudyError(
                f"trial {job.number} stopped: the service manager's journal stopped answering "
                f"({record.failure_evidence}); the trial is recorded as journal_unreadable, not measured, "
                "and the service was restored",
                hint="check journald (systemctl status systemd-journald; journalctl --verify) and run the "
                "same command again to resume",
            )
        self.launched += 1
        self.repeats_in_a_row = 0
        if job.repeat_of is not None:
            record = record.model_copy(update={"repeat_of": job.repeat_of})
        record = self.tell(trial, record, begun, before_tell)
        self.estimate()
        self.progress("trial_end", job.number, index=self.handled + 1, kind=job.kind, flags=record.params,
                      message=describe(job.number, record))
        self.handled += 1
        return record

    def tell(self, trial: optuna.Trial, record: TrialRecord, begun: float,
             before_tell: Callable[[TrialRecord], None] | None = None) -> TrialRecord:
        """Complete ``record`` (log evidence, artifacts, duration) and tell Optuna."""
        record = _with_log_evidence(record)
        if record.duration_s is None:
            record = record.model_copy(update={"duration_s": self.clock() - begun})
        try:
            record = _upload_artifacts(trial, record, self.artifact_store)
            if before_tell is not None:
                before_tell(record)
            tell_record(self._study(), trial, record)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Cut off from the database for longer than the grace period: the other hosts marked
            # this trial FAIL (and queued its params again). The measurement is still good: store
            # it as a trial of its own; the queued copy is then skipped as measured.
            number = add_record(self._study(), trial.params, trial.distributions, record,
                                {HOST_ATTR: self.host, ENVIRONMENT_ATTR: self.environment,
                                 KIND_ATTR: job_kind(trial), LATE_ATTR: trial.number})
            _log.warning("trial %d was marked FAIL by another host while this host could not reach the "
                         "database; its result is stored as trial %d", trial.number, number)
        except (optuna.exceptions.StorageInternalError, SQLAlchemyError) as err:
            _log.warning("trial %d not stored (the database does not answer: %s): params %s, context "
                         "capacity %s, output %s tok/s, outcome %s", trial.number, first_line(err),
                         json.dumps(record.params, sort_keys=True), record.context_capacity,
                         record.output_throughput_tok_s, record.outcome)
            raise StudyError(
                f"the study's database stopped answering: trial {trial.number}'s result could not be stored "
                "(it is in the warning above, params and values); the service was restored",
                hint="check the database server and the network to it, then run the same command to resume "
                "(the other hosts re-run the trial)",
            ) from err
        self.refresh()
        return record

    # ---- stopping ------------------------------------------------------------------------------

    def can_continue(self) -> bool:
        """Whether the trial cap and the budget leave room for one more trial (else :meth:`stop`)."""
        if self.max_trials is not None and self.handled >= self.max_trials:
            self.stop("trials")
            return False
        if not self.budget.fits(self.cost_s()):
            self.stop("budget")
            return False
        return True

    def check_invalid_streak(self, number: int, record: TrialRecord) -> None:
        """Stop the run after :data:`MAX_INVALID_IN_A_ROW` ``invalid_arguments`` failures in a row.

        Raises:
            StudyError: The streak is reached (the message quotes the server's reason).
        """
        invalid = record.outcome == "failed" and record.failure_class is FailureClass.INVALID_ARGUMENTS
        self.invalid_in_a_row = self.invalid_in_a_row + 1 if invalid else 0
        if self.invalid_in_a_row >= MAX_INVALID_IN_A_ROW:
            raise StudyError(
                f"{self.invalid_in_a_row} trials in a row (the last {number}) were rejected as invalid_arguments: "
                f"{_server_reason(record)}; the service was restored to its original flags",
                hint=f"fix the service command or the [space] and run again (`{self.show_command(number)}` has the log)",
            )

    def stop(self, reason: str) -> None:
        """Record the stop reason, end the loop after this step, and tell the CLI."""
        self.summary.stop_reason = reason
        self.stopped = True
        self.progress("stop", None, index=self.handled, message=f"stopped: {reason}")

    def show_command(self, number: int) -> str:
        """A ``tuner show`` command that finds this study from where the run was started, however
        many databases ``studies/`` holds: with the run's ``--config``, else its storage URL."""
        import shlex

        if self.config.path and self.url == study_storage_url(self.config):
            return f"tuner show {number} --config {shlex.quote(self.config.path)}"
        return f"tuner show {number} --storage {shlex.quote(self.url)} --study {shlex.quote(self.config.study.name)}"

    # ---- shared state --------------------------------------------------------------------------

    def trials(self) -> list[optuna.trial.FrozenTrial]:
        """Every trial of the study as of this decision (read once, until :meth:`refresh`).

        One read of the storage serves a whole decision (the planner, the screens, the cost
        estimate), instead of one per question: on a shared PostgreSQL study each read is a round
        trip per table. Under the claim lock the loop reads afresh (:func:`claimed_reason`)."""
        if self._view is None:
            self._view = self._study().get_trials(deepcopy=False)
        return self._view

    def refresh(self) -> None:
        """Forget the view of the study (:meth:`trials`): the next question reads it again."""
        self._view = None
        self._history = None

    def history(self) -> list[tuple[int, TrialRecord]]:
        """``(number, record)`` of every finished trial of the study, in trial order (from the
        decision's view, :meth:`trials`; a finished trial's record is parsed once per run).

        One list per view, the same object until :meth:`refresh` (the planner calibrates once per
        history, :meth:`tuner.study.planner.Planner.screen`): callers must not change it."""
        if self._history is not None:
            return self._history
        out = []
        for trial in self.trials():
            if trial.state not in (TrialState.COMPLETE, TrialState.PRUNED):
                continue
            if trial.number not in self._parsed:
                self._parsed[trial.number] = record_of(trial)
            record = self._parsed[trial.number]
            if record is not None:
                out.append((trial.number, record))
        self._history = out
        return out

    def cost_s(self) -> float:
        """The next trial's expected cost in seconds (:meth:`tuner.study.budget.Budget.estimate`)."""
        durations = [r.duration_s or 0.0 for _, r in self.history() if r.outcome in ("ok", "failed")]
        return Budget.estimate(durations, self.runner.prior_cost_s()).seconds

    def expected(self) -> int | None:
        """About how many launches this run will make in all (``None``: unbounded), as of the
        last :meth:`estimate` (a trial's start, end or skip): stable during a trial."""
        return self._expected

    def estimate(self) -> int | None:
        """Re-estimate the launches of this run from the budget left and the measured costs.

        A launch costs the larger of the study's estimate (:meth:`cost_s`) and this run's wall
        time per launch so far. At a trial's start the trial in flight counts as one and only
        what fits after it is added; at its end, what fits in the budget left. A trial cap
        (``--trials``, which counts skips too) bounds it. The result is never below the launches so far (the one in flight
        included).

        Returns:
            The estimate (also kept for :meth:`expected`), ``None`` when unbounded.
        """
        in_flight = 1 if self._current is not None else 0
        launched = self.launched + in_flight
        cost = self.cost_s()
        if self.launched:
            # What a launch has cost this run in wall time: the trials' own durations plus what
            # lies between them (tell, artifacts, the next ask), so the count does not creep down.
            cost = max(cost, (self.clock() - self._started) / self.launched)
        left = self.budget.trials_left(cost)
        if left is None:
            total = None
        else:
            after = max(0, int((self.budget.remaining_s() - cost) // max(cost, 1e-9))) if in_flight else left
            total = launched + after
        if self.max_trials is not None:
            cap = launched + max(0, self.max_trials - self.handled - in_flight)
            total = cap if total is None else min(total, cap)
        self._expected = None if total is None else max(total, launched)
        return self._expected

    def noise_repeat(
        self, done: Sequence[tuple[int, TrialRecord]], space: Space,
        running: Sequence[optuna.trial.FrozenTrial] = (),
    ) -> tuple[int, dict[str, Any], str] | None:
        """A config to measure once more, so "best" rests on the measured noise, or ``None``.

        When the planner has nothing left and the two fastest configs of the best capacity band
        differ in throughput by less than twice the noise margin (the measured spread once a
        config was measured twice, else ``[objective] throughput_noise``), the chosen one, then the
        runner-up, is re-measured once (:data:`MAX_NOISE_REPEATS` in a study). Capacity is exact
        (the pool is sized at startup); throughput is what needs the repeat.

        Args:
            done: ``(trial number, record)`` of the finished trials (every host's).
            space: The resolved space.
            running: The study's RUNNING and WAITING trials (every host's): a repeat in flight
                counts as made, so two hosts never re-measure at once.

        Returns:
            ``(trial re-measured, its params on the grid, why)``.
        """
        objective = self.config.objective
        repeated = {r.repeat_of for _, r in done if r.repeat_of is not None}
        # A repeat running (or queued) on any host counts: hosts never re-measure a config twice at once.
        repeated |= {int(t.user_attrs[REPEAT_ATTR]) for t in running if t.user_attrs.get(REPEAT_ATTR) is not None}
        if objective.policy != "throughput_within_capacity" or len(repeated) >= MAX_NOISE_REPEATS:
            return None
        choice = choose_best(done, policy=objective.policy, capacity_tolerance=objective.capacity_tolerance,
                             throughput_noise=objective.throughput_noise)
        if choice is None:
            return None
        top = max(r.context_capacity or 0 for _, r in done if r.feasible and r.outcome == "ok")
        floor = math.ceil(top * (1.0 - objective.capacity_tolerance) - 1e-9)
        band: dict[tuple[tuple[str, Any], ...], tuple[int, TrialRecord]] = {}
        for number, record in done:
            if record.feasible and record.outcome == "ok" and (record.context_capacity or 0) >= floor:
                band.setdefault(config_key(space.snap(record.params)), (number, record))
        ranked = sorted(band.values(), key=lambda item: -(item[1].output_throughput_tok_s or 0.0))
        if len(ranked) < 2:
            return None
        first, second = (r.output_throughput_tok_s or 0.0 for _, r in ranked[:2])
        margin = choice.noise if choice.noise is not None else objective.throughput_noise
        if first <= 0 or (first - second) / first >= 2 * margin:
            return None
        others = [item for item in ranked[:2] if item[0] != choice.number]
        chosen = next((item for item in ranked if item[0] == choice.number), None)
        for number, record in ([chosen] if chosen else []) + others:
            if number not in repeated:
                why = (f"re-measure trial {number}: the band's two fastest configs differ by "
                       f"{(first - second) / first:.1%} in throughput, within twice the {margin:.1%} noise margin")
                return number, space.snap(record.params), why
        return None

    def band_floor(self, done: Sequence[tuple[int, TrialRecord]]) -> int:
        """The least context capacity that can still win on the policy: the best feasible
        capacity's band (``[objective] capacity_tolerance``) for ``throughput_within_capacity`` and
        ``max_capacity``; 0 for ``max_throughput`` (any capacity may win there)."""
        objective = self.config.objective
        best = choose_best(done, policy="max_capacity")
        if best is None or objective.policy == "max_throughput":
            return 0
        return math.ceil((best.record.context_capacity or 0) * (1.0 - objective.capacity_tolerance) - 1e-9)

    def capacity_floor(self, done: Sequence[tuple[int, TrialRecord]]) -> int:
        """Capacity-first fidelity: ``[budget] probe_only_below`` of the best capacity so far."""
        best = choose_best(done, policy="max_capacity")
        if best is None or self.config.budget.probe_only_below <= 0:
            return 0
        return int(self.config.budget.probe_only_below * (best.record.context_capacity or 0))

    def progress(self, event: str, number: int | None, *, index: int | None = None, **fields: Any) -> None:
        """Emit one :class:`Progress` event (the trial in flight's kind and flags filled in)."""
        job = self._current
        if job is not None and job.number == number:
            fields.setdefault("kind", job.kind)
            fields.setdefault("flags", dict(job.params))
        launch = self.launched + (1 if job is not None else 0)
        self.emit(Progress(event=event, number=number, index=self.handled if index is None else index,
                           launch=launch, expected=self.expected(),
                           eta_s=self.budget.remaining_s(), **fields))

    def _planned(self) -> int:
        """The planner's trials in the study so far (finished and running, every host's), as of
        the last read."""
        done = sum(1 for _, r in self.history() if r.kind == "predicted")
        return done + sum(1 for t in self.trials() if t.state is TrialState.RUNNING
                          and t.user_attrs.get(KIND_ATTR) == "predicted")

    @contextlib.contextmanager
    def _claim(self, *, reap: bool = True) -> Iterator[None]:
        """The study's claim lock for one ``with`` block (a no-op off PostgreSQL).

        Other hosts' dead trials are reaped first (unless ``reap`` is false), so their params are
        queued before this host chooses."""
        if self.claims is None:
            raise RuntimeError("StudyRun.open() was not called")
        with self.claims.held():
            reaped = reap_stale(self._study()) if reap else []
            if reaped:
                self.refresh()
                self.summary.recovered.extend(reaped)
                self.progress("phase", None, phase="reaped", message=(
                    f"trial(s) {reaped} of another host had no heartbeat for "
                    f"{self.config.storage.grace_period_s} s: marked FAIL, params queued again"))
            yield

    def _own(self, trial: optuna.Trial) -> None:
        """Mark ``trial`` as this host's: host name, environment and a first heartbeat."""
        trial.set_user_attr(HOST_ATTR, self.host)
        trial.set_user_attr(ENVIRONMENT_ATTR, self.environment)
        storage = self._study()._storage  # noqa: SLF001 - the storage this run opened
        record = getattr(storage, "record_heartbeat", None)  # RDBStorage (Optuna's BaseHeartbeat)
        if record is not None and heartbeat_interval(storage) is not None:
            record(self._trial_id(trial))

    def _trial_id(self, trial: optuna.Trial) -> int:
        study = self._study()
        storage = study._storage  # noqa: SLF001
        return storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(study.study_name), trial.number)

    def _own_baseline(self) -> tuple[int, TrialRecord] | None:
        """The study's finished baseline measured in this run's environment (any host's)."""
        found = [(t.number, r) for t, r in records(self._study())
                 if same_environment(t.user_attrs.get(ENVIRONMENT_ATTR), self.environment)]
        return _baseline(found)

    def _study_environment(self) -> bool:
        """Whether this run's environment is the study's own (not a mixed-in host)."""
        info = study_info(self._study())
        return info is None or same_environment(info.environment, self.environment)

    def _study(self) -> optuna.Study:
        if self.study is None:
            raise RuntimeError("StudyRun.open() was not called")
        return self.study


_WAIT_POLL_S = 1.0
"""Seconds between looks at the study while another host measures the baseline."""
_BASELINE_VISIBLE_S = 30.0
"""How long a host waits for a baseline whose space is stored to show among the finished trials."""


def claimed_reason(trial: optuna.Trial, others: Sequence[optuna.trial.FrozenTrial]) -> tuple[str, int] | None:
    """Why ``trial`` must not launch: another trial with the same Optuna params was measured
    (COMPLETE) or claimed by a host (RUNNING with :data:`~tuner.study.hosts.HOST_ATTR`).

    Read under the claim lock, so of two hosts that drew the same config the first to claim it
    launches it and the other skips it; RUNNING trials not yet claimed (another host still
    choosing) do not count.

    Args:
        trial: This host's asked trial, params suggested, not yet claimed.
        others: The study's COMPLETE and RUNNING trials.

    Returns:
        ``(reason, trial number)``, or ``None`` to launch.
    """
    mine = config_key(trial.params)
    for other in others:
        if other.number == trial.number or not other.params or config_key(other.params) != mine:
            continue
        if other.state is TrialState.COMPLETE:
            return f"the same config was measured by trial {other.number}", other.number
        host = other.user_attrs.get(HOST_ATTR)
        if host is not None:
            return f"the same config is running on host {host} (trial {other.number})", other.number
    return None


def run_study(config: TunerConfig, runner: TrialRunner, **options: Any) -> RunSummary:
    """Run (or resume) the study until the budget, the trial cap, or the search runs out.

    ``StudyRun(config, runner, **options).run()``; see :class:`StudyRun` for the options and
    :meth:`StudyRun.run` for the result and the raised errors.
    """
    return StudyRun(config, runner, **options).run()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def skip_reason(
    params: Mapping[str, Any], finished: Sequence[tuple[int, TrialRecord]], space: Space | None = None
) -> tuple[str, int] | None:
    """Why ``params`` need no restart: the same config was measured, or a failure proves it fails.

    Args:
        params: The candidate's knobs by SGLang field name.
        finished: ``(number, record)`` of the study's finished trials.
        space: The study's space: configs are compared on its grid (the baseline's resolved
            knobs, and floats, land on the same point), else as given.

    Returns:
        ``(reason, proving trial number)``, or ``None`` when the candidate must be launched.
    """
    snap = space.snap if space is not None else (lambda p: {k: p.get(k) for k in params})
    wanted = config_key(snap(dict(params)))
    for number, record in finished:
        if record.outcome in ("ok", "failed") and record.params and config_key(snap(dict(record.params))) == wanted:
            return f"the same config was measured by trial {number}", number
    failures = [(n, r, r.failure_class) for n, r in finished if r.outcome == "failed" and r.failure_class is not None]
    if failures:
        proved, index = must_fail(dict(params), [(dict(r.params), _monotone_class(c)) for _, r, c in failures])
        if proved and index is not None:
            number, record, failure_class = failures[index]
            return (
                f"must fail: trial {number} failed with {failure_class.value} at "
                f"mem_fraction_static={record.params.get('mem_fraction_static')} with other memory "
                "knobs equal or smaller, and failures are monotone in these knobs",
                number,
            )
    return None


def _monotone_class(failure_class: FailureClass) -> FailureClass:
    """A runtime OOM under the stress load bounds the reserve exactly like a CUDA-graph OOM.

    Both say the ``(1 − mfs) × B`` reserve was too small for what runs out of it (§1.6, §8): a
    larger fraction, or larger reserve knobs (``max_running_requests``, ``chunked_prefill_size``,
    ``cuda_graph_max_bs``), leaves less headroom for a stress load that is at least as heavy
    (capacity, and with it the stress concurrency, only grows with the fraction).
    """
    return FailureClass.CUDA_GRAPH_OOM if failure_class is FailureClass.RUNTIME_OOM else failure_class


def _skip_record(params: dict[str, Any], kind: str, prediction: dict[str, Any], reason: tuple[str, int]) -> TrialRecord:
    """The record of a config not launched: why, and the trial that proves it."""
    text, proof = reason
    return TrialRecord(params=params, kind=_kind(kind), outcome="skipped", skipped_reason=text, proved_by_trial=proof,
                       prediction=prediction, started_at=_now(), duration_s=0.0, constraints=Constraints.all_violated())


def _upload_artifacts(trial: optuna.Trial, record: TrialRecord, store: FileSystemArtifactStore | None) -> TrialRecord:
    """Upload the runner's artifact files to Optuna's artifact store; keep name → artifact id."""
    if store is None or not record.artifacts:
        return record
    ids = {}
    for name, path in record.artifacts.items():
        try:
            ids[name] = upload_artifact(artifact_store=store, file_path=path, study_or_trial=trial)
        except (OSError, ValueError) as err:
            _log.warning("artifact %s of trial %d not stored: %s", name, trial.number, err)
    return record.model_copy(update={"artifacts": ids})


def job_kind(trial: optuna.Trial) -> str:
    """The kind a trial was asked as (its :data:`~tuner.study.optuna_io.KIND_ATTR`, else ``sampled``)."""
    return str(trial.user_attrs.get(KIND_ATTR, "sampled"))



def _kind(kind: str) -> Any:
    return kind if kind in ("baseline", "predicted", "sampled", "enqueued") else "sampled"


def _baseline(done: Sequence[tuple[int, TrialRecord]]) -> tuple[int, TrialRecord] | None:
    """The study's baseline; one that could not start is measured again (the command was fixed)."""
    return next(((n, r) for n, r in reversed(done) if r.kind == "baseline" and not _could_not_start(r)), None)


def _could_not_start(record: TrialRecord) -> bool:
    """Whether a trial failed to start for a reason other than memory.

    A startup memory failure (§4.3) is what the search explores; any other failure before the
    server sized its KV pool (argparse, a missing model, a port in use, a hang) means the command
    or the environment is broken, and every other trial would fail the same way.
    """
    return (
        record.outcome == "failed"
        and record.token_capacity is None
        and record.failure_class not in STARTUP_MEMORY_FAILURES
    )


def _with_log_evidence(record: TrialRecord) -> TrialRecord:
    """:func:`quote_server_log` with the trial's local ``server_log`` artifact (a record that
    quotes it already is returned as it is)."""
    if record.outcome != "failed" or "server_log" not in record.artifacts:
        return record
    try:
        with open(record.artifacts["server_log"], encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return record
    return quote_server_log(record, lines)


def quote_server_log(record: TrialRecord, lines: Sequence[str]) -> TrialRecord:
    """Add the server log's error line to a failure whose evidence is not a log line itself.

    The launcher classifies an exit (``exited with status 2 (argparse) before any startup line``)
    without quoting the server; the user needs the server's words (``--model-path ... is neither a
    directory ...``, ``address already in use``).

    Args:
        record: A trial's record (only a failed one changes).
        lines: The server log's lines, oldest first.

    Returns:
        ``record`` with ``failure_evidence`` ``"<evidence>; server log: <line>"`` and the line
        last in ``log_excerpt``; unchanged when it did not fail, when its evidence is a log line
        or quotes the error line already, or when no line reads like an error.
    """
    if record.outcome != "failed":
        return record
    evidence = record.failure_evidence or ""
    if evidence and any(evidence in line for line in lines):
        return record
    line = log_error_line(lines)
    if line is None or line in evidence:
        return record
    excerpt = [x for x in record.log_excerpt if x != line] + [line]
    return record.model_copy(update={
        "failure_evidence": f"{evidence}; server log: {line}" if evidence else line,
        "log_excerpt": excerpt,
    })


def _server_reason(record: TrialRecord) -> str:
    """One line for the user: the server log's error line, else the failure evidence."""
    evidence = record.failure_evidence or "no reason recorded"
    reason = evidence.split("; server log: ", 1)[1] if "; server log: " in evidence else evidence
    return reason.rstrip(". ")


def _context_tokens(config: TunerConfig) -> int:
    return build_workload(config.workload, seed=config.study.seed).context_tokens


def _mean_request_tokens(config: TunerConfig) -> int:
    return build_workload(config.workload, seed=config.study.seed).mean_request_tokens


def _longest_input(config: TunerConfig) -> int | None:
    spec = config.workload
    return int(spec.input_len) if hasattr(spec, "input_len") else None


def study_hicache(config: TunerConfig, *, device_tokens: int | None, version: str | None,
                  host: HostMemory | None = None, ranks: int = 1) -> HiCacheChoice:
    """The hierarchical cache's place in this study's space (:func:`tuner.study.space.decide_hicache`),
    from the workload's prefix reuse (:func:`tuner.load.workloads.estimate_reuse`, nothing sent)."""
    reuse = None
    if config.space.hierarchical_cache is None:
        reuse = estimate_reuse(build_workload(config.workload, seed=config.study.seed))
    table = FlagTable.for_version(version) if version else None
    return decide_hicache(config.space, reuse=reuse, device_tokens=device_tokens, version=version, table=table,
                          host=host, ranks=ranks)


def resolve_study_space(config: TunerConfig, record: TrialRecord, environment: Mapping[str, Any],
                        context_tokens: int, *, host: HostMemory | None = None, ranks: int = 1) -> Space:
    """The study's space from the baseline's resolved knobs, the predicted capacity ceiling and the
    workload's prefix reuse (whether the hierarchical cache's knobs enter it, :func:`study_hicache`).

    Args:
        config: The config (its ``[space]``, ``[workload]``).
        record: The baseline's record (its params, ``token_capacity`` and ``memory.capacity_model``).
        environment: The run's environment (``gpu_total_mib``, ``sglang_version`` when known).
        context_tokens: The context length of context capacity (tokens).
        host: The host's memory reading (the ``hicache_size`` range), if known.
        ranks: Ranks on the host (``tp × pp``).
    """
    hint = slots = None
    data = record.memory.get("capacity_model")
    if data:
        model = KVCapacityModel.model_validate(data)
        top = model.tokens(0.97)
        hint = max(1, top // max(1, context_tokens))
        slots = reachable_slots(config.budget, max_total_num_tokens=top, context_tokens=context_tokens,
                                mean_request_tokens=_mean_request_tokens(config))
    hicache = study_hicache(config, device_tokens=record.token_capacity, version=environment.get("sglang_version"),
                            host=host, ranks=ranks)
    return resolve_space(config.space, record.params, gpu_total_mib=environment.get("gpu_total_mib"),
                         capacity_hint=hint, slots_hint=slots, hicache=hicache)


def _flag_int(argv: Sequence[str], name: str) -> int | None:
    for i, word in enumerate(argv[:-1]):
        if word == name and argv[i + 1].isdigit():
            return int(argv[i + 1])
    return None


def describe(number: int, record: TrialRecord) -> str:
    """One progress line for a finished trial (``trial 3: capacity 12 × 4096 tokens, 812 tok/s, feasible``)."""
    if record.outcome == "failed":
        if record.failure_class is not None:
            return f"trial {number}: failed ({record.failure_class.value})"
        return f"trial {number}: failed: {record.failure_evidence or 'no evidence recorded'}"
    tput = f"{record.output_throughput_tok_s:.0f} tok/s" if record.output_throughput_tok_s is not None else "no load"
    return (
        f"trial {number}: capacity {record.context_capacity} × {record.context_tokens} tokens, {tput}, "
        f"{'feasible' if record.feasible else 'infeasible'}"
    )
