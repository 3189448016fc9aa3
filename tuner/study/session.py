"""The opening of a run: storage, the study, its environment and heartbeat rule, the result journal's replay, recovery.

One concept: what :class:`tuner.study.loop.StudyRun` holds before its first decision. Before its
baseline (:func:`open_run`), in the order a run needs it: the storage and the target checked, the
study opened (or created, under the schema lock, with its environment and first host's heartbeat
rule), the results a stopped run kept in its journal stored, this host's and dead hosts' RUNNING
trials recovered, and the model settings and fingerprint keys of this run. Once the baseline fixed
the space: the warm start's prior (:func:`with_prior`) and the run's decision chain with its
sampler (:func:`decision_chain`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from tuner.config import TunerConfig, check_url_matches_port
from tuner.load.workloads import build_workload
from tuner.records import StudyInfo, TrialRecord
from tuner.study.baseline import queue_reference
from tuner.study.calibration import ModelSettings
from tuner.study.decide import Decider, Draw, Proposer
from tuner.study.decide.chain import build_chain
from tuner.study.decide.sampler import ProposalMirror
from tuner.study.fingerprint import DeploymentKey, deployment_key, workload_key
from tuner.study.hooks import AfterTell, SaveFingerprint
from tuner.study.hosts import ClaimLock, host_name, is_postgres, reap_stale, recover_own, schema_lock, study_heartbeat
from tuner.study.job import TrialRunner
from tuner.study.optuna_io import ensure_study_info, make_sampler, open_study, records
from tuner.study.outage import ResultJournal
from tuner.study.progress import RunProgress, RunSummary
from tuner.study.record import Recorder
from tuner.study.space import Space
from tuner.study.storage import (
    check_run_storage,
    check_storage_folder,
    open_artifacts_folder,
    open_storage,
    storage_errors,
    study_storage_url,
)
from tuner.study.view import RecordCache
from tuner.study.warm import Prior, is_fresh, warm_start

__all__ = ["Opened", "open_run", "opened_run", "run_summary", "decision_chain", "with_prior"]


@dataclass(frozen=True)
class Opened:
    """What :func:`open_run` opened: the study and what works on it.

    Attributes:
        study: The Optuna study (on the study's heartbeat rule).
        claims: The study's claim lock (:class:`tuner.study.hosts.ClaimLock`).
        recorder: Tells records and stores skips (:class:`tuner.study.record.Recorder`).
        shared: The storage is PostgreSQL (several hosts may run the study).
        environment: This run's environment (SGLang version, GPU, driver, model).
        context_tokens: The study's context length (tokens; the stored study's wins).
        settings: The memory model's settings for this run.
        records: The records read so far (:class:`tuner.study.view.RecordCache`).
        deployment: The deployment's fingerprint key.
        workload: The workload's fingerprint key.
        after_tell: The listeners called after each told launch (:mod:`tuner.study.hooks`: the
            deployment's fingerprint).
        prior: The warm start's prior (another study's fingerprint), once known.
    """

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
    after_tell: tuple[AfterTell, ...] = ()
    prior: Prior | None = None


def run_summary(config: TunerConfig, storage_url: str | None = None) -> RunSummary:
    """A new run's summary: its study, storage (``storage_url``, else the config's) and this host."""
    return RunSummary(study_name=config.study.name, storage_url=storage_url or study_storage_url(config),
                      host=host_name())


@contextlib.contextmanager
def opened_run(config: TunerConfig, runner: TrialRunner, summary: RunSummary, progress: RunProgress, *,
               allow_mixed_environment: bool = False, journal: ResultJournal | None = None) -> Iterator[Opened]:
    """The run's session: :func:`open_run`, then the ``with`` block, where a storage failure (of the
    opening or of the run) is one line naming the file and the fix
    (:func:`tuner.study.storage.storage_errors`).

    Raises:
        StudyError: :func:`open_run`'s, and the storage's failures.
    """
    with storage_errors(summary.storage_url):
        yield open_run(config, runner, summary, progress, allow_mixed_environment=allow_mixed_environment,
                       journal=journal)


def open_run(config: TunerConfig, runner: TrialRunner, summary: RunSummary, progress: RunProgress, *,
             allow_mixed_environment: bool = False, journal: ResultJournal | None = None) -> Opened:
    """Check storage and target, open the study, store or check its environment, take the study's
    heartbeat rule, store the results the journal kept, and recover RUNNING trials.

    Args:
        config: The validated config.
        runner: The trial runner (its environment, target and baseline command).
        summary: The run's summary (its storage URL and host; the recovered trials are set on it).
        progress: Where the notes go (the study's heartbeat rule, replayed results).
        allow_mixed_environment: Add to a study recorded in another environment.
        journal: The result journal (``None``: memory only).

    Returns:
        The :class:`Opened` run.

    Raises:
        StudyError: Storage (an explicit SQLite folder that does not exist), environment mismatch,
            ``[service] url`` not on the command's ``--port``.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = summary.storage_url
    check_storage_folder(url, config.study.name)
    check_run_storage(url, config.study.name)
    check_url_matches_port(runner.target().get("url"), runner.baseline_argv())
    own_beat = (config.storage.heartbeat_interval_s, config.storage.grace_period_s)
    storage = open_storage(url, heartbeat_interval_s=own_beat[0], grace_period_s=own_beat[1],
                           outage_s=config.storage.outage_s)
    environment = runner.environment()
    context_tokens = config.objective.context_tokens or build_workload(config.workload, seed=config.study.seed).context_tokens
    new = StudyInfo(environment=environment, target=runner.target(), baseline_argv=runner.baseline_argv(),
                    policy=config.objective.model_dump(mode="json"), context_tokens=context_tokens,
                    config_path=config.path)
    with schema_lock(url):  # hosts starting together: one creates the study and its info
        study = open_study(config.study.name, storage, make_sampler(config.study.sampler, config.study.seed))
        info = ensure_study_info(study, new, allow_mixed=allow_mixed_environment)
        beat = study_heartbeat(study, *own_beat)
    if beat != own_beat:  # one rule per study for when a trial is dead: the study's
        progress.note(None, f"the study's trials beat every {beat[0]} s with a {beat[1]} s grace period "
                           f"(set by its first host); this host's [storage] {own_beat[0]} s / {own_beat[1]} s "
                           "are not used")
        storage = open_storage(url, heartbeat_interval_s=beat[0], grace_period_s=beat[1],
                               outage_s=config.storage.outage_s)
        study = open_study(config.study.name, storage, make_sampler(config.study.sampler, config.study.seed))
    shared = is_postgres(storage)
    recorder = Recorder(study, open_artifacts_folder(config, url), summary.host, environment, journal=journal)
    replayed = recorder.replay()  # before recovery: a kept result is stored, not re-run
    if replayed:
        progress.note(None, f"stored the result(s) of trial(s) {', '.join(map(str, replayed))} that the "
                           "last run kept in its result journal but did not finish storing (it was stopped, or "
                           "the database did not answer)", phase="recovered")
    summary.recovered = recover_own(study, summary.host, shared=shared) + reap_stale(study)
    queue_reference(study, [(t.number, r) for t, r in records(study)], gate_on=config.quality.enabled, note=progress.note)
    context_tokens = info.context_tokens or context_tokens
    deployment, workload = deployment_key(environment, runner.baseline_argv(), config), workload_key(config, context_tokens)
    return Opened(study=study, claims=ClaimLock.of(study), recorder=recorder, shared=shared,
                  environment=environment, context_tokens=context_tokens,
                  settings=ModelSettings.for_config(config, context_tokens, environment.get("sglang_version")),
                  records=RecordCache(), deployment=deployment, workload=workload,
                  after_tell=(SaveFingerprint(study, config.study.name, deployment, workload, context_tokens),))


def with_prior(opened: Opened, config: TunerConfig, url: str, *, baseline: tuple[int, TrialRecord] | None,
               space: Space, finished: Sequence[tuple[int, TrialRecord]]) -> tuple[Opened, str | None]:
    """``opened`` with the warm start's prior (:func:`tuner.study.warm.warm_start`: another study's
    fingerprint of this deployment, looked up in the storage at ``url`` and beside it) and the
    model settings it starts from, and the progress line saying what was reused or why nothing
    was (``None`` when no fingerprint was found: nothing to say); ``finished`` says whether the
    study is fresh."""
    prior = warm_start(opened.study, url, opened.deployment, workload=opened.workload,
                       baseline=baseline[1] if baseline else None, config=config, space=space,
                       fresh=is_fresh(finished))
    line = prior.warm.line() if prior.warm.source is not None or prior.warm.not_used else None
    return dataclasses.replace(opened, prior=prior, settings=prior.settings(opened.settings, space)), line


def decision_chain(opened: Opened, config: TunerConfig, runner: TrialRunner, space: Space, host: str, *,
                   use_planner: bool, on_skip: Callable[[Draw], bool]) -> tuple[Decider, Proposer]:
    """The run's decider and sampler (:func:`tuner.study.decide.chain.build_chain`) on ``space``.

    The sampler proposes on an in-memory mirror of the study, seeded with the warm start's prior
    trials; on a shared study each host's sampler has a seed of its own (the config's seed plus
    the CRC-32 of ``host``), so hosts do not draw the same configs.
    """
    seed = config.study.seed + (zlib.crc32(host.encode()) % 1_000_003 if opened.shared else 0)
    mirror = ProposalMirror(opened.study.directions, make_sampler(config.study.sampler, seed), space, host)
    if opened.prior is not None and opened.prior.trials:
        mirror.add_prior(opened.prior.trials)
    return build_chain(config, mirror, read_host=runner.host_memory,
                       version=str(opened.environment.get("sglang_version") or "0.5.5"), argv=runner.baseline_argv(),
                       use_planner=use_planner, on_skip=on_skip, gpu=opened.environment.get("gpu_name"))
