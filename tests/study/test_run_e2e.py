"""`tuner run` end to end on the simulated server under the process launcher (real processes, HTTP, SQLite)."""

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

from tests.support.cli import TUNER, run_tuner, signal_when
from tests.support.configs import DemoRun, config_copy, load_study, service_url, study_created
from tuner.records import TrialRecord
from tuner.sglang.memory import must_fail
from tuner.study.optuna_io import PHASE_ATTR

LOAD_PHASES = ("measure", "stress")
"""Phases in which the trial's server is under load (``PHASE_ATTR``, set by the study loop)."""


def _server_down(url: str) -> bool:
    try:
        requests.get(f"{url}/health", timeout=2)
    except requests.RequestException:
        return True
    return False


FAST = {"measure_s": 5, "stress_s": 3}


def _wait_trial_under_load(proc: subprocess.Popen, storage: str, db: Path, timeout_s: float) -> tuple[int, dict] | None:
    """Poll the study until a trial after a completed one is RUNNING in a load phase; return it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.3)
        if not study_created(db):
            continue
        try:
            trials = load_study(storage, "demo-sim").trials
        except Exception:  # noqa: BLE001 - the study may not exist yet
            continue
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        loaded = [t for t in trials if t.state == TrialState.RUNNING and t.params
                  and t.user_attrs.get(PHASE_ATTR) in LOAD_PHASES]
        if complete and loaded:
            return loaded[0].number, dict(loaded[0].params)
    return None


def _start_run(config: Path, workdir: Path, *extra: str, **pipes: int) -> subprocess.Popen:
    return subprocess.Popen([TUNER, "run", "--config", str(config), "--trials", "6", *extra], cwd=workdir, text=True,
                            **pipes)


@pytest.mark.slow
def test_readme_demo_command_stores_trials_and_prints_best_vs_baseline(demo_run: DemoRun) -> None:
    out = demo_run.stdout
    assert "service restored" in out
    assert "vs baseline" in out and "nothing beats the baseline" not in out, out[-2000:]
    assert "none (the baseline is best)" not in out, out[-2000:]
    assert (demo_run.work / "studies" / "demo-sim.db").exists()
    study = load_study(demo_run.storage, "demo-sim")
    done = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(done) >= 2
    first = TrialRecord.model_validate(done[0].user_attrs["tuner.record"])
    assert first.kind == "baseline" and first.context_capacity and first.memory.capacity_model
    # the quality gate's reference answers, read from the real server's /generate with return_logprob
    assert first.quality.status == "reference" and first.quality.answers is not None
    assert len(first.quality.answers["token_ids"]) == 16 and first.constraints["quality"] < 0
    assert first.artifacts.get("server_log") and (demo_run.work / "studies" / "demo-sim" / "artifacts").is_dir()
    assert done[0].values[0] == first.objective_capacity  # the capacity [objective] names (SLO-safe here)
    oom_safe = [TrialRecord.model_validate(t.user_attrs["tuner.record"]).context_capacity or 0
                for t in done if t.state == TrialState.COMPLETE]
    assert max(oom_safe) > first.context_capacity, "the demo found no config with more contexts than the baseline"
    assert done[0].user_attrs[PHASE_ATTR] == "record"  # the last phase of a measured trial
    assert _server_down(service_url(demo_run.config))  # the demo server was not running before: restored = stopped
    # Through a pipe (or the journal) a line is a line: no sentence hard-wrapped at 80 columns (review N20).
    note = [line for line in out.splitlines() if "hierarchical cache" in line]
    assert note and len(note[0]) > 80 and "(§7)" in note[0], note
    summary = [line for line in out.splitlines() if "trial(s) launched" in line]
    assert summary and "stopped by" in summary[0], out[-2000:]


@pytest.mark.slow
def test_sigkill_mid_trial_then_resume(workdir: Path) -> None:
    config = config_copy("demo-sim.toml", workdir, phases=FAST, slo=False)
    storage = f"sqlite:///{workdir}/studies/demo-sim.db"
    proc = _start_run(config, workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        found = _wait_trial_under_load(proc, storage, workdir / "studies" / "demo-sim.db", 240)
        if found is not None:
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    killed_number, killed_params = found if found else (None, {})
    assert killed_number is not None, "never saw a completed trial and a running one under load"
    before = {t.number: t.values for t in load_study(storage, "demo-sim").trials if t.state == TrialState.COMPLETE}
    left = sorted((workdir / "state").glob("*.work"))
    assert len(left) == 1 and any(left[0].iterdir()), left  # the killed run's trial files: SIGKILL removes nothing

    second = run_tuner("run", "--config", str(config), "--trials", "1", cwd=workdir, timeout_s=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert not sorted((workdir / "state").glob("*.work"))  # the next run on the unit emptied it, then removed its own
    assert f"re-enqueued interrupted trial(s) [{killed_number}]" in second.stdout.replace("\n", " ")
    after = load_study(storage, "demo-sim").trials
    assert {t.number: t.values for t in after if t.number in before} == before
    assert after[killed_number].state == TrialState.FAIL
    rerun = [t for t in after if t.number > killed_number and t.user_attrs.get("tuner.kind") == "enqueued"]
    assert rerun and rerun[0].params == killed_params
    assert rerun[0].state == TrialState.COMPLETE
    assert _server_down(service_url(config))


@pytest.mark.slow
def test_sigterm_records_the_trial_restores_and_exits_nonzero(workdir: Path) -> None:
    config = config_copy("demo-sim.toml", workdir, phases=FAST, slo=False)
    storage = f"sqlite:///{workdir}/studies/demo-sim.db"
    events = workdir / "events.jsonl"
    proc = _start_run(config, workdir, "--json-progress", str(events), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    found, err = signal_when(proc, lambda: _wait_trial_under_load(proc, storage, workdir / "studies" / "demo-sim.db", 240),
                             signal.SIGTERM)
    assert proc.returncode != 0 and "Traceback" not in err
    number, params = found
    assert f"interrupted: trial {number} recorded as failed (interrupted), service restored" in err, err[-1000:]
    assert f"resume with `tuner run --config {config}" in err
    last = json.loads(events.read_text(encoding="utf-8").splitlines()[-1])  # the stream still ends in its summary
    assert last["event"] == "summary" and last["stop_reason"] == "interrupted", last
    assert f"trial {number} recorded as failed" in last["stop_detail"], last
    trials = load_study(storage, "demo-sim").trials
    interrupted = trials[number]
    assert interrupted.state == TrialState.FAIL
    record = TrialRecord.model_validate(interrupted.user_attrs["tuner.record"])
    assert "interrupted" in (record.failure_evidence or "")
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    assert waiting and waiting[0].system_attrs["fixed_params"] == params
    assert _server_down(service_url(config))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reference_twin_reaches_145x_capacity_without_oom_or_proved_restarts(workdir: Path) -> None:
    """The twin's OOM-safe capacity (its SLO's steady windows are other tests' matter: without them the
    two trials take about half the time)."""
    config = config_copy("reference-sim.toml", workdir, replace={'measure_s = 20': 'measure_s = 8'}, slo=False)
    proc = run_tuner("run", "--config", str(config), "--trials", "2", cwd=workdir, timeout_s=500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    study = load_study(f"sqlite:///{workdir}/studies/reference-sim.db", "reference-sim")
    stored = [(t.number, TrialRecord.model_validate(t.user_attrs["tuner.record"])) for t in study.trials
              if "tuner.record" in t.user_attrs]
    baseline = stored[0][1]
    assert baseline.kind == "baseline" and baseline.context_capacity == 4  # 159,277 // 32,768 (§1.8)
    assert abs(baseline.token_capacity - 159277) < 200
    feasible = [r for _, r in stored if r.feasible]
    best = max(r.context_capacity for r in feasible)
    assert best >= 1.45 * baseline.context_capacity, [(r.params, r.context_capacity) for _, r in stored]
    for _, record in stored:
        stress = [p for p in record.phases if p.name == "stress"]
        if record.feasible:
            assert stress and stress[0].errored == 0
        assert record.failure_class is None or record.failure_class.value != "runtime_oom"
    failures = []
    for number, record in stored:
        if record.outcome in ("ok", "failed"):
            assert not must_fail(record.params, failures)[0], f"trial {number} restarted a config proved to fail"
        if record.outcome == "failed" and record.failure_class is not None:
            failures.append((record.params, record.failure_class))


@pytest.mark.slow
def test_a_storage_elsewhere_keeps_its_artifacts_beside_it_and_in_the_resume_hint(workdir: Path) -> None:
    """``run --storage`` elsewhere (review N5): the trials' files go beside that SQLite file, not to
    ``studies/<study>/artifacts`` of the working directory (the original study's folder), the
    readers find them there, and the SIGTERM resume hint keeps ``--storage``."""
    import json

    config = config_copy("demo-sim.toml", workdir, phases=FAST, slo=False)
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir()
    db = elsewhere / "copy.db"
    storage = f"sqlite:///{db}"
    proc = subprocess.Popen([TUNER, "run", "--config", str(config), "--trials", "6", "--storage", storage],
                            cwd=workdir, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _found, err = signal_when(proc, lambda: _wait_trial_under_load(proc, storage, db, 240), signal.SIGTERM)
    assert proc.returncode == 130 and "Traceback" not in err  # the README's exit code for SIGTERM
    assert f"resume with `tuner run --config {config} --storage {storage}`" in err, err[-1000:]
    artifacts = elsewhere / "demo-sim" / "artifacts"
    assert artifacts.is_dir() and any(artifacts.iterdir())
    assert not (workdir / "studies").exists() or not any((workdir / "studies").rglob("*")), list(
        (workdir / "studies").rglob("*"))
    show = run_tuner("show", "0", "--storage", storage, "--json", cwd=workdir)
    assert show.returncode == 0, show.stderr
    paths = json.loads(show.stdout)["artifact_paths"]
    assert paths and all(Path(p).is_file() and Path(p).is_relative_to(artifacts) for p in paths.values()), paths
