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


# ---- issue 42's last sweep (a new user's, ≈ 2,230 inputs: every command, option and config key): each
# case below was an exit 0, a value coerced or accepted that the run then failed on, or a line naming the
# wrong thing. In-process (the script's entry point, `tuner_cli`), each refused before anything starts.

def _cmd(old: str, new: str) -> tuple[str, str]:
    """The demo (on port 30000) with ``old`` text replaced by ``new`` (a ``replace`` case of the test below)."""
    return "replace", f"{old}=>{new}"


@pytest.mark.parametrize(("section", "line", "needles"), [
    # empty strings were "left out" (the default, exit 0)
    ("storage", 'url = ""', ("storage.url is empty",)),
    ("service", 'python = ""', ("service.python is empty",)),
    ("service", 'sglang_version = ""', ("service.sglang_version is empty",)),
    ("service", 'state_dir = " "', ("service.state_dir is empty",)),
    ("model", 'config_json = "a\\u0000b"', ("model.config_json", "NUL")),  # a ValueError traceback at open()
    # numbers in quotes were coerced (pydantic's lax mode)
    ("service", 'start_timeout_s = "60"', ("service.start_timeout_s = '60' is a string", "start_timeout_s = 60")),
    ("budget", 'trials = "2"', ("budget.trials = '2' is a string", "trials = 2")),
    ("study", "seed = true", ("study.seed = True is not an integer", "seed = 0")),
    ("workload", 'input_len = "2016"', ("workload.input_len = '2016' is a string",)),
    ("slo", 'ttft_ms = { p99 = "9000" }', ("slo.ttft_ms.p99 = '9000' is a string",)),
    # the baseline's own command: the run stored a failed baseline, then said why
    (*_cmd('"--enable-metrics"', '"--enable-metrics", "--no-such-flag"'), ("unrecognized arguments: --no-such-flag",)),
    (*_cmd('"0.80"', '"1.5"'), ("mem_fraction_static=1.5",)),
    (*_cmd('"L4-24GB"', '"NOPE"'), ("--sim-gpu", "'NOPE'")),
    (*_cmd('"llama-3.1-8b"', '"no-such-model"'), ("--model-path 'no-such-model'",)),
    # a workload the model cannot hold (every request refused), a version no flag table covers
    ("workload", "input_len = 200000", ("200,032 tokens", "context length (131,072 tokens")),
    ("objective", "context_tokens = 140000", ("[objective] context_tokens 140,000",)),
    ("service", 'sglang_version = "9.9.9"', ("sglang_version 9.9.9 is outside the bundled",)),
    # lines that named the wrong thing
    ("service", 'state_dir = "/proc/nope"', ("cannot be written", "[service] state_dir")),  # named a key log_dir
    ("space", "mem_fraction_static = [0.8]", ("is a range", "[low, high]")),  # "missing key"
    ("budget", 'total = "1s"', ("[budget] total 1s is shorter", 'total = "')),  # "--budget", never passed
    (*_cmd('"http://127.0.0.1:30000"', '"http://192.0.2.1:30000"'), ("is not this machine",)),  # "port in use"
])
def test_a_config_the_run_would_refuse_is_refused_first(tmp_path: Path, tuner_cli, section: str, line: str,  # noqa: ANN001
                                                       needles: tuple[str, ...]) -> None:
    if section == "replace":
        old, new = line.split("=>")
        config = config_copy("demo-sim.toml", tmp_path, replace={old: new}, port=30000)
    else:
        config = _with(tmp_path, section, line)
    proc = tuner_cli("run", "--config", str(config), "--dry-run")
    error = one_error_line(proc, *needles)
    assert "log_dir" not in error and "missing key" not in error
    assert not (tmp_path / "studies").exists()


@pytest.mark.parametrize(("args", "needle", "code"), [
    (("run", "--config", "{demo}", "--dry-run", "--budget", ""), "'--budget' / '-b': is empty", 2),  # exit 0
    (("run", "--config", "", "--dry-run"), "'--config' / '-c': is empty", 2),  # read as the folder "."
    (("trials", "--study", "", "--storage", "{store}"), "'--study': is empty", 2),
    (("restore", "--unit", "x.service", "--systemctl", ""), "'--systemctl': is empty", 2),  # the default systemctl
    (("launch", "--config", "{demo}", "--set", "port=31000"), "has --port 31000", 1),  # the url's port ignored
    (("load", "--url", "http://127.0.0.1:9", "--knob", "rate"), "--knob is an option of --max-under-slo", 1),
    (("load", "--url", "http://127.0.0.1:9", "--time-budget", "60"), "--time-budget is an option of", 1),
    (("trials", "--storage", "sqlite:///{tmp}"), "is a folder, not a study file", 1),  # "does not exist"
    (("apply", "best", "--dry-run", "--storage", "{store}", "--verify-s", "inf"), "--verify-s inf", 1),
    (("applies", "--storage", "{store}", "--study", "nope"), "has no study 'nope'", 1),  # exit 0: "no apply yet"
])
def test_an_option_the_command_would_misread_is_refused(tmp_path: Path, tuner_cli, args: tuple[str, ...],  # noqa: ANN001
                                                        needle: str, code: int) -> None:
    import shutil

    store = tmp_path / "store.db"
    shutil.copy(Path(__file__).resolve().parents[1] / "fixtures" / "studies" / "records-2639f26.db", store)
    demo = config_copy("demo-sim.toml", tmp_path, port=30000)
    filled = [a.format(demo=demo, store=f"sqlite:///{store}", tmp=tmp_path) for a in args]
    one_error_line(tuner_cli(*filled), needle, code=code)


def test_upgrade_check_with_a_program_that_is_not_python_says_so_in_one_short_line(tmp_path: Path, tuner_cli) -> None:  # noqa: ANN001
    """``--python /bin/ls`` printed SGLang's introspection script (30 lines of code) inside its error."""
    import shutil

    store = tmp_path / "store.db"
    shutil.copy(Path(__file__).resolve().parents[1] / "fixtures" / "studies" / "records-2639f26.db", store)
    line = one_error_line(tuner_cli("upgrade-check", "--storage", f"sqlite:///{store}", "--study",
                                    "l4-chunks-2639f26", "--python", "/bin/ls"), "sglang is not importable with /bin/ls")
    assert "import" not in line.split("/bin/ls", 1)[1] and len(line) < 300, line


def test_load_refuses_a_prompt_longer_than_the_server_s_context_before_sending(tmp_path: Path, tuner_cli) -> None:  # noqa: ANN001
    """``--input-len 999999`` on a 131,072-token model: every request was refused by the server and the
    load said "no request completed"; now one line naming the server's limit, before the first request."""
    from tests.support.sim import start_healthy

    sim = start_healthy(["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB"], tmp_path)
    try:
        one_error_line(tuner_cli("load", "--url", sim.url, "--input-len", "999999", "--output-len", "4",
                                 "--concurrency", "1", "--duration", "2"), "longest", "(999,999 tokens)",
                       "exceeds the server's")
    finally:
        sim.stop()
