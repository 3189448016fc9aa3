"""`tuner apply` through the real CLI without systemd: the process launcher and bad input.

Bad input must give one line on stderr, exit 1, and change nothing: neither the study database
(byte for byte) nor any file.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from tests.support.immutable import immutable
from tests.support.study_factory import failed_trial, make_study, ok_trial

SIM = [sys.executable, "-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB",
       "--mem-fraction-static", "0.80", "--port", "39999"]  # fmt: skip


def _config(path: Path, service: str) -> Path:
    path.write_text(
        f'[study]\nname = "demo"\n[service]\n{service}\nsglang_version = "0.5.5"\n'
        '[workload]\nkind = "random"\ninput_len = 128\noutput_len = 8\n[slo]\nttft_ms = {p99 = 5000}\n',
        encoding="utf-8",
    )
    return path


@pytest.fixture()
def study(tmp_path: Path) -> tuple[str, Path]:
    config = _config(tmp_path / "process.toml", f"launcher = \"process\"\ncommand = {json.dumps(SIM)}")
    url = make_study(
        tmp_path / "demo.db",
        "demo",
        [
            ok_trial(0.80, 64, 10, 1000.0, kind="baseline"),
            ok_trial(0.88, 128, 14, 1200.0),
            failed_trial(0.97, "cuda_graph_oom", "Capture cuda graph failed"),
        ],
        info={"config_path": str(config)},
    )
    return url, tmp_path / "demo.db"


def _one_line(proc, needle: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and needle in line, line


def test_process_launcher_prints_and_writes_the_command(study: tuple[str, Path], tmp_path: Path, tuner_cli) -> None:
    url, _ = study
    proc = tuner_cli("apply", "best", "--storage", url, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "+ --mem-fraction-static 0.88" in proc.stdout and "- --mem-fraction-static 0.80" in proc.stdout
    assert json.loads(tuner_cli("applies", "--storage", url, "--json").stdout) == []
    out = tmp_path / "cmd.txt"
    proc = tuner_cli("apply", "1", "--storage", url, "--write", str(out))
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(out.read_text())
    assert argv[:3] == SIM[:3]
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.88"
    assert argv[argv.index("--max-running-requests") + 1] == "128"
    (rec,) = json.loads(tuner_cli("applies", "--storage", url, "--json").stdout)
    assert rec["outcome"] == "printed" and rec["trial"] == 1 and rec["new_command"] == argv


def test_bad_input_changes_nothing(study: tuple[str, Path], tmp_path: Path, tuner_cli) -> None:
    url, db = study
    before = db.read_bytes()
    _one_line(tuner_cli("apply", "42", "--storage", url), "no trial 42")
    _one_line(tuner_cli("apply", "2", "--storage", url), "trial 2 is not feasible (cuda_graph_oom)")
    _one_line(tuner_cli("apply", "--storage", url), "pass either a target")
    _one_line(tuner_cli("apply", "fastest", "--storage", url), "neither `best` nor a trial number")
    missing = tmp_path / "missing.db"
    _one_line(tuner_cli("apply", "best", "--storage", f"sqlite:///{missing}"), "does not exist")
    assert not missing.exists()
    # a systemd service whose systemctl is missing: refused before anything is written
    broken = _config(tmp_path / "systemd.toml",
                     'launcher = "systemd"\nunit = "sim.service"\nsystemctl = ["/nonexistent/systemctl"]\n'
                     f'dropin_dir = "{tmp_path / "units"}"')  # fmt: skip
    _one_line(tuner_cli("apply", "best", "--storage", url, "--config", str(broken), "--yes"), "/nonexistent/systemctl")
    assert not (tmp_path / "units").exists()
    assert db.read_bytes() == before


def test_an_apply_that_could_not_be_recorded_changes_nothing(study: tuple[str, Path], tmp_path: Path,
                                                              tuner_cli) -> None:
    """A study file turned immutable (``chattr +i``: refused even to root) is found before the
    apply writes or restarts anything (a new user's sweep saw it fail only after the work)."""
    url, db = study
    out = tmp_path / "cmd.txt"
    with immutable(db):
        _one_line(tuner_cli("apply", "1", "--storage", url, "--write", str(out)), "the apply could not be recorded")
        assert tuner_cli("apply", "1", "--storage", url, "--dry-run").returncode == 0  # a preview writes nothing
    assert not out.exists()
    assert json.loads(tuner_cli("applies", "--storage", url, "--json").stdout) == []


def test_no_feasible_trial_and_no_config(tmp_path: Path, tuner_cli) -> None:
    bad = make_study(tmp_path / "bad.db", "bad", [ok_trial(0.8, 64, 10, 1000.0, slo_overshoot=0.4)])
    _one_line(tuner_cli("apply", "best", "--storage", bad), "has no feasible trial")
    lost = make_study(tmp_path / "lost.db", "lost", [ok_trial(0.8, 64, 10, 1000.0)],
                      info={"config_path": str(tmp_path / "gone.toml")})  # fmt: skip
    _one_line(tuner_cli("apply", "best", "--storage", lost), "gone.toml, which does not exist")


def test_undo_stack_skips_failed_and_undone_applies(tmp_path: Path) -> None:
    from tuner.apply import ApplyLog, ApplyRecord

    url = make_study(tmp_path / "log.db", "log", [ok_trial(0.8, 64, 10, 1000.0)])
    log = ApplyLog(url)

    def add(action: str, outcome: str, trial: int | None, undoes: int | None = None) -> int:
        rec = ApplyRecord(at="2026-01-01T00:00:00+00:00", action=action, study="log", trial=trial,
                          target="sim.service", outcome=outcome, previous_command=["/x"],
                          new_command=["/y"], undoes=undoes)  # fmt: skip
        return log.add(rec).id

    first = add("apply", "verified", 1)
    failed = add("apply", "rolled_back", 2)
    add("rollback", "rolled_back", 2, undoes=failed)
    second = add("apply", "verified", 3)
    assert [r.id for r in log.applied_stack("sim.service")] == [first, second]
    add("undo", "verified", 1, undoes=second)
    assert [r.id for r in log.applied_stack("sim.service")] == [first]
    assert log.applied_stack("other.service") == []
    assert [r.action for r in log.records()] == ["apply", "apply", "rollback", "apply", "undo"]
    log.close()
