"""Fixtures for the history/report tests: real SQLite studies written as ``tuner run`` writes them."""

from __future__ import annotations

import pytest

from tests.support.study_factory import HTML_LOG_LINE, failed_trial, make_study, ok_trial, skipped_trial


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
