"""An applied config holds what it promises (issue 36): where the chosen trial's memory admits more
longest contexts than the sessions its steady windows held the SLO at, ``tuner apply`` carries
``--max-running-requests M`` (M the SLO-safe sessions), every reader says so, ``--keep-admission``
keeps the trial's own; and a steady load of M sessions on the simulator started from the applied
command line, over real HTTP on 127.0.0.1, holds the SLO.

The study is the product's own on the demo config (Llama-3.1-8B on an L4, 2k contexts, p99 TTFT
10 s / ITL 2.5 s), evaluated offline (:class:`tests.support.offline_server.OfflineExecutor`), with
``[budget] concurrency = 12`` (the measured window's streams): the frontier trial admits 23
contexts, 23 sessions break p99 ITL and about 15 hold it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli import run_tuner
from tests.support.configs import config_copy
from tests.support.offline_server import OfflineExecutor
from tests.support.sim import SimProcess, wait_healthy
from tuner.config import TunerConfig, load_config
from tuner.records import TrialRecord
from tuner.study.loop import run_study


@dataclass
class AdmissionStudy:
    folder: Path
    config: Path
    cfg: TunerConfig
    url: str
    best: int
    record: TrialRecord


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> AdmissionStudy:
    tmp = tmp_path_factory.mktemp("admission")
    config = config_copy("demo-sim.toml", tmp, replace={"max_concurrency = 32": "max_concurrency = 32\nconcurrency = 12"})
    cfg = load_config(config)
    url = f"sqlite:///{tmp}/demo.db"
    cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"url": url,
                                                                           "artifacts_dir": str(tmp / "artifacts")})})
    runner = OfflineExecutor(cfg)
    runner.work_dir = tmp / "work"
    run_study(cfg, runner, max_trials=4, storage_url=url)
    best = json.loads(run_tuner("best", "--storage", url, "--json", cwd=tmp).stdout)["trial"]["number"]
    return AdmissionStudy(folder=tmp, config=config, cfg=cfg, url=url, best=best, record=dict(runner.history)[best])


def _limits(study: AdmissionStudy) -> tuple[int, int]:
    """``(admits, holds)``: what the chosen trial admits and the sessions that held the SLO."""
    record = study.record
    admits = min(record.context_capacity or 0, int(record.params["max_running_requests"]))
    held = record.slo_capacity.contexts
    assert held is not None and 0 < held < admits, record.slo_capacity  # the case this file is about
    return admits, held


def test_apply_and_every_reader_carry_the_admission_limit_that_holds_the_slo(study: AdmissionStudy) -> None:
    admits, held = _limits(study)
    line = f"admits {admits} longest contexts at once, holds the SLO up to {held} sessions"
    dry = run_tuner("apply", "best", "--dry-run", "--storage", study.url, "--config", str(study.config), cwd=study.folder)
    assert dry.returncode == 0, dry.stderr
    assert line in dry.stdout and f"applying --max-running-requests {held} (" in dry.stdout, dry.stdout
    assert f"+ --max-running-requests {held}\n" in dry.stdout  # the command line carries it
    assert f"max_running_requests 2048 → {held}: at most {held} requests" in dry.stdout
    kept = run_tuner("apply", "best", "--dry-run", "--keep-admission", "--storage", study.url,
                     "--config", str(study.config), cwd=study.folder)
    assert kept.returncode == 0, kept.stderr
    assert f"+ --max-running-requests {study.record.params['max_running_requests']}\n" in kept.stdout
    assert (f"keeping the trial's own admission (--keep-admission): set --max-running-requests {held} to hold "
            "the SLO") in kept.stdout
    shown = run_tuner("show", str(study.best), "--storage", study.url, cwd=study.folder)
    assert line in shown.stdout and f"applying --max-running-requests {held}" in shown.stdout, shown.stdout
    best = json.loads(run_tuner("best", "--storage", study.url, "--json", cwd=study.folder).stdout)
    assert any(line in note and f"applying --max-running-requests {held}" in note for note in best["notes"])
    report = study.folder / "report.html"
    assert run_tuner("report", "--storage", study.url, "-o", str(report), cwd=study.folder).returncode == 0
    assert f"applying --max-running-requests {held}" in report.read_text(encoding="utf-8")


def test_a_load_at_the_applied_limit_holds_the_slo_on_the_applied_config(study: AdmissionStudy) -> None:
    """The applied command line started as a real server; M sessions in the study's own steady
    window (its ramp, warm-up and length; every request at the longest context) meet every p99
    limit, as the study measured."""
    _, held = _limits(study)
    written = study.folder / "applied.txt"
    proc = run_tuner("apply", "best", "--write", str(written), "--storage", study.url, "--config", str(study.config),
                     cwd=study.folder)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = shlex.split(written.read_text(encoding="utf-8").strip())
    assert argv[argv.index("--max-running-requests") + 1] == str(held)
    port = int(argv[argv.index("--port") + 1])
    log = study.folder / "applied-sim.log"
    with open(log, "wb") as out:
        server = SimProcess(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                             cwd=study.folder), port, log)
    try:
        wait_healthy(server.url, 90, exited=server.exited)
        budget, workload, slo = study.cfg.budget, study.cfg.workload, study.cfg.slo
        out_json = study.folder / "load.json"
        limits = ",".join(f"{pct}_{metric}_ms={limit:g}" for metric in ("ttft", "itl")
                          for pct, limit in (getattr(slo, f"{metric}_ms") or {}).items())
        load = run_tuner(
            "load", "--url", server.url, "--concurrency", str(held), "--ramp", "3", "--warmup", str(budget.warmup_s),
            "--duration", str(budget.stress_s), "--longest-context", str(study.cfg.objective.context_tokens),
            "--input-len", str(workload.input_len), "--output-len", str(workload.output_len),
            "--range-ratio", str(workload.range_ratio), "--slo", limits, "--json", str(out_json),
            cwd=study.folder, timeout_s=300)
        assert load.returncode == 0, load.stdout + load.stderr
        summary = json.loads(out_json.read_text())["summary"]
        assert summary["completed"] >= held and summary["errored"] == 0, summary
        assert summary["slo_met"] is True, (summary["slo_violations"], load.stdout)
        assert server.exited() is None  # the server served it, and still runs
    finally:
        server.stop()
