"""Hosts cut off from the database, and hosts that die between choosing a config and claiming it,
against a real PostgreSQL server (the cut is a TCP forwarder the test drops, ``tests/support/net.py``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import optuna
import pytest
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from tests.support.net import CuttableProxy
from tests.support.offline_server import OfflineExecutor
from tuner.config import TunerConfig, load_config
from tuner.errors import StudyError
from tuner.study.hosts import HOST_ATTR, REQUEUED_ATTR, RequeueOnce, reap_stale
from tuner.study.job import TrialJob
from tuner.study.loop import run_study
from tuner.study.optuna_io import LATE_ATTR

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]


def _peer(url: str, name: str) -> optuna.Study:
    """Another host's view of the study: its own connections (not through the cut link)."""
    storage = RDBStorage(url, heartbeat_interval=1, grace_period=2, heartbeat_stale_trial_callback=RequeueOnce())
    return optuna.load_study(study_name=name, storage=storage)


def test_a_trial_asked_but_never_claimed_is_failed_after_the_grace_period(postgres_url: str) -> None:
    storage = RDBStorage(postgres_url, heartbeat_interval=1, grace_period=2, heartbeat_stale_trial_callback=RequeueOnce())
    dying = optuna.create_study(study_name="s", storage=storage)
    orphan = dying.ask()  # the host chose a config, then died before its claim (no host, no heartbeat)
    orphan.suggest_float("x", 0.0, 1.0)
    other = _peer(postgres_url, "s")
    assert reap_stale(other) == []  # within the grace period it may still be claimed
    time.sleep(2.5)
    assert reap_stale(other) == [orphan.number]
    trials = other.get_trials()
    assert trials[orphan.number].state is TrialState.FAIL
    waiting = [t for t in trials if t.state is TrialState.WAITING]
    assert [t.params for t in waiting] == [orphan.params]
    assert waiting[0].user_attrs[REQUEUED_ATTR] == {"trial": orphan.number, "host": None}


class _CutOffRunner(OfflineExecutor):
    """The offline evaluation; during the first trial after the baseline, the host's link to the
    database goes down until another host has reaped the trial (then up again, unless ``stay_cut``)."""

    def __init__(self, config: TunerConfig, proxy: CuttableProxy, url: str, *, stay_cut: bool) -> None:
        super().__init__(config)
        self.proxy, self.url, self.stay_cut = proxy, url, stay_cut
        self.victim: tuple[int, dict] | None = None

    def run(self, job: TrialJob, on_phase):  # noqa: ANN001, ANN201 - TrialRunner.run
        record = super().run(job, on_phase)
        if job.kind != "baseline" and self.victim is None:
            self.victim = (job.number, dict(job.params))
            self.proxy.cut()
            peer = _peer(self.url, self.config.study.name)
            deadline = time.monotonic() + 15
            while job.number not in reap_stale(peer) and time.monotonic() < deadline:
                time.sleep(0.3)
            if not self.stay_cut:
                self.proxy.restore()
        return record


def _config() -> TunerConfig:
    config = load_config(ROOT / "configs" / "demo-sim.toml")
    return config.model_copy(update={"storage": config.storage.model_copy(
        update={"heartbeat_interval_s": 1, "grace_period_s": 2})})


def _host_a_behind_a_proxy(postgres_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *,  # noqa: ANN001, ANN202
                           stay_cut: bool):
    """host-a in ``tmp_path`` on a fresh database it reaches through a :class:`CuttableProxy`:
    ``(config, direct url, proxy, runner, the url through the proxy)``."""
    monkeypatch.setenv("TUNER_HOST", "host-a")
    monkeypatch.chdir(tmp_path)
    url = postgres_cluster.create_database()
    proxy = CuttableProxy(postgres_cluster.port)
    config = _config()
    runner = _CutOffRunner(config, proxy, url, stay_cut=stay_cut)
    return config, url, proxy, runner, url.replace(f":{postgres_cluster.port}/", f":{proxy.port}/")


@pytest.mark.timeout(180)
def test_a_host_cut_off_past_the_grace_period_stores_its_result_when_the_link_is_back(
        postgres_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    config, url, proxy, runner, proxied = _host_a_behind_a_proxy(postgres_cluster, tmp_path, monkeypatch, stay_cut=False)
    try:
        with caplog.at_level(logging.WARNING, logger="tuner.study.loop"):
            summary = run_study(config, runner, max_trials=3, storage_url=proxied)
    finally:
        proxy.close()
    assert runner.victim is not None
    number, params = runner.victim
    trials = _peer(url, config.study.name).get_trials()
    assert trials[number].state is TrialState.FAIL  # the others reaped it while the host was away
    late = [t for t in trials if t.user_attrs.get(LATE_ATTR) == number]
    assert len(late) == 1 and late[0].state is TrialState.COMPLETE
    assert late[0].user_attrs[HOST_ATTR] == "host-a"
    assert {k: late[0].params[k] for k in late[0].params} == {k: params[k] for k in late[0].params}
    assert late[0].values[0] > 0  # the measurement kept: its context capacity
    assert any(f"trial {number} was marked FAIL by another host" in r.getMessage()
               and f"stored as trial {late[0].number}" in r.getMessage() for r in caplog.records)
    assert summary.trials_run >= 2


@pytest.mark.timeout(180)
def test_a_host_still_cut_off_when_its_trial_ends_logs_the_result_in_one_line_and_stops(
        postgres_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    config, url, proxy, runner, proxied = _host_a_behind_a_proxy(postgres_cluster, tmp_path, monkeypatch, stay_cut=True)
    config = config.model_copy(update={"storage": config.storage.model_copy(update={"outage_s": 3.0})})
    runner.config = config
    try:
        with caplog.at_level(logging.WARNING, logger="tuner.study.loop"), \
                pytest.raises(StudyError, match="database did not answer for 3 s") as raised:
            run_study(config, runner, max_trials=3, storage_url=proxied)
    finally:
        proxy.close()
    assert "\n" not in raised.value.message
    assert runner.victim is not None
    number, params = runner.victim
    lines = [r.getMessage() for r in caplog.records if f"trial {number} not stored" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert f'"mem_fraction_static": {params["mem_fraction_static"]}' in lines[0] and "context capacity" in lines[0]
    trials = _peer(url, config.study.name).get_trials()
    assert trials[number].state is TrialState.FAIL
    assert [t.params for t in trials if t.state is TrialState.WAITING][:1] == [
        {k: params[k] for k in trials[number].params}]
