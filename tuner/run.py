"""The tuning run: the loop that asks, skips or launches, tells, and stops inside the budget.

One run of ``tuner run``: open (or resume) the study, check the environment, recover trials a killed
run left RUNNING, measure the baseline (the unit's current flags), then repeat until the budget or
the trial cap is spent: take the next enqueued trial, else the planner's memory-model candidate
(:class:`tuner.search.Planner`), else the sampler's; skip without a restart what an earlier failure
proves infeasible (or what was already measured); run the rest through a :class:`TrialRunner`;
tell Optuna. The runner is the seam: :class:`tuner.trial.TrialExecutor` restarts a real (or
simulated) server; the search-quality benchmark plugs in the simulator's offline evaluation.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Protocol

import optuna
from optuna.artifacts import FileSystemArtifactStore, upload_artifact
from optuna.trial import TrialState
from pydantic import BaseModel, ConfigDict, Field

from tuner.budget import Budget, require_one_trial
from tuner.config import TunerConfig
from tuner.errors import StudyError
from tuner.records import StudyInfo, TrialRecord
from tuner.search import Planner, Space, resolve_space
from tuner.sglang.failures import STARTUP_MEMORY_FAILURES, FailureClass
from tuner.sglang.memory import KVCapacityModel, must_fail
from tuner.study import (
    KIND_ATTR,
    BestChoice,
    check_environment,
    choose_best,
    make_sampler,
    open_storage,
    open_study,
    records,
    recover_interrupted,
    save_study_info,
    study_info,
    tell_record,
)

__all__ = ["SPACE_ATTR", "TrialJob", "TrialRunner", "Progress", "RunSummary", "run_study"]

SPACE_ATTR = "tuner.space"
"""Study user attribute holding the resolved :class:`tuner.search.Space` (stable across resumes)."""
PREDICTION_ATTR = "tuner.prediction"
ENVIRONMENT_ATTR = "tuner.environment"
"""Trial user attribute: the SGLang version, GPU, driver and model the trial ran on."""

MAX_INVALID_IN_A_ROW = 3
"""Launched trials failing with ``invalid_arguments`` one after another that stop the run: the
command itself is wrong (or the environment), not the candidate."""

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
    """

    model_config = ConfigDict(frozen=True)

    number: int
    kind: str
    params: dict[str, Any] = Field(default_factory=dict)
    prediction: dict[str, Any] = Field(default_factory=dict)
    context_tokens: int
    capacity_floor: int = 0
    started_at: str = ""


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

    def run(self, job: TrialJob, on_phase: Callable[[str], None]) -> TrialRecord:
        """Run ``job``; call ``on_phase(name)`` as each phase starts. Never raises for a failed
        server: a failure is a record with ``outcome="failed"``."""
        ...


class Progress(BaseModel):
    """A progress event for the CLI.

    Attributes:
        event: ``trial_start``, ``phase``, ``trial_end``, ``skip``, ``stop``.
        number: Trial number (Optuna).
        index: This run's trial count so far (1-based).
        expected: About how many trials the budget allows in this run (``None`` unbounded).
        phase: The current phase.
        eta_s: Seconds left in the budget.
        message: One line for the user.
    """

    model_config = ConfigDict(frozen=True)

    event: str
    number: int | None = None
    index: int = 0
    expected: int | None = None
    phase: str | None = None
    eta_s: float | None = None
    message: str = ""


class RunSummary(BaseModel):
    """What a run did and found.

    Attributes:
        study_name: The study.
        storage_url: Where it is stored.
        trials_run: Trials launched in this run (a restart each).
        trials_skipped: Trials skipped without a restart in this run.
        recovered: Trials a killed run left RUNNING, marked failed and re-enqueued.
        stop_reason: ``budget``, ``trials``, ``interrupted`` or ``exhausted``.
        baseline: The baseline's record (trial number, record).
        best: The chosen best and why.
        elapsed_s: Wall-clock seconds of the run.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    study_name: str
    storage_url: str
    trials_run: int = 0
    trials_skipped: int = 0
    recovered: list[int] = Field(default_factory=list)
    stop_reason: str = "exhausted"
    baseline: tuple[int, TrialRecord] | None = None
    best: BestChoice | None = None
    elapsed_s: float = 0.0


def _key(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(params.items()))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _skip_reason(
    params: Mapping[str, Any], finished: Sequence[tuple[int, TrialRecord]]
) -> tuple[str, int] | None:
    """Why ``params`` need no restart: the same config was measured, or a failure proves it fails."""
    for number, record in finished:
        if record.outcome in ("ok", "failed") and record.params and _key(
            {k: record.params.get(k) for k in params}
        ) == _key(params):
            return f"the same config was measured by trial {number}", number
    failures = [(n, r) for n, r in finished if r.outcome == "failed" and r.failure_class is not None]
    if failures:
        proved, index = must_fail(dict(params), [(dict(r.params), _monotone_class(r.failure_class)) for _, r in failures])
        if proved and index is not None:
            number, record = failures[index]
            return (
                f"must fail: trial {number} failed with {record.failure_class.value} at "
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


def _set_params(study: optuna.Study, trial: optuna.Trial, space: Space, params: Mapping[str, Any]) -> None:
    """Store the baseline's resolved knobs as the Optuna params of its trial."""
    storage = study._storage  # noqa: SLF001 - the storage API is public; the study holds it
    trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, trial.number)  # noqa: SLF001
    for name, dist in space.distributions().items():
        if name not in params or params[name] is None:
            continue
        value = params[name]
        try:
            internal = dist.to_internal_repr(value)
        except ValueError:
            continue
        if dist._contains(internal):  # noqa: SLF001
            storage.set_trial_param(trial_id, name, internal, dist)


def run_study(
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
) -> RunSummary:
    """Run (or resume) the study until the budget, the trial cap, or the search runs out.

    Args:
        config: The validated config.
        runner: Runs one trial (real launcher or offline evaluation).
        budget_s: Wall-clock budget in seconds (``None``: unbounded, then ``max_trials`` must be
            given).
        max_trials: Cap on trials launched or skipped in this run.
        allow_mixed_environment: Add trials even if the environment differs from the study's.
        storage_url: Override of the config's storage URL (``:memory:`` for the benchmark).
        on_progress: Receives :class:`Progress` events.
        clock: Monotonic clock (injectable).
        use_planner: Enqueue the memory model's candidates (off: the sampler alone, for the
            search-quality benchmark's comparison).

    Returns:
        The summary, with the best trial chosen by the config's policy.

    Raises:
        StudyError: Storage (an explicit SQLite folder that does not exist), environment mismatch,
            ``[service] url`` not on the command's ``--port``, neither budget nor trial cap given;
            after the trial is stored: the baseline could not start for a reason other than
            memory, or :data:`MAX_INVALID_IN_A_ROW` trials in a row failed ``invalid_arguments``
            (the message quotes the server log's error line).
        ConfigError: ``budget_s`` is shorter than one trial's estimated cost.
        KeyboardInterrupt: Ctrl-C or SIGTERM; the trial in flight is stored as FAIL with its
            partial record and its params re-enqueued.
    """
    if budget_s is None and max_trials is None:
        raise StudyError("no --budget and no --trials given", hint="pass e.g. --budget 4h or --trials 20")
    started = clock()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    emit = on_progress or (lambda _p: None)
    url = storage_url or config.storage_url()
    _check_storage_folder(url, default_url=f"sqlite:///studies/{config.study.name}.db")
    _check_url_matches_port(runner.target().get("url"), runner.baseline_argv())
    study = open_study(config.study.name, open_storage(url), make_sampler(config.study.sampler, config.study.seed))
    summary = RunSummary(study_name=config.study.name, storage_url=url)

    environment = runner.environment()
    info = study_info(study)
    if info is not None:
        check_environment(info.environment, environment, allow_mixed=allow_mixed_environment)
    summary.recovered = recover_interrupted(study)
    context_tokens = config.objective.context_tokens or _context_tokens(config)
    if info is None:
        info = StudyInfo(
            environment=environment,
            target=runner.target(),
            baseline_argv=runner.baseline_argv(),
            policy=config.objective.model_dump(mode="json"),
            context_tokens=context_tokens,
            config_path=config.path,
        )
        save_study_info(study, info)
    context_tokens = info.context_tokens or context_tokens

    budget = Budget(budget_s, reserve_s=config.budget.restore_reserve_s, clock=clock)

    def history() -> list[tuple[int, TrialRecord]]:
        return [(t.number, r) for t, r in records(study)]

    def durations() -> list[float]:
        return [r.duration_s or 0.0 for _, r in history() if r.outcome in ("ok", "failed")]
    if budget_s is not None:
        require_one_trial(budget_s, Budget.estimate(durations(), runner.prior_cost_s()).seconds,
                          reserve_s=config.budget.restore_reserve_s)
    artifact_store = None
    if url != ":memory:":
        folder = config.artifacts_dir()
        if config.storage.artifacts_dir and not folder.parent.is_dir():
            raise StudyError(
                f"[storage] artifacts_dir {str(folder)!r}: its folder {str(folder.parent)!r} does not exist",
                hint="create it, or point artifacts_dir at an existing folder",
            )
        folder.mkdir(parents=True, exist_ok=True)
        artifact_store = FileSystemArtifactStore(str(folder))
    launched = 0
    handled = 0
    invalid_in_a_row = 0

    def expected() -> int | None:
        cost = Budget.estimate(durations(), runner.prior_cost_s()).seconds
        left = budget.trials_left(cost)
        if left is None:
            return max_trials
        total = handled + left
        return min(total, max_trials) if max_trials else total

    def run_one(
        trial: optuna.Trial, job: TrialJob, before_tell: Callable[[TrialRecord], None] | None = None
    ) -> TrialRecord:
        nonlocal launched
        emit(Progress(event="trial_start", number=job.number, index=handled + 1, expected=expected(),
                      eta_s=budget.remaining_s(), message=f"trial {job.number} ({job.kind})"))
        begun = clock()
        trial.set_user_attr(ENVIRONMENT_ATTR, environment)

        def on_phase(name: str) -> None:
            emit(Progress(event="phase", number=job.number, index=handled + 1, expected=expected(),
                          phase=name, eta_s=budget.remaining_s(), message=f"trial {job.number}: {name}"))

        try:
            record = runner.run(job, on_phase)
        except KeyboardInterrupt:
            partial = TrialRecord(params=job.params, kind=_kind(job.kind), outcome="failed",
                                  failure_evidence="interrupted (Ctrl-C or SIGTERM) during the trial",
                                  started_at=job.started_at, duration_s=clock() - begun)
            trial.set_user_attr("tuner.record", partial.model_dump(mode="json"))
            study.tell(trial, state=TrialState.FAIL)
            if job.params:
                study.enqueue_trial(dict(trial.params), user_attrs={KIND_ATTR: "enqueued"})
            raise
        launched += 1
        record = _with_log_evidence(record)
        record = _upload_artifacts(trial, record, artifact_store)
        if record.duration_s is None:
            record = record.model_copy(update={"duration_s": clock() - begun})
        if before_tell is not None:
            before_tell(record)
        tell_record(study, trial, record)
        emit(Progress(event="trial_end", number=job.number, index=handled + 1, expected=expected(),
                      eta_s=budget.remaining_s(), message=_describe(job.number, record)))
        return record

    def stop(reason: str) -> None:
        summary.stop_reason = reason
        emit(Progress(event="stop", index=handled, eta_s=budget.remaining_s(), message=f"stopped: {reason}"))

    def can_continue() -> bool:
        if max_trials is not None and handled >= max_trials:
            stop("trials")
            return False
        cost = Budget.estimate(durations(), runner.prior_cost_s())
        if not budget.fits(cost.seconds):
            stop("budget")
            return False
        return True

    # The baseline: the unit's current flags, measured once per study.
    baseline = _baseline(history())
    if baseline is None and can_continue():
        trial = study.ask()
        trial.set_user_attr(KIND_ATTR, "baseline")
        job = TrialJob(number=trial.number, kind="baseline", context_tokens=context_tokens, started_at=_now())

        def fix_space(record: TrialRecord) -> None:
            # The space derives from what the baseline resolved; its knobs become its params.
            space = _resolve(config, record, environment, context_tokens)
            study.set_user_attr(SPACE_ATTR, space.model_dump(mode="json"))
            _set_params(study, trial, space, record.params)

        record = run_one(trial, job, fix_space)
        handled += 1
        if _could_not_start(record):
            raise StudyError(
                f"the baseline (trial {trial.number}, the service's own flags) could not start "
                f"({record.failure_class.value if record.failure_class else 'failed'}): "
                f"{_server_reason(record)}; the service was restored to its original flags",
                hint=f"fix the service command or environment and run again (`tuner show {trial.number}` has the log)",
            )
        baseline = (trial.number, record)
    summary.baseline = baseline
    space_data = study.user_attrs.get(SPACE_ATTR)
    if space_data is None:
        raise StudyError(
            f"study {config.study.name!r} has no baseline trial to derive its search space from",
            hint="run again with a budget long enough for one trial",
        )
    space = Space.model_validate(space_data)
    planner = Planner(
        space,
        context_tokens,
        capacity_tolerance=config.objective.capacity_tolerance,
        longest_input_tokens=_longest_input(config),
    )

    while summary.stop_reason == "exhausted" and can_continue():
        done = history()
        tried = {_key(space.snap(r.params)) for _, r in done if r.params}
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        tried |= {_key(space.snap(t.params)) for t in waiting}
        predicted = sum(1 for _, r in done if r.kind == "predicted")
        if not waiting and use_planner and predicted < config.study.predicted_candidates:
            candidate = planner.next(done, tried)
            if candidate is not None:
                study.enqueue_trial(
                    candidate.params,
                    user_attrs={KIND_ATTR: "predicted", PREDICTION_ATTR: candidate.prediction},
                )
        trial = study.ask()
        kind = str(trial.user_attrs.get(KIND_ATTR, "sampled"))
        params = space.suggest(trial)
        prediction = dict(trial.user_attrs.get(PREDICTION_ATTR) or {})
        best = choose_best(done, policy="max_capacity")
        floor = 0
        if best is not None and config.budget.probe_only_below > 0:
            floor = int(config.budget.probe_only_below * (best.record.context_capacity or 0))
        reason = _skip_reason(params, done)
        if reason is None and kind == "sampled" and use_planner:
            reason = planner.screen(params, done, capacity_floor=floor)
        if reason is not None:
            text, proof = reason
            record = TrialRecord(params=params, kind=_kind(kind), outcome="skipped", skipped_reason=text,
                                 proved_by_trial=proof, prediction=prediction, started_at=_now(),
                                 duration_s=0.0, constraints={"oom_or_crash": 1.0, "slo": 1.0, "stress": 1.0})
            tell_record(study, trial, record)
            summary.trials_skipped += 1
            handled += 1
            emit(Progress(event="skip", number=trial.number, index=handled, expected=expected(),
                          eta_s=budget.remaining_s(), message=f"trial {trial.number} skipped: {text}"))
            if summary.trials_skipped > 200:
                stop("exhausted")
            continue
        job = TrialJob(number=trial.number, kind=kind, params=params, prediction=prediction,
                       context_tokens=context_tokens, capacity_floor=floor, started_at=_now())
        record = run_one(trial, job)
        handled += 1
        invalid = record.outcome == "failed" and record.failure_class is FailureClass.INVALID_ARGUMENTS
        invalid_in_a_row = invalid_in_a_row + 1 if invalid else 0
        if invalid_in_a_row >= MAX_INVALID_IN_A_ROW:
            raise StudyError(
                f"{invalid_in_a_row} trials in a row (the last {trial.number}) were rejected as invalid_arguments: "
                f"{_server_reason(record)}; the service was restored to its original flags",
                hint=f"fix the service command or the [space] and run again (`tuner show {trial.number}` has the log)",
            )

    summary.trials_run = launched
    summary.best = choose_best(
        history(),
        policy=config.objective.policy,
        capacity_tolerance=config.objective.capacity_tolerance,
        throughput_noise=config.objective.throughput_noise,
    )
    summary.elapsed_s = clock() - started
    return summary


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


_ERROR_LINE_RE = re.compile(r"(?i)\berror\b|exception|address already in use|no such file|not found")


def _log_error_line(lines: Sequence[str]) -> str | None:
    """The server's own reason in its log: the last line that reads like an error."""
    for line in reversed(lines):
        text = line.strip()
        if text and _ERROR_LINE_RE.search(text) and not text.startswith("Traceback"):
            return text[:400]
    return None


def _with_log_evidence(record: TrialRecord) -> TrialRecord:
    """Add the server log's error line to a failure whose evidence is not a log line itself.

    The launcher classifies an exit (``exited with status 2 (argparse) before any startup line``)
    without quoting the server; the user needs the server's words (``--model-path ... is neither a
    directory ...``, ``address already in use``). Reads the trial's local ``server_log`` artifact.
    """
    if record.outcome != "failed" or "server_log" not in record.artifacts:
        return record
    try:
        with open(record.artifacts["server_log"], encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return record
    evidence = record.failure_evidence or ""
    if evidence and any(evidence in line for line in lines):
        return record
    line = _log_error_line(lines)
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


def _check_storage_folder(url: str, *, default_url: str) -> None:
    """Refuse an explicit SQLite URL whose folder does not exist (only ``studies/`` is created).

    Raises:
        StudyError: The folder of an explicit ``sqlite:///`` path is missing.
    """
    if url == default_url or not url.startswith("sqlite:///"):
        return
    from pathlib import Path

    folder = Path(url.removeprefix("sqlite:///")).parent
    if not folder.is_dir():
        raise StudyError(
            f"storage {url!r}: folder {str(folder)!r} does not exist",
            hint="create it first, or use an existing folder (the default sqlite:///studies/<study>.db is created)",
        )


def _check_url_matches_port(url: str | None, argv: Sequence[str]) -> None:
    """Refuse a ``[service] url`` whose port differs from the command's ``--port`` (§2.4: default 30000).

    Every trial would otherwise wait the whole start timeout for a server listening elsewhere.

    Raises:
        StudyError: Both name a port and they differ.
    """
    from urllib.parse import urlsplit

    port = None
    for i, word in enumerate(argv):
        if word == "--port" and i + 1 < len(argv):
            port = argv[i + 1]
        elif word.startswith("--port="):
            port = word.split("=", 1)[1]
    if not url or port is None:
        return
    try:
        url_port = urlsplit(url).port
    except ValueError:
        return
    if url_port is not None and str(url_port) != port.strip():
        raise StudyError(
            f"[service] url {url!r} uses port {url_port} but the server command has --port {port}",
            hint=f"make them match (e.g. url = \"http://127.0.0.1:{port}\")",
        )


def _context_tokens(config: TunerConfig) -> int:
    from tuner.load.workloads import build_workload

    return build_workload(config.workload, seed=config.study.seed).context_tokens


def _longest_input(config: TunerConfig) -> int | None:
    spec = config.workload
    for name in ("input_len",):
        if hasattr(spec, name):
            return int(getattr(spec, name))
    return None


def _resolve(config: TunerConfig, record: TrialRecord, environment: Mapping[str, Any], context_tokens: int) -> Space:
    """Resolve the space from the baseline's resolved knobs and the predicted capacity ceiling."""
    hint = None
    data = record.memory.get("capacity_model")
    if data:
        model = KVCapacityModel.model_validate(data)
        hint = max(1, model.tokens(0.97) // max(1, context_tokens))
    return resolve_space(config.space, record.params, gpu_total_mib=environment.get("gpu_total_mib"), capacity_hint=hint)


def _describe(number: int, record: TrialRecord) -> str:
    if record.outcome == "failed":
        if record.failure_class is not None:
            return f"trial {number}: failed ({record.failure_class.value})"
        return f"trial {number}: failed: {record.failure_evidence or 'no evidence recorded'}"
    tput = f"{record.output_throughput_tok_s:.0f} tok/s" if record.output_throughput_tok_s is not None else "no load"
    return (
        f"trial {number}: capacity {record.context_capacity} × {record.context_tokens} tokens, {tput}, "
        f"{'feasible' if record.feasible else 'infeasible'}"
    )

