"""The parser, client and memory model against the simulator run as a real server process.

The simulator re-derives SGLang independently (it imports nothing from ``tuner``), so agreement
here checks both sides: the log it prints parses, its HTTP answers normalise, and a model calibrated
on one start predicts the token count of a start at another fraction.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.net import free_port
from tuner.sglang.client import ServerNotReady, SGLangClient
from tuner.sglang.failures import STARTUP_MEMORY_FAILURES, Failure, FailureClass
from tuner.sglang.logs import LogReport, LogWatcher, outcome_of
from tuner.sglang.memory import KVCapacityModel, cell_size_bytes
from tuner.sglang.modelconfig import load_model_config

MODEL = Path(__file__).resolve().parent / "models" / "llama-3.1-8b"


class _Watched:
    """A LogWatcher fed by a reader thread; every access holds the lock."""

    def __init__(self) -> None:
        self.watcher = LogWatcher()
        self.lock = threading.Lock()

    def feed(self, line: str) -> None:
        with self.lock:
            self.watcher.feed(line)

    @property
    def ready(self) -> bool:
        with self.lock:
            return self.watcher.ready

    @property
    def failure(self) -> Failure | None:
        with self.lock:
            return self.watcher.failure

    def report(self, exit_status: int | None = None) -> LogReport:
        with self.lock:
            return self.watcher.report(exit_status=exit_status)


@contextmanager
def sim(version: str, mfs: float, *extra: str) -> Iterator[tuple[SGLangClient, _Watched, subprocess.Popen[str]]]:
    port = free_port()
    cmd = [sys.executable, "-m", "tuner.sim", "--model-path", str(MODEL), "--sim-gpu", "H100-80GB", "--sim-version", version,
           "--sim-time-scale", "0.01", "--mem-fraction-static", str(mfs), "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watcher = _Watched()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            watcher.feed(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=10)
    try:
        yield client, watcher, proc
    finally:
        client.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        reader.join(timeout=10)


def _failure_check(watcher: _Watched, proc: subprocess.Popen[str]):  # type: ignore[no-untyped-def]
    def check() -> Failure | None:
        if watcher.failure is not None:
            return watcher.failure
        code = proc.poll()
        return watcher.report(exit_status=code).failure if code is not None else None
    return check


def _start(client: SGLangClient, watcher: _Watched, proc: subprocess.Popen[str]) -> LogReport:
    info = client.wait_ready(120, failure_check=_failure_check(watcher, proc), poll_s=0.1)
    for _ in range(1200):  # the ready line follows /health by a warm-up request; the reader may lag
        if watcher.ready:
            break
        threading.Event().wait(0.05)
    assert watcher.ready, "no ready line within 60 s of /health answering"
    report = watcher.report()
    assert info.max_total_num_tokens == report.max_total_num_tokens
    assert info.mem_fraction_static is not None
    return report


@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
def test_sim_start_parses_and_the_model_predicts_another_fraction(version: str) -> None:
    cell = cell_size_bytes(load_model_config(MODEL), tp=1, version=version)
    with sim(version, 0.85, "--enable-metrics") as (client, watcher, proc):
        report = _start(client, watcher, proc)
        assert report.version_format == version and report.ready and report.failure is None
        assert client.flush_cache() is True
        assert any(k.startswith("sglang:") for k in client.metrics())
        rank = report.primary()
        assert rank is not None and rank.kv_pool_gib is not None
        model = KVCapacityModel.from_report(report, cell, 0.85)
    with sim(version, 0.80) as (client, watcher, proc):
        other = _start(client, watcher, proc)
    assert model.tokens(0.80) == pytest.approx(other.max_total_num_tokens, rel=0.01)


def test_sim_startup_kv_oom_fails_fast() -> None:
    with sim("0.5.5", 0.15) as (client, watcher, proc):
        with pytest.raises(ServerNotReady) as err:
            client.wait_ready(120, failure_check=_failure_check(watcher, proc), poll_s=0.1)
    assert err.value.failure is not None and err.value.failure.failure_class is FailureClass.STARTUP_KV_OOM


def test_sim_oom_in_init_memory_pool_is_a_startup_reserve_failure() -> None:
    # mfs 0.99 leaves (1 − 0.99) × B for the req_to_token table: torch OOMs in init_memory_pool, before
    # any scheduler or ready line. The launcher's LogWatcher must call it a startup-memory failure that
    # bounds the fraction from above (cuda_graph_oom, like search.py's ceiling), never a runtime OOM.
    with sim("0.5.23", 0.99) as (client, watcher, proc):
        with pytest.raises(ServerNotReady):
            client.wait_ready(120, failure_check=_failure_check(watcher, proc), poll_s=0.1)
        status = proc.wait(timeout=60)
    report = watcher.report(exit_status=status)
    assert not report.ready and report.scheduler is None and report.failure is not None
    assert report.failure.failure_class is FailureClass.CUDA_GRAPH_OOM, report.failure
    assert report.failure.failure_class in STARTUP_MEMORY_FAILURES and outcome_of(report.failure) == "startup_oom"
    assert report.failure_site == "init_memory_pool" and "CUDA out of memory" in report.failure.evidence
    assert report.oom is not None and report.oom.free_mib is not None and report.oom.tried_to_allocate_mib > report.oom.free_mib
