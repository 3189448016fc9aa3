"""The rough edges a new user hits with the `tuner` command line (issue 16), each through the real
entry point in a subprocess: real SQLite studies, real simulator processes where a server is
needed. (Edges 1, 10, 13: tests/sim/test_sim_cli_edges.py; 5, 11's residue, 14:
tests/sglang/test_explain_edges.py; 9 belongs to issue 11.)"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.configs import config_copy
from tests.support.study_factory import failed_trial, make_study, ok_trial, skipped_trial

REPO = Path(__file__).resolve().parents[1]
TUNER = str(Path(sys.executable).with_name("tuner"))


def tuner(*args: str, cwd: Path | None = None, columns: int | None = 120, timeout_s: float = 180.0,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real `tuner` script; stdout is a pipe (as with `| cat`)."""
    base = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "NO_COLOR": "1", "HOME": os.environ.get("HOME", "/root")}
    if columns is not None:
        base["COLUMNS"] = str(columns)
    return subprocess.run([TUNER, *args], capture_output=True, text=True, timeout=timeout_s, check=False, cwd=cwd,
                          env={**base, **(env or {})})


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert " — " in lines[0], f"no fix named: {lines[0]}"
    return lines[0]


def _demo_config(folder: Path, *, extra_flags: str = "", name: str = "demo-sim") -> Path:
    """configs/demo-sim.toml on a free port with its own state dir (tests.support.configs), renamed."""
    replace = {'name = "demo-sim"': f'name = "{name}"'}
    if extra_flags:
        replace['"--enable-metrics"]'] = f'"--enable-metrics", {extra_flags}]'
    copy = config_copy("demo-sim.toml", folder, replace=replace, slo=False)
    return copy.rename(folder / f"{name}.toml")


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    """(folder, storage URL, config): a study of the process launcher whose config is on disk."""
    folder = tmp_path_factory.mktemp("edges")
    config = _demo_config(folder)
    url = make_study(folder / "demo.db", "demo", [
        ok_trial(0.80, 256, 10, 44.0, kind="baseline"),
        ok_trial(0.95, 23, 23, 53.3, kind="predicted", slo_overshoot=-0.3764999396400026),
        failed_trial(0.97, "cuda_graph_oom", "Capture cuda graph failed: CUDA out of memory"),
        skipped_trial(0.98, 2),
    ], info={"config_path": str(config), "target": {"launcher": "process", "url": "http://127.0.0.1:1"}})
    return folder, url, config


# ---- 2: the GPU monitor hint names the real key ------------------------------------------------


def test_gpu_monitor_hint_names_the_service_key() -> None:
    from tuner.errors import GPUError
    from tuner.gpu import GPUMonitor

    with pytest.raises(GPUError) as err:
        GPUMonitor.for_target("bogus")
    assert '[service] gpu_monitor = "nvml"' in str(err.value) and 'gpu = "sim"' not in str(err.value)
    src = (REPO / "tuner" / "gpu.py").read_text(encoding="utf-8")
    assert 'gpu = \\"sim\\"' not in src  # every hint (no NVML, no driver) names [service] gpu_monitor


# ---- 3: commands are printed unwrapped for pasting and piping --------------------------------


def test_apply_dry_run_prints_the_command_on_one_line_through_a_pipe(study) -> None:
    folder, url, config = study
    proc = tuner("apply", "best", "--storage", url, "--config", str(config), "--dry-run", columns=80)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "-m tuner.sim" in line]
    assert len(lines) == 1, proc.stdout
    argv = shlex.split(lines[0])
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.95" and argv[-1] != "" and "--enable-metrics" in argv


def test_launch_preview_prints_the_command_on_one_line_through_a_pipe(study) -> None:
    _, _, config = study
    proc = tuner("launch", "--config", str(config), "--set", "mem-fraction-static=0.9", columns=80)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "-m tuner.sim" in line]
    assert lines and all(len(line) > 80 for line in lines), proc.stdout
    assert "--enable-metrics" in lines[-1] and "0.9" in lines[-1]


# ---- 4: options that would be ignored are refused --------------------------------------------


def test_init_sim_with_unit_is_refused(tmp_path: Path) -> None:
    line = one_error_line(tuner("init", "--sim", "--unit", "sglang.service", "-o", str(tmp_path / "x.toml")))
    assert "--sim" in line and "--unit" in line
    assert not (tmp_path / "x.toml").exists()


def test_explain_log_with_unit_is_refused() -> None:
    log = REPO / "tests" / "fixtures" / "logs" / "reference-0.5.5-tp8.log"
    line = one_error_line(tuner("explain", "--log", str(log), "--unit", "sglang.service"))
    assert "--log" in line and "--unit" in line


# ---- 6: negative durations -------------------------------------------------------------------


@pytest.mark.parametrize(("args", "flag"), [
    (("apply", "best", "--dry-run", "--timeout-s", "-1"), "--timeout-s"),
    (("apply", "best", "--dry-run", "--verify-s", "-5"), "--verify-s"),
    (("restore", "--unit", "nosuch.service", "--timeout-s", "-3"), "--timeout-s"),
    (("restore", "--unit", "nosuch.service", "--timeout-s", "0"), "--timeout-s"),
])
def test_negative_durations_are_refused_before_anything(study, args: tuple[str, ...], flag: str) -> None:
    _, url, config = study
    state = study[0] / "refused-state"
    extra = ("--storage", url, "--config", str(config), "--state-dir", str(state)) if args[0] == "apply" \
        else ("--state-dir", str(state))
    line = one_error_line(tuner(*args, *extra))
    assert line.startswith(f"error: {flag} ") and "seconds" in line, line
    assert not state.exists()


# ---- 7: report -o checks its path first, as the other commands do -----------------------------


def test_report_into_a_missing_folder_is_refused_and_creates_nothing(study) -> None:
    folder, url, _ = study
    line = one_error_line(tuner("report", "--storage", url, "-o", str(folder / "missing" / "dir" / "r.html")))
    assert "does not exist" in line
    assert not (folder / "missing").exists()


def test_report_onto_a_folder_fails_at_once(study) -> None:
    folder, url, _ = study
    (folder / "adir").mkdir(exist_ok=True)
    line = one_error_line(tuner("report", "--storage", url, "-o", str(folder / "adir")))
    assert "is a folder" in line
    # checked before the study is read or any figure built (which took ~10 s before it failed):
    # with a storage that does not exist, the output path is still what is refused
    line = one_error_line(tuner("report", "--storage", f"sqlite:///{folder / 'no-such.db'}", "-o", str(folder / "adir")))
    assert "--output" in line and "is a folder" in line and "no-such.db" not in line, line


# ---- 8: a failed baseline's hint is a command that works ---------------------------------------


def test_failed_baseline_hint_works_with_two_studies(tmp_path: Path) -> None:
    (tmp_path / "studies").mkdir()
    make_study(tmp_path / "studies" / "other.db", "other", [ok_trial(0.8, 64, 10, 100.0, kind="baseline")])
    # A baseline that cannot start (a flag SGLang refuses is now refused before the run, by the
    # command check; a memory failure is explored, not fatal): one never ready within its timeout.
    config = _demo_config(tmp_path, name="broken")
    config.write_text(config.read_text().replace("start_timeout_s = 60", "start_timeout_s = 0.3"))
    proc = tuner("run", "--config", str(config), "--budget", "3m", cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    hint = re.search(r"`(tuner show [^`]+)`", line)
    assert hint, line
    shown = tuner(*shlex.split(hint.group(1))[1:], cwd=tmp_path)
    assert shown.returncode == 0, (hint.group(1), shown.stderr)
    assert "startup_timeout" in shown.stdout, shown.stdout[-2000:]


@pytest.mark.slow
def test_following_a_failed_baseline_s_hint_leads_to_a_run_not_a_second_refusal(tmp_path: Path) -> None:
    """Operator review 2, R3: a typo in the model path stored a failed baseline with that
    environment; after fixing the typo as told, ``run`` refused a "mixed environment". A study
    whose trials never started a server adopts the fixed run's environment, and the best is
    compared with the baseline that measured (the closing table crashed on the failed one).
    A typo is now refused before the run (the simulator's parser); a baseline on another GPU that is
    never ready within its start timeout still stores a failed baseline with its environment."""
    config = _demo_config(tmp_path, name="typo")
    good = config.read_text()
    config.write_text(good.replace('"L4-24GB"', '"H100-80GB"', 1).replace("start_timeout_s = 60", "start_timeout_s = 0.3"))
    assert config.read_text() != good
    failed = tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=300)
    assert failed.returncode == 1 and "could not start" in failed.stderr, failed.stderr[-2000:]
    config.write_text(good)
    dry = tuner("run", "--config", str(config), "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-2000:]
    fixed = tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=300)
    assert fixed.returncode == 0, fixed.stdout[-2000:] + fixed.stderr[-2000:]
    assert "Traceback" not in fixed.stderr and "vs baseline (trial 1)" in fixed.stdout, fixed.stdout[-2000:]


# ---- 11: tables fit a narrow terminal; no raw floats ---------------------------------------------


def test_trials_headers_are_whole_at_80_columns(study) -> None:
    _, url, _ = study
    proc = tuner("trials", "--storage", url, columns=80)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout, proc.stdout
    assert all(len(line) <= 80 for line in proc.stdout.splitlines()), proc.stdout
    header = " ".join(proc.stdout.split("─")[0].split())
    for name in ("mfs", "max_run", "chunk", "tokens", "tok/s", "status"):
        assert name in header.split(), (name, header)


def test_show_prints_no_raw_floats(study) -> None:
    _, url, _ = study
    proc = tuner("show", "1", "--storage", url)
    assert proc.returncode == 0, proc.stderr
    assert not re.search(r"\d\.\d{6,}", proc.stdout), re.findall(r"\S*\d\.\d{6,}\S*", proc.stdout)
    assert "-0.376" in proc.stdout or "−0.376" in proc.stdout or "-0.38" in proc.stdout


# ---- 12: the starter config is portable; the dry run speaks ranges ------------------------------


def test_init_sim_writes_a_portable_config_with_a_real_study_name(tmp_path: Path) -> None:
    out = tmp_path / "mine.toml"
    proc = tuner("init", "--sim", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text(encoding="utf-8")
    assert sys.executable not in text and str(Path(sys.executable).parent) not in text
    assert '"{python}"' in text
    name = re.search(r'(?m)^name = "([^"]+)"', text).group(1)
    assert name != "sim" and "llama" in name, name
    dry = tuner("run", "--config", str(out), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "Distribution(" not in dry.stdout, dry.stdout
    assert re.search(r"mem_fraction_static: 0\.\d+ to 0\.\d+", dry.stdout), dry.stdout


# ---- 15: help and version ----------------------------------------------------------------------


def test_version_is_printed() -> None:
    from importlib.metadata import version

    proc = tuner("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"tuner {version('sglang-tuner')}", proc


def test_top_level_help_does_not_cut_command_lines() -> None:
    proc = tuner("--help", columns=100)
    assert proc.returncode == 0
    commands = proc.stdout.split("Commands:")[1]
    assert "..." not in commands, commands


@pytest.mark.parametrize(("args", "needle"), [
    (("launch", "--help"), "repeat"),
    (("run", "--help"), "[default: (the config's [budget] trials"),
    (("restore", "--help"), "[default: (/var/lib/sglang-tuner as root"),
    (("apply", "--help"), "[default: (/var/lib/sglang-tuner as root"),
    (("trials", "--help"), "[default: (number)]"),
])
def test_help_says_repeats_and_defaults(args: tuple[str, ...], needle: str) -> None:
    proc = tuner(*args, columns=200)
    assert proc.returncode == 0
    assert needle in " ".join(proc.stdout.split()), proc.stdout
    assert "<int range>" not in proc.stdout and "x>=1" not in proc.stdout


# ---- 16: the manual says how tuner load's ITL differs from bench_serving's -----------------------


def test_the_manual_says_itl_is_per_token_unlike_bench_serving_per_chunk() -> None:
    text = " ".join((REPO / "docs" / "load-generator.md").read_text(encoding="utf-8").split())
    assert "ITL is per token" in text and "per streamed *chunk*" in text and "avg_spec_accept_length" in text


# ---- 17: a corrupt SQLite file is not a database server problem ---------------------------------


def test_corrupt_sqlite_file_names_the_file_not_a_server(tmp_path: Path) -> None:
    db = tmp_path / "broken.db"
    db.write_bytes(b"SQLite format 3\x00" + os.urandom(4000))
    line = one_error_line(tuner("trials", "--storage", f"sqlite:///{db}"))
    assert "database server" not in line and "credentials" not in line, line
    assert "not an SQLite database" in line or "corrupt" in line, line


def _damaged_midway(db: Path) -> None:
    """4 KiB of random bytes over the file's third page on: still an SQLite file, its pages broken."""
    with open(db, "r+b") as handle:
        handle.seek(8192)
        handle.write(os.urandom(4096))


def _trials_table_dropped(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("DROP TABLE trials")


def _garbled_value(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE trial_user_attributes SET value_json = '{not json'")


DAMAGES = {"damaged-midway": (_damaged_midway, "corrupt"), "trials-table-dropped": (_trials_table_dropped, "trials"),
           "garbled-value": (_garbled_value, "cannot be read")}


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("command", [["trials"], ["show", "1"], ["best"], ["apply", "best", "--dry-run"]])
def test_a_damaged_study_file_is_one_line_for_every_reader(study: tuple[Path, str, Path], tmp_path: Path,
                                                            damage: str, command: list[str]) -> None:
    """A study file that opens but is damaged inside (found by a new user's sweep: a traceback
    through Optuna's "invalid data in the commit", or a JSONDecodeError)."""
    folder, url, _ = study
    db = tmp_path / "demo.db"
    shutil.copyfile(url.removeprefix("sqlite:///"), db)
    harm, words = DAMAGES[damage]
    harm(db)
    line = one_error_line(tuner(*command, "--storage", f"sqlite:///{db}", cwd=folder))
    assert str(db) in line and words in line and ".recover" in line, line


def test_a_run_refuses_a_study_with_a_garbled_value_in_one_line(study: tuple[Path, str, Path], tmp_path: Path) -> None:
    folder, url, _ = study
    db = tmp_path / "demo.db"
    shutil.copyfile(url.removeprefix("sqlite:///"), db)
    _garbled_value(db)
    config = _demo_config(tmp_path, name="demo")  # the stored study's name
    proc = tuner("run", "--config", str(config), "--dry-run", "--storage", f"sqlite:///{db}",
                 "--allow-mixed-environment", cwd=tmp_path)  # its environment is another GPU's: said, then allowed
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "cannot be read" in line and str(db) in line and ".recover" in line, line


def test_the_dry_run_of_a_resumed_study_does_not_promise_the_baseline(study: tuple[Path, str, Path],
                                                                       tmp_path: Path) -> None:
    """A study with a measured baseline resumes with the planner's pick (a new user's sweep saw the
    dry run promise the baseline, and the run launch trial 4)."""
    _, url, _ = study
    config = _demo_config(tmp_path, name="demo")  # the stored study's name
    proc = tuner("run", "--config", str(config), "--dry-run", "--storage", url, "--allow-mixed-environment", cwd=tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "first candidate: chosen from the study's 3 measured trial(s)" in proc.stdout, proc.stdout
    assert "the baseline is trial 0" in proc.stdout and "first candidate: the baseline" not in proc.stdout
    fresh = tuner("run", "--config", str(config), "--dry-run", "--storage", f"sqlite:///{tmp_path / 'new.db'}",
                  cwd=tmp_path)
    assert "first candidate: the baseline (the service's current flags)" in fresh.stdout, fresh.stdout


def test_invalid_config_value_names_its_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[study]\nname = 3\n', encoding="utf-8")
    line = one_error_line(tuner("run", "--config", str(bad), "--dry-run"))
    assert "study.name" in line.split(" — ")[1], line
