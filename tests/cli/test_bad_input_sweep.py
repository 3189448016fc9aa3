"""The bad inputs of the second operator review's sweep (``shared/operator-review-2.md`` R11): each
was a traceback, an exit 0 or a value accepted and run; each is now one ``error:`` line, exit 1,
before anything is read, written or started."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import one_error_line, run_tuner
from tests.support.configs import config_copy


def _store(tmp_path: Path) -> tuple[str, str]:
    return ("--storage", f"sqlite:///{tmp_path / 'none.db'}")


def test_a_binary_prompts_file_is_one_line(tmp_path: Path) -> None:
    """t4-92: ``read_prompts`` raised UnicodeDecodeError (a 50-line traceback)."""
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes([0xCA, 0xFE, 0xBA, 0xBE, 0xFF, 0x00]) * 50)
    proc = run_tuner("load", "--url", "http://127.0.0.1:9", "--workload", "text", "--prompts", str(garbage),
                     "--concurrency", "4", "--duration", "5")
    one_error_line(proc, "is not UTF-8 text", str(garbage))


def test_a_state_dir_on_a_virtual_file_system_is_refused_by_the_dry_run(tmp_path: Path) -> None:
    """t3-178: ``apply best --dry-run --state-dir /proc/nope`` passed root's permission check (exit 0)."""
    config = config_copy("demo-sim.toml", tmp_path)
    proc = run_tuner("apply", "best", "--dry-run", "--state-dir", "/proc/nope", "--config", str(config),
                     *_store(tmp_path))
    one_error_line(proc, "--state-dir /proc/nope", "cannot be written")


@pytest.mark.parametrize(("option", "value", "needle", "code"), [
    ("--prometheus-textfile", "nodir/t.prom", "folder that does not exist", 1),  # t4-49: the dry run passed
    ("--json-progress", "", "'--json-progress': is empty", 2),  # t4-48: ran with no JSON anywhere
])
def test_the_dry_run_refuses_an_output_the_run_could_not_write(tmp_path: Path, option: str, value: str,
                                                               needle: str, code: int) -> None:
    config = config_copy("demo-sim.toml", tmp_path)
    arg = str(tmp_path / value) if value else value
    for dry in (("--dry-run",), ("--trials", "1")):
        one_error_line(run_tuner("run", "--config", str(config), *dry, option, arg), needle, code=code)
    assert not (tmp_path / "studies").exists()  # the run was refused before its storage


def test_launch_refuses_a_flag_given_no_value(tmp_path: Path) -> None:
    """t4-103: ``--set host=`` rendered ``--host ''``."""
    config = config_copy("demo-sim.toml", tmp_path)
    one_error_line(run_tuner("launch", "--config", str(config), "--set", "host="), "--host is given no value")


@pytest.mark.parametrize(("args", "needle"), [
    (("--mem-fraction-static", "2"), "--mem-fraction-static is for --log"),  # t4-84: ignored beside --trial
    (("--gpu", "NOSUCHGPU"), "--gpu is for --log"),
])
def test_explain_refuses_options_a_trial_would_ignore(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    one_error_line(run_tuner("explain", "--trial", "0", "--study", "demo-sim", *_store(tmp_path), *args), needle)


def test_explain_refuses_a_gpu_its_table_does_not_know() -> None:
    """t4-86/87: every feasibility cell silently read "unknown"."""
    log = Path(__file__).resolve().parents[1] / "fixtures" / "logs" / "reference-0.5.5-tp8.log"
    one_error_line(run_tuner("explain", "--log", str(log), "--gpu", "NOSUCHGPU"), "'NOSUCHGPU'", "sm90")


def test_upgrade_check_refuses_a_version_no_bundled_table_covers(tmp_path: Path) -> None:
    """t4-53: ``--version 9.9`` reported default changes for a version that does not exist."""
    one_error_line(run_tuner("upgrade-check", "--study", "demo-sim", *_store(tmp_path), "--version", "9.9"),
                   "--version 9.9 is outside", "--python")


@pytest.mark.parametrize(("section", "line", "needle"), [
    ("[service]", 'window = "02:00-02:00"', "an empty window"),  # t4-13: taken as always open
    ("[quality]", 'enabled = "yes"', "quality.enabled"),  # t4-26: a string taken as true
])
def test_a_config_value_the_run_would_misread_is_refused(tmp_path: Path, section: str, line: str,
                                                         needle: str) -> None:
    if section == "[service]":
        config = config_copy("demo-sim.toml", tmp_path, extra_service=line + "\n")
    else:
        config = config_copy("demo-sim.toml", tmp_path)
        config.write_text(config.read_text() + f"\n{section}\n{line}\n")
    one_error_line(run_tuner("run", "--config", str(config), "--dry-run"), needle)


def test_the_whole_day_window_is_still_accepted(tmp_path: Path) -> None:
    config = config_copy("demo-sim.toml", tmp_path, extra_service='window = "00:00-24:00"\n')
    proc = run_tuner("run", "--config", str(config), "--dry-run")
    assert proc.returncode == 0, proc.stderr


# ---- a new user's sweep of stop 38 (about 565 inputs): the tracebacks and the dry runs that passed a failing run


def _with(tmp_path: Path, section: str, line: str) -> Path:
    """The demo config with ``line`` set in ``[section]`` (replacing the key where it is set)."""
    import re

    config = config_copy("demo-sim.toml", tmp_path)
    text = config.read_text()
    key = line.split("=", 1)[0].strip()
    start = text.index(f"[{section}]") if f"[{section}]" in text else -1
    if start < 0:
        text += f"\n[{section}]\n{line}\n"
    else:
        end = text.find("\n[", start + 1)
        end = len(text) if end < 0 else end
        body = text[start:end]
        body = re.sub(rf"(?m)^{key} = .*$", line, body) if re.search(rf"(?m)^{key} = ", body) else body.rstrip() + f"\n{line}\n"
        text = text[:start] + body + text[end:]
    config.write_text(text)
    return config


@pytest.mark.parametrize(("section", "line", "needle"), [
    ("study", "seed = -1", "study.seed"),  # numpy: expected non-negative integer (a traceback)
    ("study", "seed = 1000000000000000000000000000000", "study.seed"),  # Optuna's seed range, at the first trial
    ("workload", "input_len = 1000000000000000000000000000000", "workload"),  # int64 overflow in the sampler
    ("budget", "stress_s = inf", "budget.stress_s"),  # OverflowError formatting the estimate
    ("storage", 'url = "sqlite://"', "keeps the study in memory"),  # three chained tracebacks
    ("storage", 'url = "sqlite:///:memory:"', "keeps the study in memory"),
    ("storage", 'artifacts_dir = "/etc/passwd"', "is a file, not a folder"),  # FileExistsError after the study
    ("service", 'workdir = "/nonexistent/dir"', "[service] workdir"),  # read as "server command not found"
    ("model", 'config_json = "/nonexistent/config.json"', "[model] config_json"),  # ignored
])
def test_a_config_the_run_would_trip_on_is_refused_by_the_dry_run(tmp_path: Path, section: str, line: str,
                                                                   needle: str) -> None:
    config = _with(tmp_path, section, line)
    assert line in config.read_text()
    one_error_line(run_tuner("run", "--config", str(config), "--dry-run"), needle)
    assert not (tmp_path / "studies").exists()


@pytest.mark.parametrize(("args", "needle"), [
    (("--rate", "inf"), "--rate inf"),  # an unbounded arrival loop: 22 GB, then the OOM killer
    (("--concurrency", "100000000"), "--concurrency 100000000"),  # MemoryError
    (("--concurrency", "1", "--seed", "-1"), "--seed -1"),  # read as "no request completed"
    (("--rate", "1", "--burstiness", "0"), "--burstiness 0"),
])
def test_load_refuses_a_pace_it_cannot_keep_before_any_request(args: tuple[str, ...], needle: str) -> None:
    proc = run_tuner("load", "--url", "http://127.0.0.1:9", "--input-len", "64", "--output-len", "4",
                     "--duration", "3", *args)
    one_error_line(proc, needle)
