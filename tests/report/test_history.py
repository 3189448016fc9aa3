"""tuner.results on real SQLite studies: views, filters, Pareto front, best policy, bad input."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from tests.support.study_factory import make_study, ok_trial
from tuner.config import ObjectiveSection
from tuner.errors import ConfigError, StudyError
from tuner.results import (
    StudyLocation,
    best_trial,
    open_study,
    resolve_location,
    select_trials,
)
from tuner.study.best import override_policy
from tuner.study.storage import check_storage


def test_views_read_records_constraints_and_states(demo_study: str) -> None:
    stored = open_study(StudyLocation(storage_url=demo_study))
    assert stored.name == "demo"
    assert [v.number for v in stored.trials] == [0, 1, 2, 3, 4, 5]
    assert [v.feasible for v in stored.trials] == [True, True, True, False, False, False]
    oom = stored.trial(3)
    assert oom.state == "COMPLETE" and oom.failure_class == "cuda_graph_oom" and oom.failed
    assert oom.constraints == {"oom_or_crash": 1.0, "slo": 1.0, "stress": 1.0, "quality": 1.0, "context_fits": 1.0}  # a failed start: every one violated
    skip = stored.trial(4)
    assert skip.state == "PRUNED" and skip.outcome == "skipped" and skip.record.proved_by_trial == 3
    assert stored.trial(5).constraints["slo"] == pytest.approx(0.3)
    assert stored.baseline().number == 0
    assert stored.trial(1).metric("token_capacity") == 14 * 8192 + 17


def test_select_filters_and_sorts(demo_study: str) -> None:
    trials = open_study(StudyLocation(storage_url=demo_study)).trials
    assert [v.number for v in select_trials(trials, feasible=True)] == [0, 1, 2]
    assert [v.number for v in select_trials(trials, failed=True)] == [3, 4]
    assert [v.number for v in select_trials(trials, sort="capacity")][:4] == [5, 2, 1, 0]
    assert [v.number for v in select_trials(trials, sort="throughput")][:2] == [1, 2]
    # unknown values sort last
    assert select_trials(trials, sort="ttft")[-1].number in (3, 4)
    with pytest.raises(ConfigError, match="--sort 'speed' is not a sort key"):
        select_trials(trials, sort="speed")
    with pytest.raises(ConfigError, match="exclude each other"):
        select_trials(trials, feasible=True, failed=True)


def test_pareto_front_is_feasible_only_and_best_follows_policy(demo_study: str) -> None:
    stored = open_study(StudyLocation(storage_url=demo_study))
    # trial 5 has the highest capacity but missed its SLO: not on the feasible front
    assert [v.number for v in stored.pareto_front()] == [2, 1]
    # stored policy: the fastest within 10% of the best capacity 15 (at least ceil(13.5) = 14 requests)
    best = best_trial(stored)
    assert best.trial.number == 1, best.reason
    assert "trial 1" in best.reason and "throughput_within_capacity" in best.reason
    assert best.deltas["context_capacity"].ratio == pytest.approx(1.4)
    assert best.deltas["output_throughput_tok_s"].delta == pytest.approx(200.0)
    strict = best_trial(stored, override_policy(stored.info, None, 0.0))
    assert strict.trial.number == 2  # only capacity 15 qualifies
    assert strict.deltas["context_capacity"].ratio == pytest.approx(1.5)
    assert best_trial(stored, override_policy(stored.info, "max_throughput", None)).trial.number == 1
    with pytest.raises(ConfigError, match="--policy 'fastest'"):
        override_policy(stored.info, "fastest", None)


def test_no_feasible_trial_is_a_clear_error(infeasible_study: str) -> None:
    stored = open_study(StudyLocation(storage_url=infeasible_study))
    with pytest.raises(StudyError, match="has no feasible trial .*tuner trials --failed"):
        best_trial(stored)


def test_missing_storage_is_an_error_and_creates_nothing(tmp_path: Path) -> None:
    db = tmp_path / "nope.db"
    with pytest.raises(StudyError, match="does not exist"):
        open_study(StudyLocation(storage_url=f"sqlite:///{db}"))
    assert not db.exists()
    with pytest.raises(StudyError, match="not a SQLAlchemy URL"):
        check_storage("studies/demo.db")
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(StudyError, match="holds no Optuna study"):
        check_storage(f"sqlite:///{empty}")
    assert empty.stat().st_size == 0


def test_study_name_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = make_study(tmp_path / "two.db", "first", [ok_trial(0.8, 64, 10, 1000.0, kind="baseline")])
    optuna.create_study(study_name="second", storage=url, directions=["maximize", "maximize"])
    with pytest.raises(StudyError, match=r"holds 2 studies \(first, second\).*--study"):
        open_study(StudyLocation(storage_url=url))
    with pytest.raises(StudyError, match="has no study 'third'"):
        open_study(StudyLocation(storage_url=url, study_name="third"))
    assert open_study(StudyLocation(storage_url=url, study_name="first")).trial(0).kind == "baseline"
    # default: --study NAME means studies/NAME.db; nothing at all means the only studies/*.db
    monkeypatch.chdir(tmp_path)
    assert resolve_location(study="x").storage_url == "sqlite:///studies/x.db"
    with pytest.raises(StudyError, match="holds 0 study databases"):
        resolve_location()
    (tmp_path / "studies").mkdir()
    (tmp_path / "two.db").rename(tmp_path / "studies" / "two.db")
    assert resolve_location().storage_url == "sqlite:///studies/two.db"


def test_stored_policy_defaults_when_missing(tmp_path: Path) -> None:
    url = make_study(tmp_path / "p.db", "p", [ok_trial(0.8, 64, 10, 1000.0)], policy={"policy": "max_capacity"})
    stored = open_study(StudyLocation(storage_url=url))
    assert best_trial(stored).policy == ObjectiveSection(policy="max_capacity")
    assert best_trial(stored).baseline is None


def test_interrupted_and_running_trials_say_so(tmp_path: Path) -> None:
    from tuner.records import RECORD_ATTR, TrialRecord
    from tuner.results import status_text

    url = make_study(tmp_path / "i.db", "i", [ok_trial(0.8, 64, 10, 900.0, kind="baseline")])
    study = optuna.load_study(study_name="i", storage=url)
    interrupted = study.ask()
    record = TrialRecord(kind="predicted", outcome="failed",
                         failure_evidence="interrupted (Ctrl-C or SIGTERM) during the trial")
    interrupted.set_user_attr(RECORD_ATTR, record.model_dump(mode="json"))
    study.tell(interrupted, state=optuna.trial.TrialState.FAIL)
    study.ask()  # left RUNNING, as after kill -9
    killed = study.ask()  # a killed run's trial, failed by the next run (tuner.study.hosts.recover_own)
    study.tell(killed, state=optuna.trial.TrialState.FAIL)
    study.enqueue_trial({"mem_fraction_static": 0.85})  # its params queued again
    views = {v.number: v for v in open_study(StudyLocation(storage_url=url)).trials}
    assert status_text(views[1]) == "interrupted"
    assert status_text(views[2]).startswith("running, or killed")
    assert status_text(views[3]).startswith("stopped without a result")
    assert status_text(views[4]).startswith("queued")
    assert status_text(views[0]) == ""
