"""Bad PostgreSQL storages: one line naming the fix, exit 1, nothing changed on the unit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import requests

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import config_copy, service_url
from tests.support.net import free_port
from tests.support.postgres import PASSWORD, PostgresCluster


def _config(tmp_path: Path) -> tuple[Path, str]:
    path = config_copy("demo-sim.toml", tmp_path, slo=False)
    return path, service_url(path)


def _tuner(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_tuner(*args, cwd=cwd, env=dict(os.environ, TUNER_HOST="host-x", COLUMNS="200", NO_COLOR="1"))


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    err = one_error_line(proc)
    assert PASSWORD not in err and "wrong-pw" not in err  # passwords never printed
    return err


def _untouched(tmp_path: Path, server_url: str) -> None:
    """No lock, no state file, no server started, no study folder."""
    state = tmp_path / "state"
    assert not state.exists() or not any(state.iterdir()), list(state.iterdir())
    with pytest.raises(requests.RequestException):
        requests.get(f"{server_url}/health", timeout=1)
    assert not (tmp_path / "studies").exists()


@pytest.mark.slow
def test_bad_postgresql_storages_are_refused_before_the_unit_is_touched(
        postgres_cluster: PostgresCluster, tmp_path: Path) -> None:
    config, server_url = _config(tmp_path)
    foreign = postgres_cluster.create_database()
    postgres_cluster.sql(foreign.rsplit("/", 1)[1], "CREATE TABLE orders (id int)")
    cases = {
        "credentials": (postgres_cluster.url("postgres", password="wrong-pw"), "refused the credentials of user 'tuner'"),
        "unreachable": (postgres_cluster.url("postgres", port=free_port()), "is unreachable"),
        "database": (postgres_cluster.url("no_such_db"), "database 'no_such_db' does not exist"),
        "driver": (f"postgresql+pg8000://tuner:{PASSWORD}@127.0.0.1:{postgres_cluster.port}/postgres",
                   "needs the database driver 'pg8000'"),
        "not a study storage": (foreign, "is not a study storage: it holds 1 other table(s) (orders)"),
    }
    fixes = {"credentials": "check the user and password", "unreachable": "check the host and port",
             "database": "createdb no_such_db", "driver": "pip install pg8000",
             "not a study storage": "an empty database"}
    for name, (url, problem) in cases.items():
        err = _one_line_error(_tuner("run", "--config", str(config), "--storage", url, "--trials", "1", cwd=tmp_path))
        assert problem in err and fixes[name] in err, (name, err)
        _untouched(tmp_path, server_url)
    # The readers say the same, creating nothing.
    err = _one_line_error(_tuner("trials", "--storage", cases["credentials"][0], cwd=tmp_path))
    assert "refused the credentials" in err
    err = _one_line_error(_tuner("studies", "--storage", foreign, cwd=tmp_path))
    assert "holds no Optuna study" in err


def test_copy_study_round_trip_and_refusals(postgres_url: str, tmp_path: Path) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    local = f"sqlite:///{tmp_path / 'local.db'}"
    study = optuna.create_study(study_name="s", storage=local, directions=["maximize", "maximize"])
    study.set_user_attr("tuner.study", {"context_tokens": 2048})
    study.optimize(lambda t: (t.suggest_int("max_running_requests", 1, 64), 1.0), n_trials=3)
    up = _tuner("copy-study", "--from", local, "--to", postgres_url, "--study", "s", cwd=tmp_path)
    assert up.returncode == 0 and "copied study s (3 trials)" in up.stdout and PASSWORD not in up.stdout, up.stderr
    shared = optuna.load_study(study_name="s", storage=postgres_url)
    assert [t.params for t in shared.trials] == [t.params for t in study.trials]
    assert shared.user_attrs == study.user_attrs
    back = f"sqlite:///{tmp_path / 'back.db'}"
    down = _tuner("copy-study", "--from", postgres_url, "--to", back, "--study", "s", cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert [t.values for t in optuna.load_study(study_name="s", storage=back).trials] == [t.values for t in study.trials]
    again = _one_line_error(_tuner("copy-study", "--from", local, "--to", postgres_url, "--study", "s", cwd=tmp_path))
    assert "already holds a study 's'" in again and "--to-study" in again
    missing = _one_line_error(_tuner("copy-study", "--from", local, "--to", back, "--study", "nope", cwd=tmp_path))
    assert "holds no study 'nope'" in missing
