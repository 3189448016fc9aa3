"""Production promises (issue 43), the drains, under real systemd 252 in a PID namespace (the
simulator as the unit): a failed or timed-out ``pre_restart`` means no restart of the server,
neither the trial's nor the final restore's; the run stops in one line saying what the service runs
and what to do; a timed-out hook's process group is killed whole; a ``post_ready`` failure is
stored as such; and no file a run on password-protected storage writes holds the password.
"""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import psutil
import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import load_study
from tests.support.postgres import PASSWORD
from tests.support.served_unit import Calls, Served, left_over, logged_run, wait_for
from tests.support.sim import is_healthy
from tuner.records import TrialRecord

pytestmark = [pytest.mark.slow, pytest.mark.systemd]


def test_a_drain_failing_at_a_later_trial_restarts_nothing_and_restore_takes_it_from_there(
        served: Served, tmp_path: Path, locks: Path) -> None:
    served.ensure_serving()
    calls = Calls(tmp_path, served)
    count = tmp_path / "drains"
    hook = calls.hook(tmp_path, f'echo x >> {count}\n[ "$(wc -l < {count})" -lt 2 ] || {{ echo "balancer down" >&2; exit 3; }}')
    config = served.config(tmp_path, systemctl=calls.systemctl, service=f'pre_restart = ["{hook}"]\n')
    proc = run_tuner("run", "--config", str(config), "--trials", "3", cwd=tmp_path, timeout_s=300)
    line = one_error_line(proc, "[service] pre_restart hook", "exited 3: balancer down",
                          "was not restarted and still runs a trial's flags", "tuner restore --unit")
    hooks = [i for i, x in enumerate(calls.lines()) if x.startswith("HOOK")]
    assert [calls.lines()[i] for i in hooks] == ["HOOK pre_restart trial"] * 2, calls.lines()  # no drain around a restore
    assert calls.changing(after=hooks[1]) == [], "the unit was restarted after the drain failed"
    serving = served.pid_state()
    assert serving[1] == "active" and "90-tuner-trial.conf" in served.tuner_dropins()
    assert list((tmp_path / "state").glob("*.state.json")), line  # kept for `tuner restore`
    stored = load_study(f"sqlite:///{tmp_path}/studies/sd.db", "sd").trials[1]
    evidence = TrialRecord.model_validate(stored.user_attrs["tuner.record"]).failure_evidence or ""
    assert evidence.startswith("not measured: [service] pre_restart hook"), evidence
    # once the drain works, `tuner restore` puts the original back from the state file
    proc = run_tuner("restore", "--config", str(config), cwd=tmp_path, timeout_s=200)
    assert proc.returncode == 0 and "restored" in proc.stdout, proc.stderr[-2000:]
    assert served.tuner_dropins() == [] and is_healthy(served.url, 60) and served.pid_state()[0] != serving[0]


def test_a_drain_failing_before_the_final_restore_restarts_nothing(served: Served, tmp_path: Path, locks: Path) -> None:
    """The run ends (its trial cap) and the drain before the final restore fails: the unit is not
    restarted (it was restarted undrained, with the failure a warning), it keeps the trial's flags
    and the state file for `tuner restore`, and the run exits 1 saying so."""
    served.ensure_serving()
    calls = Calls(tmp_path, served)
    hook = calls.hook(tmp_path, '[ "$SGLANG_TUNER_REASON" = restore ] && { echo "balancer down" >&2; exit 3; }\nexit 0')
    config = served.config(tmp_path, systemctl=calls.systemctl, service=f'pre_restart = ["{hook}"]\n')
    proc = run_tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=300)
    one_error_line(proc, "exited 3: balancer down before the final restore",
                   "was not restarted and still runs a trial's flags", "tuner restore --unit")
    lines = calls.lines()
    drain = lines.index("HOOK pre_restart restore")
    assert calls.changing(after=drain) == [], lines[drain:]
    assert "90-tuner-trial.conf" in served.tuner_dropins() and served.pid_state()[1] == "active"
    assert list((tmp_path / "state").glob("*.state.json"))
    proc = run_tuner("restore", "--config", str(config), cwd=tmp_path, timeout_s=200)
    assert proc.returncode == 0 and served.tuner_dropins() == [] and is_healthy(served.url, 60), proc.stderr[-2000:]


def test_a_hanging_drain_is_killed_with_its_children_and_restarts_nothing(
        served: Served, tmp_path: Path, locks: Path) -> None:
    before = served.ensure_serving()
    calls = Calls(tmp_path, served)
    pids = tmp_path / "children"
    hook = calls.hook(tmp_path, f"sleep 300 &\necho $! >> {pids}\nsleep 300")
    config = served.config(tmp_path, systemctl=calls.systemctl, service=f'pre_restart = ["{hook}"]\nhook_timeout_s = 2\n')
    begun = time.monotonic()
    proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=tmp_path, timeout_s=150)
    took = time.monotonic() - begun
    one_error_line(proc, "[service] pre_restart hook", "did not finish in 2 s", "its process group was killed",
                   "was not restarted: it still runs its own flags")
    assert [x for x in calls.lines() if x.startswith("HOOK")] == ["HOOK pre_restart trial"]  # hung once, not twice
    assert took < 60, took
    child = int(pids.read_text().split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, "a hook's child was left"
    assert calls.changing() == [] and served.pid_state() == before and left_over(tmp_path, served) == []


def test_a_failing_post_ready_is_stored_as_such_and_the_service_restored(served: Served, tmp_path: Path, locks: Path) -> None:
    served.ensure_serving()
    calls = Calls(tmp_path, served)
    hook = calls.hook(tmp_path, '[ "$SGLANG_TUNER_REASON" = trial ] && { echo "pool add failed" >&2; exit 4; }\nexit 0')
    config = served.config(tmp_path, systemctl=calls.systemctl, service=f'post_ready = ["{hook}"]\n')
    proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=tmp_path, timeout_s=300)
    one_error_line(proc, "[service] post_ready hook", "exited 4: pool add failed", "once the trial's server was ready")
    stored = load_study(f"sqlite:///{tmp_path}/studies/sd.db", "sd").trials[0]
    evidence = TrialRecord.model_validate(stored.user_attrs["tuner.record"]).failure_evidence or ""
    assert evidence.startswith("not measured: [service] post_ready hook") and "could not be changed" not in evidence
    assert served.tuner_dropins() == [] and is_healthy(served.url, 60)  # restored
    assert [x for x in calls.lines() if x.startswith("HOOK")] == ["HOOK post_ready trial", "HOOK post_ready restore"]


def test_no_file_the_run_writes_and_no_refusal_holds_the_storage_password(
        served: Served, tmp_path: Path, locks: Path, postgres_url: str) -> None:
    """A run on the fleet's PostgreSQL storage, its password in ``--storage`` as the README tells
    every host: while it holds the unit, its lock file (0600) and state file, and the "being tuned
    by another tuner" refusals of ``run``, ``restore`` and ``apply``, hold no password; after it,
    no file it wrote (state folder, lock folder, artifacts, its output) does."""
    assert f":{PASSWORD}@" in postgres_url
    served.ensure_serving()
    config = served.config(tmp_path, measure_s=15)
    proc, out = logged_run(config, tmp_path, "--storage", postgres_url, "--trials", "2")
    try:
        wait_for(lambda: _finished(postgres_url) >= 1, 240, "the baseline to be stored", proc)
        lock = next(locks.glob("*.lock"))
        assert oct(lock.stat().st_mode & 0o777) == "0o600"
        held = {"lock file": lock.read_text(), "state file": next((tmp_path / "state").glob("*.state.json")).read_text()}
        assert "***@" in held["lock file"] and "***@" in held["state file"], held
        for name, argv in {"run": ("run", "--config", str(config), "--storage", postgres_url, "--trials", "1"),
                           "restore": ("restore", "--config", str(config)),
                           "apply": ("apply", "0", "--config", str(config), "--study", "sd", "--storage", postgres_url,
                                     "--yes")}.items():
            refused = run_tuner(*argv, cwd=tmp_path, timeout_s=120)
            held[name] = refused.stdout + refused.stderr
            assert refused.returncode == 1 and "is being tuned by another tuner" in held[name], (name, held[name])
        for name, text in held.items():
            assert PASSWORD not in text, (name, text)
        assert proc.wait(300) == 0, out.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any("artifacts" in p.parts for p in written) and (tmp_path / "run.out") in written  # what the run wrote
    leaks = [str(p) for p in written if PASSWORD.encode() in p.read_bytes()]
    assert leaks == [], leaks
    assert list(locks.glob("*.lock")) == []  # released by its owner: removed


def _finished(url: str) -> int:
    try:
        study = optuna.load_study(study_name="sd", storage=url)
    except KeyError:
        return 0
    return sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished())
