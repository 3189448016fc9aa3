"""The study's database goes away mid-run: a real PostgreSQL server, started by the test, stopped.

The first tests are the guarded path itself (:class:`tuner.study.outage.PatientStorage` and the
claim lock) against a server stopped and started again. The last two are the fleet: three
``tuner run`` processes on one study, the server stopped for 20 s (within ``[storage]
outage_s``: no host exits, every trial stored once) and for longer than the limit (every host
stops with one line, its service restored, and its next run stores the result it kept).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import requests
from optuna.trial import TrialState

from tests.support.cli import TUNER, run_tuner
from tests.support.configs import config_copy, service_url
from tests.support.postgres import PASSWORD, USER, PostgresCluster, boot_postgres, missing_reason
from tests.support.study_factory import stored_trials
from tuner.errors import StudyError
from tuner.records import RECORD_ATTR, TrialRecord
from tuner.study.hosts import ClaimLock, claim_trial, trial_id
from tuner.study.optuna_io import HOST_ATTR, LATE_ATTR, PHASE_ATTR
from tuner.study.outage import StorageOutage
from tuner.study.storage import open_storage

HOSTS = ("host-a", "host-b", "host-c")

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or "")


@pytest.fixture
def cluster() -> Iterator[PostgresCluster]:
    """A private cluster of this test alone: stopping it disturbs no other test."""
    with boot_postgres() as booted:
        yield booted


def _restart_after(cluster: PostgresCluster, down_s: float) -> threading.Thread:
    """Stop the server now and start it again after ``down_s`` seconds (in a thread)."""
    cluster.stop()

    def back() -> None:
        time.sleep(down_s)
        cluster.start()

    thread = threading.Thread(target=back, daemon=True)
    thread.start()
    return thread


def test_a_storage_call_waits_out_a_server_restart(cluster: PostgresCluster) -> None:
    url = cluster.create_database()
    storage = open_storage(url, outage_s=60)
    study = optuna.create_study(study_name="s", storage=storage, directions=["maximize"])
    back = _restart_after(cluster, 3.0)
    began = time.monotonic()
    trial = study.ask()  # the server is down: this waits for it
    study.tell(trial, 1.0)
    waited = time.monotonic() - began
    back.join()
    assert 2.5 < waited < 30, waited
    assert [t.state for t in optuna.load_study(study_name="s", storage=url).trials] == [TrialState.COMPLETE]


def test_past_the_limit_a_storage_call_is_one_line_naming_the_setting(cluster: PostgresCluster) -> None:
    url = cluster.create_database()
    storage = open_storage(url, outage_s=2)
    study = optuna.create_study(study_name="s", storage=storage, directions=["maximize"])
    cluster.stop()
    try:
        began = time.monotonic()
        with pytest.raises(StorageOutage) as raised:
            study.ask()
        assert 1.5 < time.monotonic() - began < 15
        text = f"{raised.value.message} — {raised.value.hint}"
        assert "did not answer for 2 s" in text and "outage_s" in text and "\n" not in text, text
    finally:
        cluster.start()


def test_the_claim_lock_waits_out_a_server_restart(cluster: PostgresCluster) -> None:
    url = cluster.create_database()
    study = optuna.create_study(study_name="s", storage=open_storage(url, outage_s=60), directions=["maximize"])
    lock = ClaimLock.of(study)
    with lock.held():
        pass
    back = _restart_after(cluster, 3.0)
    with lock.held():  # connecting waits for the server; the lock is then taken as usual
        study.enqueue_trial({})
    back.join()
    with lock.held():  # the pool's connections of before the restart are not reused dead
        pass


def test_a_claim_whose_lock_the_server_dropped_yields_to_the_host_that_claimed_meanwhile(
    cluster: PostgresCluster,
) -> None:
    """Host A reads the study under the claim lock, finds its config free, and its lock's session
    is cut before its claim is written; host B takes the free lock, claims the same config and
    launches it. A must not launch it too (the CI run of stop 36 stored one config twice)."""
    import psycopg

    url = cluster.create_database()
    a = optuna.create_study(study_name="s", storage=open_storage(url, outage_s=30), directions=["maximize"])
    b = optuna.load_study(study_name="s", storage=open_storage(url, outage_s=30))
    a.enqueue_trial({"x": 1})
    a.enqueue_trial({"x": 1})
    trial_a, trial_b = a.ask(), b.ask()
    assert trial_a.suggest_int("x", 0, 3) == trial_b.suggest_int("x", 0, 3) == 1
    connect = {"host": "127.0.0.1", "port": cluster.port, "user": USER, "password": PASSWORD,
               "dbname": url.rsplit("/", 1)[1]}
    found: dict[str, tuple[str, int] | None] = {}
    with psycopg.connect(**connect) as blocker, psycopg.connect(**connect, autocommit=True) as admin:
        # An uncommitted row of A's claim: A's own write of it waits for this transaction.
        blocker.execute("INSERT INTO trial_user_attributes (trial_id, key, value_json) VALUES (%s, %s, %s)",
                        (trial_id(a, trial_a.number), HOST_ATTR, json.dumps("blocker")))
        host_a = threading.Thread(target=lambda: found.update(
            a=claim_trial(a, trial_a, "host-a", {}, hold=ClaimLock.of(a).held)))
        host_a.start()
        deadline = time.monotonic() + 30
        while not admin.execute("SELECT count(*) FROM pg_locks WHERE NOT granted").fetchone()[0]:  # type: ignore[index]
            assert time.monotonic() < deadline, "host A's claim never waited"
            time.sleep(0.05)
        cut = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                            "AND objid = %s", (a._study_id,)).fetchall()  # noqa: SLF001
        assert cut == [(True,)], cut  # A's hold of the lock, and nothing else
        found["b"] = claim_trial(b, trial_b, "host-b", {}, hold=ClaimLock.of(b).held)
        blocker.rollback()
        host_a.join(timeout=60)
    assert not host_a.is_alive()
    assert found["b"] is None  # B took the free lock and launches the config
    assert found["a"] is not None and "running on host host-b" in found["a"][0], found


def test_a_server_error_that_waiting_cannot_mend_is_not_waited_for(cluster: PostgresCluster) -> None:
    url = cluster.create_database()
    wrong = url.replace(f":{PASSWORD}@", ":wrong@")
    began = time.monotonic()
    with pytest.raises(StudyError, match="refused the credentials"):
        open_storage(wrong, outage_s=60)
    assert time.monotonic() - began < 10


# ---- the fleet ------------------------------------------------------------------------------------


def _host_config(folder: Path, url: str, outage_s: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = config_copy("demo-sim.toml", folder, phases={"warmup_s": 1, "measure_s": 4, "stress_s": 2}, slo=False)
    path.write_text(path.read_text() + f'\n[storage]\nurl = "{url}"\nheartbeat_interval_s = 2\n'
                    f"grace_period_s = 60\noutage_s = {outage_s}\n")
    return path


def _start_hosts(configs: dict[str, Path], folders: dict[str, Path], trials: int) -> dict[str, subprocess.Popen]:
    procs = {}
    for host in HOSTS:
        log = (folders[host] / "run.log").open("w")
        procs[host] = subprocess.Popen([TUNER, "run", "--config", str(configs[host]), "--trials", str(trials)],
                                       cwd=folders[host], env=dict(os.environ, TUNER_HOST=host, COLUMNS="200"),
                                       stdout=log, stderr=subprocess.STDOUT)
    return procs


def _wait_in_load(url: str, timeout_s: float) -> None:
    """Wait until a candidate (not the baseline) is in its measured window on some host."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = [t for t in stored_trials(url) if t.state is TrialState.RUNNING and t.number > 0]
        if any(t.user_attrs.get(PHASE_ATTR) == "measure" for t in running):
            return
        time.sleep(0.3)
    raise AssertionError("no candidate reached its measured window")


def _up(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _stored_once(trials: list[optuna.trial.FrozenTrial]) -> None:
    """No trial RUNNING; no config measured twice except a deliberate noise repeat, or a result a
    host kept through the outage and stored late (another host may have re-run the queued copy of
    the trial meanwhile: it could not know the result existed)."""
    assert not [t.number for t in trials if t.state is TrialState.RUNNING]
    launched = [TrialRecord.model_validate(t.user_attrs[RECORD_ATTR]) for t in trials
                if t.state is TrialState.COMPLETE and RECORD_ATTR in t.user_attrs and LATE_ATTR not in t.user_attrs]
    keys = [tuple(sorted(r.params.items())) for r in launched if r.outcome in ("ok", "failed") and r.repeat_of is None]
    assert len(keys) == len(set(keys)), keys


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_hosts_ride_out_a_20_s_database_outage(cluster: PostgresCluster, tmp_path: Path) -> None:
    url = cluster.create_database()
    folders = {h: tmp_path / h for h in HOSTS}
    configs = {h: _host_config(folders[h], url, outage_s=120) for h in HOSTS}
    procs = _start_hosts(configs, folders, trials=3)
    try:
        _wait_in_load(url, 300)
        back = _restart_after(cluster, 20.0)
        back.join()
        for host in HOSTS:
            assert procs[host].wait(timeout=600) == 0, (folders[host] / "run.log").read_text()[-3000:]
    finally:
        _stop_all(procs)
    logs = {h: (folders[h] / "run.log").read_text() for h in HOSTS}
    assert all("Traceback" not in text for text in logs.values()), logs
    assert any("not stored: " in text or "does not answer" in text for text in logs.values()), logs  # met and said
    assert all("invalid data in the commit" not in text for text in logs.values()), logs  # named as what it is
    trials = stored_trials(url)
    _stored_once(trials)
    assert not [t.number for t in trials if t.state is TrialState.FAIL], "a trial was failed by the outage"
    assert not any(sorted((folders[h] / "state").glob("*.results.jsonl")) for h in HOSTS)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_past_the_limit_every_host_stops_in_one_line_and_its_next_run_stores_what_it_kept(
    cluster: PostgresCluster, tmp_path: Path
) -> None:
    url = cluster.create_database()
    folders = {h: tmp_path / h for h in HOSTS}
    configs = {h: _host_config(folders[h], url, outage_s=6) for h in HOSTS}
    procs = _start_hosts(configs, folders, trials=6)
    try:
        _wait_in_load(url, 300)
        cluster.stop()
        codes = {h: procs[h].wait(timeout=300) for h in HOSTS}
    finally:
        _stop_all(procs)
        if not (cluster.root / "data" / "postmaster.pid").exists():
            cluster.start()
    logs = {h: (folders[h] / "run.log").read_text() for h in HOSTS}
    for host in HOSTS:
        assert codes[host] == 1, logs[host][-3000:]
        errors = [line for line in logs[host].splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "did not answer for 6 s" in errors[0], logs[host][-3000:]
        assert "Traceback" not in logs[host], logs[host][-3000:]
        assert not _up(service_url(configs[host]))  # the demo server was not running before: restored = stopped
    kept = {h: [json.loads(line)["number"] for path in (folders[h] / "state").glob("*.results.jsonl")
                for line in path.read_text().splitlines()] for h in HOSTS}
    keeping = [h for h in HOSTS if kept[h]]
    assert keeping, f"no host was in a trial when the database went: {logs}"

    # The next run on each host stores what it kept before anything else, exactly once.
    for host in HOSTS:
        again = run_tuner("run", "--config", str(configs[host]), "--trials", "1", cwd=folders[host],
                          env=dict(os.environ, TUNER_HOST=host, COLUMNS="200"), timeout_s=300)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
        if host in keeping:
            assert "that the last run kept" in again.stdout, again.stdout[-2000:]
        assert not sorted((folders[host] / "state").glob("*.results.jsonl"))
    trials = stored_trials(url)
    late = [t.user_attrs[LATE_ATTR] for t in trials if LATE_ATTR in t.user_attrs]
    for number in (n for h in keeping for n in kept[h]):  # stored once: on its trial, or as a late trial
        on_trial = trials[number].state is TrialState.COMPLETE and RECORD_ATTR in trials[number].user_attrs
        assert on_trial + late.count(number) == 1, (number, trials[number].state, late)
    _stored_once(trials)
