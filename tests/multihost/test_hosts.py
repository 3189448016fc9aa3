"""The claim lock, heartbeats and the dead-host reaper against a real PostgreSQL server."""

from __future__ import annotations

import threading
import time
import warnings

import optuna
import pytest
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from tuner.errors import StudyError
from tuner.study.hosts import (
    HOST_ATTR,
    REQUEUED_ATTR,
    ClaimLock,
    Reaped,
    RequeueOnce,
    TrialHeartbeat,
    claim_trial,
    own,
    reap_stale,
    recover_own,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _host_study(url: str, *, interval: int = 1, grace: int = 2) -> optuna.Study:
    """One host's view: its own storage object (its own connections), the shared study."""
    storage = RDBStorage(url, heartbeat_interval=interval, grace_period=grace,
                         heartbeat_stale_trial_callback=RequeueOnce())
    return optuna.create_study(study_name="s", storage=storage, load_if_exists=True)


def _claim(study: optuna.Study, host: str, x: float) -> optuna.Trial:
    trial = study.ask()
    trial.suggest_float("x", 0.0, 1.0)
    trial.set_user_attr(HOST_ATTR, host)
    return trial


def test_claim_lock_excludes_other_hosts_and_names_the_holder(postgres_url: str) -> None:
    a, b = _host_study(postgres_url), _host_study(postgres_url)
    lock_a = ClaimLock.of(a)
    lock_b = ClaimLock.of(b, timeout_s=0.5)
    inside: list[str] = []
    with lock_a.held():
        inside.append("a")
        with pytest.raises(StudyError, match="claim lock for over 0 s .*held by .*backend pid"):
            with lock_b.held():
                inside.append("b")
    with lock_b.held():  # released by a: b gets it at once
        inside.append("b")
    assert inside == ["a", "b"]


def test_claim_lock_serializes_concurrent_critical_sections(postgres_url: str) -> None:
    studies = [_host_study(postgres_url) for _ in range(3)]
    spans: list[tuple[float, float]] = []

    def host(study: optuna.Study) -> None:
        lock = ClaimLock.of(study)
        for _ in range(3):
            with lock.held():
                begun = time.monotonic()
                time.sleep(0.05)
                spans.append((begun, time.monotonic()))

    threads = [threading.Thread(target=host, args=(s,)) for s in studies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert len(spans) == 9
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False)), spans


def test_a_dead_hosts_trial_fails_within_the_grace_period_and_is_queued_once(postgres_url: str) -> None:
    dead, alive = _host_study(postgres_url), _host_study(postgres_url)
    victim = _claim(dead, "host-a", 0.3)
    with TrialHeartbeat(dead, victim.number):
        time.sleep(1.2)  # beats, then host-a "dies": no tell, no more beats
    died = time.monotonic()
    survivor = _claim(alive, "host-b", 0.6)
    reaped: list[int] = []
    with TrialHeartbeat(alive, survivor.number, on_reaped=reaped.extend):
        while not reaped and time.monotonic() - died < 10:
            time.sleep(0.1)
    took = time.monotonic() - died
    assert reaped == [victim.number]
    assert took <= 2 + 1 + 1.5, took  # grace + one beat interval (+ scheduling)
    trials = alive.get_trials()
    assert trials[victim.number].state is TrialState.FAIL
    assert trials[survivor.number].state is TrialState.RUNNING  # its own beats keep it alive
    waiting = [t for t in trials if t.state is TrialState.WAITING]
    assert len(waiting) == 1
    assert waiting[0].params == victim.params
    assert waiting[0].user_attrs[REQUEUED_ATTR] == {"trial": victim.number, "host": "host-a"}
    assert waiting[0].user_attrs["tuner.kind"] == "enqueued" and HOST_ATTR not in waiting[0].user_attrs
    # The re-queued trial dies too: it is not queued a third time.
    retried = alive.ask()
    assert retried.params == victim.params
    own(alive, retried, "host-b", {})  # claimed with a first heartbeat, then never beats again
    time.sleep(3.2)
    with TrialHeartbeat(alive, survivor.number):
        time.sleep(1.5)
    trials = alive.get_trials()
    assert trials[retried.number].state is TrialState.FAIL
    assert not [t for t in trials if t.state is TrialState.WAITING]


def test_a_trial_reaped_while_its_host_chose_is_no_traceback_and_nothing_is_written_to_it(postgres_url: str) -> None:
    """Host A asks a trial and chooses longer than the grace period (a loaded box); host B fails it
    as never claimed and queues its params again. A's claim is then :class:`Reaped` (CI saw an
    ``UpdateFinishedTrialError`` traceback end a three-host run): nothing written, the copy queued."""
    a, b = _host_study(postgres_url), _host_study(postgres_url)
    trial = a.ask()
    trial.suggest_float("x", 0.0, 1.0)
    time.sleep(2.5)  # past the 2 s grace period, unclaimed
    assert reap_stale(b) == [trial.number]
    found = claim_trial(a, trial, "host-a", {}, hold=ClaimLock.of(a).held)
    assert isinstance(found, Reaped) and found.number == trial.number and "choosing again" in str(found)
    after = a.get_trials(deepcopy=False)
    assert after[trial.number].state is TrialState.FAIL and HOST_ATTR not in after[trial.number].user_attrs
    assert [t.state for t in after[trial.number + 1:]] == [TrialState.WAITING]


def test_recover_own_leaves_other_hosts_running_trials(postgres_url: str) -> None:
    study = _host_study(postgres_url, interval=30, grace=120)
    mine, theirs = _claim(study, "host-a", 0.1), _claim(study, "host-b", 0.2)
    assert recover_own(study, "host-a", shared=True) == [mine.number]
    trials = study.get_trials()
    assert trials[mine.number].state is TrialState.FAIL
    assert trials[theirs.number].state is TrialState.RUNNING
    assert [t.params for t in trials if t.state is TrialState.WAITING] == [mine.params]


def test_a_requeued_trial_starts_without_its_dead_predecessors_constraints(postgres_url: str) -> None:
    """A host killed inside ``tell_record`` after the constraints were set and before the tell:
    the copy queued for the dead trial carried them, and telling it warned "constraint already
    set" and kept the dead run's values (the fleet review of issue 29)."""
    dead, alive = _host_study(postgres_url), _host_study(postgres_url)
    victim = _claim(dead, "host-a", 0.3)
    own(dead, victim, "host-a", {})
    victim.set_constraint("oom_or_crash", 1.0)  # the dead run's half-told result
    time.sleep(3.2)  # past the 2 s grace period without a beat
    reaped: list[int] = []
    survivor = _claim(alive, "host-b", 0.6)
    with TrialHeartbeat(alive, survivor.number, on_reaped=reaped.extend):
        while not reaped:
            time.sleep(0.1)
    assert reaped == [victim.number]
    retried = alive.ask()
    assert retried.params == victim.params
    assert not [k for k in alive.get_trials()[retried.number].system_attrs if k.startswith("constraints")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "constraint already set" would be raised here
        retried.set_constraint("oom_or_crash", -1.0)
    alive.tell(retried, 1.0)
    assert alive.get_trials()[retried.number].system_attrs["constraints:oom_or_crash"] == -1.0


def test_missed_beats_warn_once_when_the_trial_nears_its_grace_period(tmp_path, caplog) -> None:  # noqa: ANN001
    """A storage that stops taking beats (its heartbeat table gone, a real SQLite file): each miss
    is an INFO line, and one WARNING comes when the streak reaches the grace period less one
    interval, naming the risk; a shorter outage prints nothing on the terminal."""
    import logging
    import sqlite3

    db = tmp_path / "beats.db"
    study = _host_study(f"sqlite:///{db}", interval=1, grace=3)
    trial = _claim(study, "host-a", 0.5)
    with caplog.at_level(logging.INFO, logger="tuner.study.hosts"):
        with TrialHeartbeat(study, trial.number):
            time.sleep(1.3)  # one beat recorded
            with sqlite3.connect(db) as conn:
                conn.execute("DROP TABLE trial_heartbeats")
            time.sleep(4.0)  # misses at ~2, 3, 4 and 5 s
    misses = [r for r in caplog.records if "not recorded" in r.getMessage()]
    warned = [r for r in misses if r.levelno == logging.WARNING]
    assert len(misses) >= 3 and len(warned) == 1, [r.getMessage() for r in misses]
    assert "3 s grace period: another host may mark the trial FAIL" in warned[0].getMessage()
    first_warning = misses.index(warned[0])
    assert first_warning >= 1 and all(r.levelno == logging.INFO for r in misses[:first_warning])
