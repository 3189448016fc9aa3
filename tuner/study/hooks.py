"""What runs after a launched trial is told: listeners of one method each (Optuna's ``optimize(callbacks=...)``).

The run (:meth:`tuner.study.loop.StudyRun.record`) calls each listener of its opening
(:attr:`tuner.study.session.Opened.after_tell`) with the told record and the study's finished
trials, after the record is stored and before the progress line. A listener stores nothing a run
waits for: a database that does not answer is logged, never raised. The next one (a notification,
a GPU-health check) is a class here and one more item of the opening's tuple.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import optuna
from sqlalchemy.exc import SQLAlchemyError

from tuner.records import TrialRecord
from tuner.study.fingerprint import DeploymentKey, fingerprint_of, save_fingerprint
from tuner.study.outage import db_reason, impatient

__all__ = ["AfterTell", "SaveFingerprint"]

_log = logging.getLogger(__name__)


class AfterTell(Protocol):
    """A listener of told launches."""

    def after_tell(self, number: int, record: TrialRecord, finished: Sequence[tuple[int, TrialRecord]]) -> None:
        """Trial ``number``'s ``record`` was told; ``finished`` is the study's finished trials now."""


class SaveFingerprint:
    """The deployment's fingerprint (:mod:`tuner.study.fingerprint`), saved with each start's facts
    after a launch that started (``ok`` or ``failed``), for later studies only: a run never waits
    for the database for it.

    Args:
        study: The study it is stored with.
        name: The study's name.
        deployment: The deployment's key.
        workload: The workload's key.
        context_tokens: The study's context length (tokens).
    """

    def __init__(self, study: optuna.Study, name: str, deployment: DeploymentKey, workload: str, context_tokens: int) -> None:
        self.study = study
        self.name = name
        self.deployment = deployment
        self.workload = workload
        self.context_tokens = context_tokens

    def after_tell(self, number: int, record: TrialRecord, finished: Sequence[tuple[int, TrialRecord]]) -> None:
        """Save the fingerprint of ``finished`` when ``record`` started; a failed write is one warning."""
        if record.outcome not in ("ok", "failed"):
            return
        fingerprint = fingerprint_of(self.name, self.deployment, finished, workload=self.workload,
                                     context_tokens=self.context_tokens)
        try:
            with impatient():
                save_fingerprint(self.study, fingerprint)
        except (optuna.exceptions.StorageInternalError, SQLAlchemyError) as err:
            _log.warning("trial %d: fingerprint not stored: %s", number, db_reason(err))
