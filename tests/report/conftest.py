"""Fixtures for the history/report tests: real SQLite studies written as ``tuner run`` writes them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.offline_server import OfflineExecutor
from tests.support.study_factory import HTML_LOG_LINE, failed_trial, make_study, ok_trial, skipped_trial
from tuner.config import load_config
from tuner.records import TrialRecord
from tuner.study.loop import run_study

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class OfflineStudy:
    """The product's own study of the reference twin on the simulator's offline server, stored in a
    real SQLite file with its artifacts beside it (``<folder>/reference-sim/artifacts``)."""

    folder: Path
    url: str
    history: list[tuple[int, TrialRecord]]
    best: int


@pytest.fixture(scope="module")
def reference_offline_study(tmp_path_factory: pytest.TempPathFactory) -> OfflineStudy:
    """``configs/reference-sim.toml`` (an SLO its stress load breaks), 6 trials."""
    tmp = tmp_path_factory.mktemp("reference-offline")
    url = f"sqlite:///{tmp}/reference.db"
    config = load_config(ROOT / "configs" / "reference-sim.toml")
    config = config.model_copy(update={"storage": config.storage.model_copy(update={
        "url": url, "artifacts_dir": str(tmp / "reference-sim" / "artifacts")})})
    (tmp / "reference-sim").mkdir()
    runner = OfflineExecutor(config)
    runner.work_dir = tmp / "work"
    summary = run_study(config, runner, max_trials=6, storage_url=url)
    assert summary.best is not None
    return OfflineStudy(folder=tmp, url=url, history=list(runner.history), best=summary.best.number)


@pytest.fixture(scope="module")
def demo_study(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A study: baseline, two better trials, an SLO miss, a CUDA-graph OOM, a proven skip."""
    db = tmp_path_factory.mktemp("history") / "demo.db"
    return make_study(
        db,
        "demo",
        [
            ok_trial(0.80, 64, 10, 1000.0, kind="baseline"),
            ok_trial(0.88, 128, 14, 1200.0, kind="predicted"),
            ok_trial(0.89, 96, 15, 1100.0),
            failed_trial(0.97, "cuda_graph_oom", "Capture cuda graph failed: CUDA out of memory",
                         log=["[TP0] Load weight end.", HTML_LOG_LINE]),
            skipped_trial(0.98, 3),
            ok_trial(0.91, 256, 16, 900.0, slo_overshoot=0.3),
        ],
    )


@pytest.fixture(scope="module")
def infeasible_study(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A study where nothing met every constraint."""
    db = tmp_path_factory.mktemp("infeasible") / "bad.db"
    return make_study(
        db,
        "bad",
        [
            ok_trial(0.80, 64, 10, 1000.0, kind="baseline", slo_overshoot=0.5),
            failed_trial(0.95, "startup_kv_oom", "Not enough memory. Please try to increase --mem-fraction-static."),
        ],
    )
