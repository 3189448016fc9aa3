"""The test cluster itself: a real server that Optuna's RDBStorage writes to and reads back."""

from __future__ import annotations

import optuna
import sqlalchemy


def test_cluster_serves_an_optuna_study(postgres_url: str, postgres_cluster) -> None:
    assert postgres_url.startswith("postgresql+psycopg://")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=postgres_url)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    again = optuna.load_study(study_name="s", storage=postgres_url)
    assert len(again.trials) == 2
    engine = sqlalchemy.create_engine(postgres_url)
    with engine.connect() as conn:
        assert conn.execute(sqlalchemy.text("select current_setting('listen_addresses')")).scalar() == "127.0.0.1"
    engine.dispose()
    assert (postgres_cluster.root / "data").is_dir()
