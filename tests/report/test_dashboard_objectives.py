"""`tuner dashboard` (issue 16): the objectives of a study written before names were set get their
names before optuna-dashboard starts (it shows them instead of "Objective 0/1"), and the help says
plainly that the dashboard can write."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import requests

from tests.support.study_factory import make_study, ok_trial
from tuner.study.optuna_io import METRIC_NAMES

TUNER = str(Path(sys.executable).with_name("tuner"))


def test_dashboard_help_says_it_can_write() -> None:
    proc = subprocess.run([TUNER, "dashboard", "--help"], capture_output=True, text=True, timeout=60, check=False,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "120"})
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and "can write" in text and "no read-only mode" in text, proc.stdout


def test_dashboard_names_the_objectives_of_an_existing_study(tmp_path: Path) -> None:
    url = make_study(tmp_path / "old.db", "old", [ok_trial(0.8, 64, 10, 100.0, kind="baseline")], metric_names=False)
    assert optuna.load_study(study_name="old", storage=url).metric_names is None  # as older runs left it
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([TUNER, "dashboard", "--storage", url, "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, body = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None and body is None:
            try:
                (summary,) = requests.get(f"http://127.0.0.1:{port}/api/studies", timeout=2).json()["study_summaries"]
                body = requests.get(f"http://127.0.0.1:{port}/api/studies/{summary['study_id']}", timeout=5).json()
            except requests.RequestException:
                time.sleep(0.5)
        assert body is not None, proc.communicate(timeout=5)
        assert body.get("objective_names") == list(METRIC_NAMES), body.get("objective_names")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=60)
    assert optuna.load_study(study_name="old", storage=url).metric_names == list(METRIC_NAMES)
