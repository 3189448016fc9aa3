"""Structural rungs in the study (issue 23): a rung the ladder predicts does not start is never
launched (the skip names the arithmetic), DP attention is searched at a fraction where it starts, and
capacity is counted across the deployment. The study runs through the product's own trial on the
simulator's startup path (offline, virtual time) into a real SQLite file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.offline_server import OfflineExecutor
from tests.support.views import study_view
from tuner.config import BudgetSection, TunerConfig
from tuner.sglang.failures import STARTUP_MEMORY_FAILURES
from tuner.sglang.modelconfig import load_model_config
from tuner.study.calibration import deployment_capacity
from tuner.study.decide.rungs import RungPrices, same_rung
from tuner.study.decide.screens import WontStart
from tuner.study.loop import run_study
from tuner.study.optuna_io import SPACE_ATTR
from tuner.study.space import Space

KIMI = Path(__file__).resolve().parents[2] / "tuner" / "data" / "models" / "kimi-k2.5-int4"
TWIN = "RTX-PRO-6000-96GB"


def _config(version: str, tmp_path: Path, capacity: str = "auto", exclude: tuple[str, ...] = ()) -> TunerConfig:
    return TunerConfig.model_validate({
        "study": {"name": f"rungs-{version}", "seed": 0},
        "service": {"launcher": "process", "command": [
            "{python}", "-m", "tuner.sim", "--model-path", "kimi-k2.5-int4", "--tp-size", "8", "--speculative-algorithm",
            "EAGLE3", "--mem-fraction-static", "0.88", "--sim-gpu", TWIN, "--sim-version", version]},
        "model": {"config_json": str(KIMI / "config.json")},
        "storage": {"url": f"sqlite:///{tmp_path / 'study.db'}", "artifacts_dir": str(tmp_path / "artifacts")},
        "space": {"mem_fraction_step": 0.01, "exclude_levers": list(exclude)},
        "workload": {"kind": "random", "input_len": 6144, "output_len": 64, "range_ratio": 0.25},
        "slo": {"ttft_ms": {"p99": 30000}, "itl_ms": {"p99": 4000}},
        "objective": {"context_tokens": 32768, "capacity": capacity},
        "budget": {"warmup_s": 2, "measure_s": 20, "stress_s": 10, "max_concurrency": 64},
    })


@pytest.fixture(scope="module")
def twin_study(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("rungs")
    # DP attention's tests: DCP (derived on the twin since the Triton MLA DCP cell, issue 44) is left
    # out so the 8 launches search DP attention rather than the larger DCP rung first
    config = _config("0.5.23", tmp, exclude=("dcp",))
    runner = OfflineExecutor(config, world_seed=0)
    skips: list[str] = []
    study = run_study(config, runner, max_trials=8, storage_url=config.storage.url,
                      on_progress=lambda e: skips.append(e.message or "") if e.event == "skip" else None)
    return config, runner.history, skips, study


def test_dp_attention_is_searched_at_a_fraction_where_it_starts(twin_study) -> None:
    _, history, _, _ = twin_study
    rungs = [(n, r) for n, r in history if int(r.params.get("dp_size") or 1) > 1]
    assert rungs, "DP attention was derived (the model's config is given) and launched"
    first = rungs[0][1]
    assert "the highest context capacity the ladder prices" in (first.prediction.why or "")
    assert first.params["mem_fraction_static"] > 0.88  # at 0.88 its replicated weights leave no pool
    for _, record in history:  # never a rung that cannot start
        assert record.failure_class not in STARTUP_MEMORY_FAILURES, record.params
    baseline = history[0][1]
    best = max(r.context_capacity or 0 for _, r in history if r.feasible)
    assert best >= 4 * (baseline.context_capacity or 0)  # a rung's capacity across the deployment


@pytest.mark.slow
def test_the_twin_reaches_its_best_rung_within_five_launches(tmp_path: Path) -> None:
    """Issue 23's acceptance on the twin (0.5.23, 32k contexts, OOM-safe capacity): the launch
    after the baseline is the rung the ladder prices highest, at its own predicted optimum; the
    memory frontier then moves only on rungs a start calibrated; 48 contexts (the best rung's, the
    load's cap: ``bench_levers``' grid) by launch 5, no launch that fails."""
    config = _config("0.5.23", tmp_path, capacity="oom_safe")
    runner = OfflineExecutor(config, world_seed=0)
    run_study(config, runner, max_trials=20, storage_url=config.storage.url)
    five = runner.history[:5]
    assert len(five) == 5
    assert "the highest context capacity the ladder prices" in (five[1][1].prediction.why or "")
    for i, (_, record) in enumerate(five):
        assert record.outcome != "failed" and record.failure_class not in STARTUP_MEMORY_FAILURES, record.params
        if "memory frontier" in (record.prediction.why or ""):  # never a rung no earlier start ran
            assert any(same_rung(record.params, r.params) for _, r in five[:i] if r.token_capacity), record.params
    assert max(r.context_capacity or 0 for _, r in five if r.feasible) >= 48


def test_a_rung_that_cannot_start_is_skipped_with_the_arithmetic(twin_study, tmp_path: Path) -> None:
    config, history, _, _ = twin_study
    import optuna

    study = optuna.load_study(study_name=config.study.name, storage=config.storage.url)
    space = Space.model_validate(study.user_attrs[SPACE_ATTR])
    view = study_view(space, history[:1], context_tokens=32768, budget=BudgetSection(), mean_request_tokens=6144)
    screen = WontStart(RungPrices("0.5.23", config.service.command or [], load_model_config(KIMI), TWIN))
    skip = screen.why_not({**history[0][1].params, "dp_size": 8, "mem_fraction_static": 0.88}, view)
    assert skip is not None and skip.proof == 0
    assert "does not start: static memory" in skip.reason and "needs mem_fraction_static ≥" in skip.reason
    assert screen.why_not({**history[0][1].params, "dp_size": 8, "mem_fraction_static": 0.93}, view) is None
    assert screen.why_not(dict(history[0][1].params), view) is None  # no rung moved: the other screens' business


def test_capacity_counts_the_deployment() -> None:
    assert deployment_capacity({}, 48, 150_000, 32768) == 4
    assert deployment_capacity({"dp_size": 4}, 48, 82_000, 32768) == 8  # 4 pools × 2 contexts, 12 slots each
    assert deployment_capacity({"dp_size": 8}, 8, 82_000, 32768) == 8  # one slot per rank
    assert deployment_capacity({"dcp_size": 8}, 64, 40_000, 32768) == 9  # a request spans the logical pool


def test_one_request_ceiling_is_a_rank_under_dp_attention(twin_study) -> None:
    """The record says the longest single request; the ``context_fits`` constraint holds it to the
    workload's longest request (the baseline's pool holds it, one DP rank's pool at 0.9 does not)."""
    from tuner.study.job import TrialJob
    from tuner.trial import context_fits

    config, history, _, _ = twin_study
    baseline = history[0][1]
    assert baseline.per_request_max_tokens == min(baseline.token_capacity - 1, 262143)
    dp = next(r for _, r in history if int(r.params.get("dp_size") or 1) > 1 and r.token_capacity)
    assert dp.per_request_max_tokens == min(dp.token_capacity - 1, 262143)  # one rank's pool, not dp ×
    long = config.model_copy(update={"workload": config.workload.model_copy(update={"input_len": 24000})})
    runner = OfflineExecutor(long, world_seed=0)
    params = {**baseline.params, "dp_size": 8, "mem_fraction_static": 0.9}
    record = runner.run(TrialJob(number=1, kind="sampled", params=params, context_tokens=32768), lambda *_a, **_k: None)
    assert record.outcome == "ok" and record.per_request_max_tokens is not None
    assert record.per_request_max_tokens < 24000
    assert record.constraints["context_fits"] == 1.0 and not record.feasible
    assert context_fits(record.per_request_max_tokens, 1000) == -1.0 and context_fits(None, 10**6) == -1.0


def test_a_rung_no_trial_ran_is_not_predicted_from_another_rungs_cell(twin_study) -> None:
    """The boot probe per rung: before a rung's first start, the calibrated model (the baseline's
    cell) does not screen it; after it, the rung's own start calibrates its predictions."""
    from tuner.study.decide.screens import Predicted

    config, history, _, _ = twin_study
    import optuna

    study = optuna.load_study(study_name=config.study.name, storage=config.storage.url)
    space = Space.model_validate(study.user_attrs[SPACE_ATTR])
    base = history[0][1].params
    view = study_view(space, history[:1], context_tokens=32768, budget=BudgetSection(), mean_request_tokens=6144)
    low = {**base, "mem_fraction_static": 0.85}
    skip = Predicted().why_not(low, view)
    assert skip is not None and "predicted" in skip.reason  # same rung: the model predicts it
    assert Predicted().why_not({**low, "kv_cache_dtype": "fp8_e4m3"}, view) is None  # fp8's first start is its probe
    fp8 = [(n, r) for n, r in history if r.params.get("kv_cache_dtype") == "fp8_e4m3" and r.token_capacity]
    if fp8:
        after = study_view(space, [history[0], fp8[0]], context_tokens=32768, budget=BudgetSection(), mean_request_tokens=6144)
        rung = {**fp8[0][1].params, "mem_fraction_static": 0.8}
        skip = Predicted().why_not(rung, after)
        assert skip is None or f"calibrated on trial {fp8[0][0]}" in skip.reason


def test_show_best_and_apply_say_and_write_the_levers(twin_study, tmp_path: Path) -> None:
    """``tuner show`` / ``best`` say the capacity gain per lever and its costs; ``tuner apply best``
    writes the structural flags (DP attention's switch with its size)."""
    from rich.console import Console

    from tuner.apply import plan_apply
    from tuner.report.tables import trial_detail
    from tuner.results import StudyLocation, best_trial, open_study

    config, history, _, _ = twin_study
    stored = open_study(StudyLocation(storage_url=config.storage.url, study_name=config.study.name))
    rung = max((v for v in stored.trials if v.feasible and v.record is not None and int(v.params.get("dp_size") or 1) > 1),
               key=lambda v: v.record.context_capacity or 0)  # type: ignore[union-attr]
    console = Console(width=200, record=True)
    console.print(trial_detail(stored, rung))
    text = console.export_text()
    assert f"structural levers of trial {rung.number} over the baseline (trial 0)" in text
    assert "dp_size (DP attention) 1 → " in text and "per lever:" in text
    assert "costs: output throughput" in text and "one request's ceiling" in text and "numerics" in text
    best = best_trial(stored)
    if rung_moved := [n for n in best.notes if n.startswith("structural levers")]:
        assert "capacity:" in " ".join(best.notes) and rung_moved
    plan = plan_apply(stored, rung, config, state_dir=tmp_path / "state")
    argv = plan.new_argv
    assert "--enable-dp-attention" in argv and argv[argv.index("--dp-size") + 1] == str(rung.params["dp_size"])
    if rung.params.get("kv_cache_dtype") == "fp8_e4m3":
        assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
