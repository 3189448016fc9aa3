"""The storage password never leaves the box: a study in a password-protected PostgreSQL
database, run from the CLI, then every command that reads it, its errors, and the HTML report
(a file meant to be shared) searched for the password."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import run_tuner
from tests.support.configs import config_copy
from tests.support.postgres import PASSWORD


def _tuner(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_tuner(*args, cwd=cwd, env=dict(os.environ, TUNER_HOST="host-x", COLUMNS="200", NO_COLOR="1"),
                     timeout_s=300)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_output_log_line_progress_event_or_report_holds_the_password(postgres_url: str, tmp_path: Path) -> None:
    assert f":{PASSWORD}@" in postgres_url
    config = config_copy("demo-sim.toml", tmp_path, phases={"warmup_s": 1, "measure_s": 3, "stress_s": 1}, slo=False)
    store = ("--storage", postgres_url)
    study = ("--study", "demo-sim", *store)
    report = tmp_path / "report.html"
    commands = {
        "run": ("run", "--config", str(config), *store, "--trials", "2"),
        "run --dry-run": ("run", "--config", str(config), *store, "--dry-run"),
        "studies": ("studies", *store),
        "studies --json": ("studies", *store, "--json"),
        "trials": ("trials", *study),
        "trials --json": ("trials", *study, "--json"),
        "trials --csv": ("trials", *study, "--csv"),
        "show": ("show", "1", *study),
        "show --json": ("show", "1", *study, "--json"),
        "best": ("best", *study),
        "best --json": ("best", *study, "--json"),
        "applies": ("applies", *study),
        "report": ("report", *study, "-o", str(report)),
        "apply --dry-run": ("apply", "best", "--config", str(config), "--study", "demo-sim", *store, "--dry-run"),
        "copy-study": ("copy-study", "--from", postgres_url, "--to", f"sqlite:///{tmp_path}/copy.db", "--study",
                       "demo-sim"),
        # errors that name the storage
        "missing study": ("trials", "--study", "no-such-study", *store),
        "copy onto itself": ("copy-study", "--from", postgres_url, "--to", postgres_url, "--study", "demo-sim"),
        "missing trial": ("show", "999", *study),
    }
    outputs = {}
    for name, argv in commands.items():
        done = _tuner(*argv, cwd=tmp_path)
        outputs[name] = done.stdout + done.stderr
        if name in ("run", "studies", "trials", "show", "best", "report", "copy-study"):
            assert done.returncode == 0, (name, outputs[name][-2000:])
        assert PASSWORD not in outputs[name], (name, outputs[name][-2000:])
    assert "***" in outputs["studies"] or "***" in outputs["missing study"], outputs["studies"]
    assert report.exists() and report.stat().st_size > 10_000
    assert PASSWORD not in report.read_text(encoding="utf-8")
