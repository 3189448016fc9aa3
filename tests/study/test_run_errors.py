"""`tuner run` / `tuner init` refuse what cannot work, in one line, before (or right after) the baseline.

Real CLI processes on the simulated server: a baseline that cannot start stops the run with the
server's own reason; a bad budget, a storage folder that does not exist, a url on another port than
the command, and an init output in a missing folder are one-line errors with exit 1.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import config_copy, load_study
from tuner.errors import ConfigError
from tuner.records import TrialRecord
from tuner.study.budget import require_one_trial


def test_baseline_that_cannot_start_stops_the_run_with_the_servers_reason(workdir: Path) -> None:
    """A baseline the checks before the run cannot refuse (a flag or a model path SGLang refuses is
    refused by the dry run now, and a memory failure is explored, not fatal): one never ready
    within its start timeout, the same failure of the baseline a real box sees."""
    config = config_copy("demo-sim.toml", workdir)
    text = config.read_text()
    config.write_text(text.replace("start_timeout_s = 60", "start_timeout_s = 0.3") if "start_timeout_s = 60" in text
                      else text.replace("[service]\n", "[service]\nstart_timeout_s = 0.3\n", 1))
    proc = run_tuner("run", "--config", str(config), "--budget", "5m", cwd=workdir, timeout_s=300)
    line = one_error_line(proc, "could not start")
    assert "baseline (trial 0" in line and "restored" in line and f"`tuner show 0 --config {config}`" in line
    trials = load_study(f"sqlite:///{workdir}/studies/demo-sim.db", "demo-sim").trials
    assert len(trials) == 1  # stopped at once: no candidate was launched after it
    record = TrialRecord.model_validate(trials[0].user_attrs["tuner.record"])
    assert record.failure_class is not None and record.failure_class.value == "startup_timeout"
    shown = run_tuner("show", "0", "--config", str(config), cwd=workdir, timeout_s=120)
    assert shown.returncode == 0, shown.stderr
    assert "startup_timeout" in shown.stdout


def test_baseline_on_a_port_held_by_another_program_stops_the_run(workdir: Path) -> None:
    config = config_copy("demo-sim.toml", workdir)
    port = int(next(x for x in config.read_text().splitlines() if x.startswith("url = ")).rsplit(":", 1)[1].strip('"'))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        proc = run_tuner("run", "--config", str(config), "--budget", "5m", cwd=workdir, timeout_s=300)
    line = one_error_line(proc, str(port))
    assert "in use" in line


def test_url_on_another_port_than_the_command_is_refused_before_any_trial(workdir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_TUNER_LOCK_DIR", str(workdir / "locks"))
    config = config_copy("demo-sim.toml", workdir)
    text = config.read_text()
    url_line = next(x for x in text.splitlines() if x.startswith("url = "))
    config.write_text(text.replace(url_line, 'url = "http://127.0.0.1:9"'))
    proc = run_tuner("run", "--config", str(config), "--budget", "5m", cwd=workdir, timeout_s=120)
    one_error_line(proc, "uses port 9 but the server command has --port")
    # refused before the lock: no process-<port>.lock, no state file, no server log
    left = [p.name for d in (workdir / "locks", workdir / "state") if d.exists() for p in d.rglob("*")]
    assert left == [], left


@pytest.mark.parametrize(("budget", "needle"), [("3", "--budget '3' has no unit"),
                                                ("10s", "shorter than one trial")])
def test_budget_without_unit_or_shorter_than_a_trial_is_one_line(workdir: Path, budget: str, needle: str) -> None:
    config = config_copy("demo-sim.toml", workdir)
    proc = run_tuner("run", "--config", str(config), "--budget", budget, cwd=workdir, timeout_s=120)
    line = one_error_line(proc, needle)
    if budget == "10s":
        assert "give at least --budget 2m" in line  # the steady windows and the burst: about 1m16s


def test_require_one_trial_names_the_minimum_in_whole_minutes() -> None:
    require_one_trial(120.0, 100.0, reserve_s=20.0)  # exactly fits
    with pytest.raises(ConfigError, match=r"--budget 1m50s is shorter .* give at least --budget 3m"):
        require_one_trial(110.0, 100.0, reserve_s=30.0)


def test_explicit_storage_in_a_missing_folder_is_refused_and_not_created(workdir: Path) -> None:
    config = config_copy("demo-sim.toml", workdir)
    missing = workdir / "no" / "such"
    proc = run_tuner("run", "--config", str(config), "--budget", "5m", "--storage", f"sqlite:///{missing}/x.db",
                 cwd=workdir, timeout_s=120)
    one_error_line(proc, f"folder '{missing}' does not exist")
    assert not (workdir / "no").exists()


def test_a_folder_given_as_the_storage_file_is_named_as_a_folder(workdir: Path) -> None:
    config = config_copy("demo-sim.toml", workdir)
    proc = run_tuner("run", "--config", str(config), "--budget", "5m", "--storage", f"sqlite:///{workdir}",
                     cwd=workdir, timeout_s=120)
    line = one_error_line(proc, "is a folder, not a study file")
    assert f"sqlite:///{workdir / 'study.db'}" in line and "owns it" not in line, line


def test_init_into_a_missing_folder_is_one_line_and_its_suggested_dry_run_works(workdir: Path) -> None:
    proc = run_tuner("init", "--sim", "-o", str(workdir / "missing" / "x.toml"), cwd=workdir, timeout_s=60)
    one_error_line(proc, f"folder {workdir / 'missing'} does not exist")
    made = run_tuner("init", "--sim", cwd=workdir, timeout_s=60)
    assert made.returncode == 0, made.stderr
    suggested = made.stdout.split("`")[1].split()
    assert suggested == ["tuner", "run", "--config", "tuner.toml", "--dry-run"]
    dry = run_tuner(*suggested[1:], cwd=workdir, timeout_s=120)
    assert dry.returncode == 0, dry.stderr
    assert "first candidate: the baseline" in dry.stdout
    assert not (workdir / "studies").exists()  # --dry-run changes nothing


def test_consecutive_invalid_arguments_stop_the_run_quoting_the_server_log(tmp_path: Path) -> None:
    from tests.support.offline_server import OfflineExecutor
    from tuner.config import load_config
    from tuner.errors import StudyError
    from tuner.sglang.failures import FailureClass
    from tuner.study.loop import MAX_INVALID_IN_A_ROW, run_study
    from tuner.trial import quote_server_log

    root = Path(__file__).resolve().parents[2]
    lines = ["INFO starting", "launch_server: error: argument --chunked-prefill-size: invalid int value: 'x'"]

    class RejectingCandidates(OfflineExecutor):
        """The baseline runs offline; every candidate is rejected by argparse (exit 2), and the
        record quotes the server's log as the trial does (:func:`tuner.trial.quote_server_log`)."""

        def run(self, job, on_phase):  # noqa: ANN001, ANN202
            if job.kind == "baseline":
                return super().run(job, on_phase)
            self.launches += 1
            return quote_server_log(TrialRecord(
                params=job.params, kind=job.kind, outcome="failed", failure_class=FailureClass.INVALID_ARGUMENTS,
                failure_evidence="exited with status 2 (argparse) before any startup line", duration_s=0.1), lines)

    config = load_config(root / "configs" / "reference-sim.toml")
    runner = RejectingCandidates(config)
    with pytest.raises(StudyError, match="invalid int value: 'x'") as caught:
        run_study(config, runner, max_trials=40, storage_url=":memory:")
    assert f"{MAX_INVALID_IN_A_ROW} trials in a row" in str(caught.value) and "\n" not in str(caught.value)
    assert runner.launches == 1 + MAX_INVALID_IN_A_ROW  # the baseline, then the rejected candidates
