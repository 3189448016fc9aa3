"""Three ``tuner run`` processes, three simulated units, one study on a real PostgreSQL server.

Each "host" is a tuner process with its own config (its own simulator command on its own port,
its own state dir, lock and artifacts) and its own ``TUNER_HOST`` name: all three run on this
machine, so the host name comes from the environment override. One host is killed with SIGKILL
during a load phase; the other two fail its trial through the heartbeat and run its params again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests
from optuna.trial import TrialState

from tests.support.cli import TUNER, run_tuner
from tests.support.configs import config_copy, service_url
from tests.support.study_factory import stored_trials
from tuner.records import RECORD_ATTR, TrialRecord
from tuner.study.decide.repeat import MAX_NOISE_REPEATS
from tuner.study.hosts import HOST_ATTR, REQUEUED_ATTR
from tuner.study.optuna_io import PHASE_ATTR

HOSTS = ("host-a", "host-b", "host-c")
INTERVAL_S, GRACE_S = 1, 4


def _host_config(folder: Path, url: str) -> Path:
    """``configs/demo-sim.toml`` on a free port with short load phases, sharing ``url``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = config_copy("demo-sim.toml", folder, phases={"warmup_s": 1, "measure_s": 4, "stress_s": 2}, slo=False)
    path.write_text(path.read_text() + f'\n[storage]\nurl = "{url}"\nheartbeat_interval_s = {INTERVAL_S}\n'
                    f"grace_period_s = {GRACE_S}\n")
    return path


def _server_url(config: Path) -> str:
    return service_url(config)


def _up(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _tuner(*args: str, cwd: Path, host: str | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", **({"TUNER_HOST": host} if host else {}))
    return run_tuner(*args, cwd=cwd, env=env, timeout_s=timeout_s)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_hosts_share_one_study_and_survive_a_killed_host(postgres_url: str, tmp_path: Path) -> None:
    folders = {h: tmp_path / h for h in HOSTS}
    configs = {h: _host_config(folders[h], postgres_url) for h in HOSTS}
    procs = {}
    for host in HOSTS:
        env = dict(os.environ, TUNER_HOST=host)
        log = (folders[host] / "run.log").open("w")
        procs[host] = subprocess.Popen([TUNER, "run", "--config", str(configs[host]),
                                        "--trials", "4"], cwd=folders[host], env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
    try:
        # host-c's first launched trial after the baseline, in its load phase: kill -9 its tuner.
        victim = None
        deadline = time.monotonic() + 300
        while victim is None and time.monotonic() < deadline and procs["host-c"].poll() is None:
            time.sleep(0.5)
            for t in stored_trials(postgres_url):
                if t.state is TrialState.RUNNING and t.params and t.user_attrs.get(HOST_ATTR) == "host-c":
                    if t.user_attrs.get(PHASE_ATTR) in ("measure", "stress"):  # a load phase
                        victim = t
        assert victim is not None, (folders["host-c"] / "run.log").read_text()[-3000:]
        procs["host-c"].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        procs["host-c"].wait(timeout=30)
        complete_then = {t.number: t.values for t in stored_trials(postgres_url) if t.state is TrialState.COMPLETE}
        failed_after = None
        while time.monotonic() - killed_at < 60:
            if stored_trials(postgres_url)[victim.number].state is TrialState.FAIL:
                failed_after = time.monotonic() - killed_at
                break
            time.sleep(0.25)
        assert _up(_server_url(configs["host-c"]))  # the dead tuner left its unit on the trial's flags
        for host in ("host-a", "host-b"):
            assert procs[host].wait(timeout=400) == 0, (folders[host] / "run.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    left = {h: sorted((folders[h] / "state").glob("*.work")) for h in HOSTS}
    assert left["host-a"] == left["host-b"] == [] and len(left["host-c"]) == 1, left  # SIGKILL removes nothing

    # Dead host: its trial FAIL within the grace period (+ one beat of the reaper and polling).
    assert failed_after is not None and failed_after <= GRACE_S + INTERVAL_S + 3.0, failed_after
    trials = stored_trials(postgres_url)
    assert trials[victim.number].state is TrialState.FAIL
    reruns = [t for t in trials if (t.user_attrs.get(REQUEUED_ATTR) or {}).get("trial") == victim.number]
    assert len(reruns) == 1 and reruns[0].params == victim.params
    assert reruns[0].state is TrialState.COMPLETE and reruns[0].user_attrs[HOST_ATTR] in ("host-a", "host-b")
    # No completed trial lost.
    assert {n: trials[n].values for n in complete_then} == complete_then

    # Every trial keeps its host; the baseline was measured once; no config launched twice.
    recorded = [(t, TrialRecord.model_validate(t.user_attrs[RECORD_ATTR])) for t in trials
                if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert all(t.user_attrs.get(HOST_ATTR) in HOSTS for t in trials if t.state is not TrialState.WAITING)
    launched = [(t, r) for t, r in recorded if r.outcome in ("ok", "failed")]
    assert {"host-a", "host-b"} <= {t.user_attrs[HOST_ATTR] for t, _ in launched} <= set(HOSTS)
    assert trials[victim.number].user_attrs[HOST_ATTR] == "host-c"
    assert sum(1 for _, r in launched if r.kind == "baseline") == 1
    # (a deliberate re-measurement of the noise, record.repeat_of, is the planner's, not a duplicate)
    keys = [tuple(sorted(t.params.items())) for t, r in launched if r.repeat_of is None]
    assert len(keys) == len(set(keys)), keys
    repeats = [r.repeat_of for _, r in launched if r.repeat_of is not None]  # each re-measured once, study-wide
    assert len(repeats) == len(set(repeats)) and len(repeats) <= MAX_NOISE_REPEATS, repeats

    # host-c's unit comes back with `tuner restore` on that host (it was not running before: stopped).
    restored = _tuner("restore", "--config", str(configs["host-c"]), cwd=folders["host-c"], host="host-c")
    assert restored.returncode == 0, restored.stderr
    assert "restored" in restored.stdout and not _up(_server_url(configs["host-c"]))
    assert not left["host-c"][0].exists()  # restore removed the killed run's trial files

    # The readers on the PostgreSQL URL: hosts shown; best equal to a single host's choice from a
    # local SQLite copy of the same trials.
    shown = _tuner("trials", "--storage", postgres_url, "--study", "demo-sim", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "host" in shown.stdout and "host-a" in shown.stdout and "host-b" in shown.stdout
    # the dead host's trial says why it has no result and which trial ran its params again
    dead = _tuner("show", str(victim.number), "--storage", postgres_url, "--study", "demo-sim", cwd=tmp_path)
    assert dead.returncode == 0 and "marked FAIL" in dead.stdout, dead.stdout[-2000:] + dead.stderr
    assert f"run again as trial {reruns[0].number}" in " ".join(dead.stdout.split()), dead.stdout[-2000:]
    listed = _tuner("studies", "--storage", postgres_url, cwd=tmp_path)
    assert listed.returncode == 0 and "demo-sim" in listed.stdout, listed.stderr
    local = f"sqlite:///{tmp_path / 'copy.db'}"
    copied = _tuner("copy-study", "--from", postgres_url, "--to", local, "--study", "demo-sim", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    best_pg = _tuner("best", "--storage", postgres_url, "--study", "demo-sim", "--json", cwd=tmp_path)
    best_local = _tuner("best", "--storage", local, "--study", "demo-sim", "--json", cwd=tmp_path)
    assert best_pg.returncode == 0 and best_local.returncode == 0, best_pg.stderr + best_local.stderr
    chosen_pg, chosen_local = json.loads(best_pg.stdout), json.loads(best_local.stdout)
    assert chosen_pg["trial"]["number"] == chosen_local["trial"]["number"]
    assert len(stored_trials(local)) == len(trials)
