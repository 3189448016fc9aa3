"""Record: what the study stores of each decision and each launch, and how a failed store ends.

One :class:`Recorder` per run stores, on the study it opened: a proposal's trial (enqueued, then
asked), a skip (PRUNED with its reason and proving trial), a sampler's rejected draw (in one write,
from a background thread, :class:`SkipWriter`), a launched trial's record (artifacts uploaded to Optuna's artifact store, then
:func:`tuner.study.optuna_io.tell_record`), and an interrupted trial (FAIL, its params queued
again). A result another host failed meanwhile is stored as a trial of its own; one the database
cannot take is logged in one line with its values, and the run stops.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import optuna
from optuna.artifacts import FileSystemArtifactStore, upload_artifact
from optuna.distributions import distribution_to_json, json_to_distribution
from optuna.trial import TrialState
from sqlalchemy.exc import SQLAlchemyError

from tuner.errors import HookError, ServiceControlError, StudyError, first_line
from tuner.records import RECORD_ATTR, Prediction, TrialRecord
from tuner.sglang.failures import FailureClass
from tuner.sglang.numerics import numerics_changes
from tuner.study.decide import Draw, Proposal, Skip, record_kind
from tuner.study.hosts import add_record, trial_id
from tuner.study.job import TrialJob
from tuner.study.launch import launch_fields, record_numerics
from tuner.study.optuna_io import (
    ENVIRONMENT_ATTR,
    HOST_ATTR,
    KIND_ATTR,
    LATE_ATTR,
    PHASE_ATTR,
    PREDICTION_ATTR,
    REPEAT_ATTR,
    SPACE_ATTR,
    fail_trial,
    record_of,
    tell_record,
)
from tuner.study.outage import ResultJournal, StorageOutage, db_reason, impatient, storage_refuses
from tuner.study.space import Space

__all__ = ["Recorder", "SkipWriter", "server_reason", "launch_stopped"]

_log = logging.getLogger(__name__)


NUMERICS_ATTR = "tuner.changes_numerics"
"""Trial attribute: the numerics flags a trial's params change against the baseline (a list; absent = none)."""


class Recorder:
    """Stores one run's decisions and results in its study.

    Args:
        study: The study the run opened.
        artifacts_dir: The folder of the study's Optuna artifact store (``None``: nothing is
            uploaded, the in-memory study).
        host: This host's name (:data:`~tuner.study.optuna_io.HOST_ATTR` of what it stores).
        environment: This run's environment (stored on a late result).
        journal: Where a launched trial's result is kept until the database has it (``None``:
            nowhere but memory, the offline benchmark).
    """

    def __init__(self, study: optuna.Study, artifacts_dir: Path | None, host: str,
                 environment: Mapping[str, Any], journal: ResultJournal | None = None) -> None:
        self.study = study
        self.artifacts_dir = artifacts_dir
        self.artifact_store = FileSystemArtifactStore(artifacts_dir) if artifacts_dir is not None else None
        self.host = host
        self.environment = dict(environment)
        self._base_numerics: dict[str, Any] | None = None
        self.journal = journal
        self.writer = SkipWriter(study)

    def ask(self, proposal: Proposal) -> optuna.Trial:
        """The trial for ``proposal``: enqueued with its kind, prediction and the trial it
        repeats, then asked (Optuna hands out the oldest waiting trial: a queued one, for
        :attr:`~tuner.study.decide.Proposal.from_queue`)."""
        if not proposal.from_queue:
            attrs: dict[str, Any] = {KIND_ATTR: proposal.kind}
            if proposal.prediction.stored():
                attrs[PREDICTION_ATTR] = proposal.prediction.stored()
            if proposal.repeat_of is not None:
                attrs[REPEAT_ATTR] = proposal.repeat_of
            changed = self.numerics_changes(proposal.params)
            if changed:
                attrs[NUMERICS_ATTR] = changed
            self.study.enqueue_trial(proposal.params, user_attrs=attrs)
        return self.study.ask()

    def numerics_changes(self, params: Mapping[str, Any]) -> list[str]:
        """The numerics flags (:func:`tuner.sglang.numerics.numerics_changes`) on which the launch
        of ``params`` (:func:`tuner.study.launch.launch_fields`: DP attention's and speculative
        decoding's switches rendered as the trial renders them) differs from the baseline's
        launch: its measured numerics, or before it is measured the structural levers' first
        choices in the study's space (:func:`tuner.study.space.resolve_space` puts the baseline's
        value there). Stored as the trial's ``tuner.changes_numerics`` attribute: the quality
        gate's scope (issues 23, 24, 38: ``dp_size`` 4 over 1 read as no change)."""
        baseline = self._baseline_numerics()
        if baseline is None:
            stored = self.study.user_attrs.get(SPACE_ATTR)
            levers = Space.model_validate(stored).levers if stored else {}
            baseline = {name: choices[0] for name, choices in levers.items() if choices}
        return numerics_changes(launch_fields(params, baseline), launch_fields({}, baseline))

    def _baseline_numerics(self) -> dict[str, Any] | None:
        """The measured baseline's numerics key, read once (a finished record never changes)."""
        if self._base_numerics is None:
            for trial in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
                record = record_of(trial)
                if record is not None and record.kind == "baseline" and record.outcome == "ok":
                    self._base_numerics = record_numerics(record)
                    break
        return self._base_numerics

    def skip(self, trial: optuna.Trial, params: Mapping[str, Any], kind: str, prediction: Prediction,
             skip: Skip) -> None:
        """Tell the asked ``trial`` PRUNED with the reason and the proving trial (no restart)."""
        trial.set_user_attr(HOST_ATTR, self.host)
        tell_record(self.study, trial, skip.record(params, kind, prediction))

    def store_draw(self, draw: Draw) -> None:
        """Store a sampler's rejected draw as a finished trial, in the background.

        Raises:
            Exception: What an earlier background write raised (the database stopped answering).
        """
        self.writer.store(draw.optuna_params, draw.distributions, draw.record, {HOST_ATTR: self.host})

    def phase(self, trial: optuna.Trial, name: str) -> None:
        """Store that ``trial`` entered phase ``name`` (for readers only: a trial never waits for the
        database for it; a failed write is logged, a full disk named once by the result's write)."""
        try:
            with impatient():
                trial.set_user_attr(PHASE_ATTR, name)
        except (optuna.exceptions.StorageInternalError, SQLAlchemyError) as err:
            (_log.debug if storage_refuses(err) else _log.warning)(
                "trial %d: phase %s not stored: %s", trial.number, name, db_reason(err))

    @contextlib.contextmanager
    def interruptible(self, trial: optuna.Trial, job: TrialJob, elapsed_s: Callable[[], float]) -> Iterator[None]:
        """Run ``job``'s trial in the ``with`` block: Ctrl-C or SIGTERM, or a service the host
        refused to change (:class:`~tuner.errors.ServiceControlError`, a failed ``[service]`` hook
        included), stores it as :meth:`interrupted` (``elapsed_s``: its seconds so far) and raises on."""
        try:
            yield
        except (KeyboardInterrupt, ServiceControlError) as err:
            self.interrupted(trial, job, err, elapsed_s=elapsed_s())
            raise

    def interrupted(self, trial: optuna.Trial, job: TrialJob, err: BaseException, *, elapsed_s: float) -> None:
        """Store a trial cut short (Ctrl-C or SIGTERM, a ``[service]`` hook that failed, or a
        service the host refused to change, ``err``) as FAIL with a partial record naming which; a
        candidate's params are queued again."""
        if isinstance(err, KeyboardInterrupt):
            why = "interrupted (Ctrl-C or SIGTERM) during the trial"
        elif isinstance(err, HookError):  # the drain or the return to the load balancer, not the service
            why = f"not measured: {err.message}"
        else:
            why = f"not run: the service could not be changed ({getattr(err, 'message', err)})"
        partial = TrialRecord(params=job.params, kind=record_kind(job.kind), outcome="failed", failure_evidence=why,
                              started_at=job.started_at, duration_s=elapsed_s)
        fail_trial(self.study, trial, partial, requeue=bool(job.params))

    def check_journal(self, trial: optuna.Trial, job: TrialJob, record: TrialRecord) -> None:
        """Stop the run on a trial whose journal stopped answering (``journal_unreadable``): stored
        as FAIL (not the candidate's failure, not a measurement: measured again next run).

        Raises:
            StudyError: The journal stopped answering during the trial.
        """
        if record.failure_class is not FailureClass.JOURNAL_UNREADABLE:
            return
        fail_trial(self.study, trial, record.model_copy(update={"artifacts": {}}), requeue=bool(job.params))
        raise StudyError(
            f"trial {job.number} stopped: the service manager's journal stopped answering "
            f"({record.failure_evidence}); the trial is recorded as journal_unreadable, not measured, "
            "and the service was restored",
            hint="check journald (systemctl status systemd-journald; journalctl --verify) and run the "
            "same command again to resume",
        )

    def tell(self, trial: optuna.Trial, record: TrialRecord) -> TrialRecord:
        """Complete a launched trial's ``record`` (artifact ids for its files) and tell Optuna;
        the result is kept in the journal from just before until the database has it.

        Returns:
            The stored record.

        Raises:
            StorageOutage: The database did not answer within ``[storage] outage_s`` (the result
                stays in the journal; the next run on this host stores it first).
            StudyError: The database refused the result (it is logged in one line first).
        """
        kind = str(trial.user_attrs.get(KIND_ATTR, "sampled"))
        kept = False
        full = False
        try:
            record, full = _upload_artifacts(trial, record, self.artifact_store)  # Optuna stores each artifact's id
            kept = self._keep(trial, kind, record)
            self._store(trial, trial.params, trial.distributions, kind, record)
        except StorageOutage as err:
            if not kept:  # the artifacts' files stay in the artifact store; their ids were not stored
                self._keep(trial, kind, record.model_copy(update={"artifacts": {}}))
            where = f"kept in {self.journal.path}" if self.journal is not None else "in the warning above"
            _log.warning("trial %d not stored: params %s, context capacity %s, output %s tok/s, outcome %s",
                         trial.number, json.dumps(record.params, sort_keys=True), record.context_capacity,
                         record.output_throughput_tok_s, record.outcome)
            raise StorageOutage(f"{err.message}: trial {trial.number}'s result is {where} and the next run "
                                "on this host stores it first; the service was restored", hint=err.hint) from err
        except (optuna.exceptions.StorageInternalError, SQLAlchemyError) as err:
            if storage_refuses(err) and (kept or self._keep(trial, kind, record.model_copy(update={"artifacts": {}}))):
                raise  # a full or read-only storage: named as such by storage_errors; the result is in the journal
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
        if self.journal is not None:
            self.journal.stored(trial.number)
        if full:  # the result is stored; the next trial's files would not be
            raise StudyError(
                f"the disk holding the artifact folder {str(self.artifacts_dir)!r} is full; every trial finished "
                f"before is stored, trial {trial.number}'s result too (without its files), and the service was "
                "restored",
                hint=f"free space on it (df -h {self.artifacts_dir}) and run the same command again to resume",
            )
        return record

    def _keep(self, trial: optuna.Trial, kind: str, record: TrialRecord) -> bool:
        """Keep ``record`` in the journal until the database has it (whether there is one)."""
        if self.journal is None:
            return False
        distributions = {k: distribution_to_json(d) for k, d in trial.distributions.items()}
        self.journal.keep(trial.number, {"record": record.model_dump(mode="json"), "kind": kind,
                                         "params": trial.params, "distributions": distributions})
        return True

    def replay(self) -> list[int]:
        """Store the results an earlier run of this study on this host kept in the journal (it
        stopped because the database did not answer), each exactly once: told on its trial when
        that is still RUNNING, left as it is when the trial already holds it (the answer to the
        tell was lost), stored as a late trial of its own when another host failed the trial.

        Returns:
            The numbers of the trials whose results were stored now.
        """
        if self.journal is None:
            return []
        done = []
        trials = self.study.get_trials(deepcopy=False)
        for entry in self.journal.pending():
            number = int(entry["number"])
            record = TrialRecord.model_validate(entry["record"])
            frozen = trials[number] if number < len(trials) else None
            if frozen is not None and not (frozen.state.is_finished() and RECORD_ATTR in frozen.user_attrs
                                           and frozen.state is not TrialState.FAIL):
                distributions = {k: json_to_distribution(v) for k, v in entry.get("distributions", {}).items()}
                trial = optuna.trial.Trial(self.study, trial_id(self.study, number))
                self._store(trial, entry.get("params", {}), distributions, str(entry.get("kind", "sampled")), record)
                done.append(number)
            self.journal.stored(number)
        return done

    def _store(self, trial: optuna.Trial, params: Mapping[str, Any], distributions: Mapping[str, Any], kind: str,
               record: TrialRecord) -> None:
        """Tell ``trial`` its ``record``; a trial another host failed meanwhile gets a late trial."""
        try:
            tell_record(self.study, trial, record)
        except optuna.exceptions.UpdateFinishedTrialError:
            stored = self.study.get_trials(deepcopy=False)[trial.number]
            if stored.state is not TrialState.FAIL and RECORD_ATTR in stored.user_attrs:
                return  # a tell whose answer was lost in an outage, retried: stored once already
            # Cut off from the database for longer than the grace period: the other hosts marked
            # this trial FAIL (and queued its params again). The measurement is still good: store
            # it as a trial of its own; the queued copy is then skipped as measured.
            number = add_record(self.study, params, distributions, record,
                                {HOST_ATTR: self.host, ENVIRONMENT_ATTR: self.environment,
                                 KIND_ATTR: kind, LATE_ATTR: trial.number})
            _log.warning("trial %d was marked FAIL by another host while this host could not reach the "
                         "database; its result is stored as trial %d", trial.number, number)

    def flush(self) -> None:
        """Wait until every background write is stored.

        Raises:
            Exception: What a write raised.
        """
        self.writer.flush()

    def close(self) -> None:
        """Wait for the queued writes and end the writer's thread (errors are :meth:`flush`'s)."""
        self.writer.close()


def server_reason(record: TrialRecord) -> str:
    """One line for the user: the server log's error line, else the failure evidence."""
    evidence = record.failure_evidence or "no reason recorded"
    reason = evidence.split("; server log: ", 1)[1] if "; server log: " in evidence else evidence
    return reason.rstrip(". ")


def launch_stopped(what: str, record: TrialRecord, *, fix: str, show: str) -> StudyError:
    """The error that stops a run on a launch whose command is wrong (the baseline that could not
    start, a streak of ``invalid_arguments``): ``what`` happened, the server's reason
    (:func:`server_reason`), what to ``fix`` and the ``show`` command that has the log."""
    return StudyError(f"{what}: {server_reason(record)}; the service was restored to its original flags",
                      hint=f"fix the service command or {fix} and run again (`{show}` has the log)")


def _upload_artifacts(trial: optuna.Trial, record: TrialRecord,
                      store: FileSystemArtifactStore | None) -> tuple[TrialRecord, bool]:
    """Upload the runner's artifact files to Optuna's artifact store; keep name → artifact id.

    A file that cannot be stored is left out (the others are kept), in one warning line per
    trial; when the store's disk is full (``ENOSPC``/``EDQUOT``) the warning is left to the
    caller, which stores the result first and then stops the run.

    Returns:
        The record with artifact ids, and whether the store's disk is full.
    """
    if store is None or not record.artifacts:
        return record, False
    ids, failed, full = {}, [], False
    for name, path in record.artifacts.items():
        try:
            ids[name] = upload_artifact(artifact_store=store, file_path=path, study_or_trial=trial)
        except (OSError, ValueError) as err:
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                full = True
            failed.append(f"{name} ({err})")
    if failed and not full:
        _log.warning("trial %d: artifacts not stored (the result is): %s", trial.number, "; ".join(failed))
    return record.model_copy(update={"artifacts": ids}), full


class SkipWriter:
    """Stores the sampler's skipped proposals in the shared study from one background thread, in
    the order they were skipped.

    A skip is a decision, not a measurement, and the loop goes on drawing while it is written: on
    a shared PostgreSQL study with four hosts on one box, a write (:func:`tuner.study.hosts.add_record`) took about
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
