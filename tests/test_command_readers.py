"""Every reader of a server command line reads it through :mod:`tuner.sglang.flags`: the same rules
(``--flag value`` or ``--flag=value``, the last occurrence wins, as argparse) wherever it is read."""

from __future__ import annotations

import pytest

from tuner.config import TunerConfig, check_url_matches_port, parse_config
from tuner.entrypoints import resolve_environment, resolve_flag_table
from tuner.errors import StudyError
from tuner.study.hostcheck import ranks_of

SIM = ["python", "-m", "tuner.sim", "--model-path", "llama-3.1-8b"]


def _config(argv: list[str]) -> TunerConfig:
    return parse_config({
        "study": {"name": "readers"},
        "service": {"launcher": "process", "command": argv, "url": "http://127.0.0.1:31000"},
        "workload": {"kind": "random", "input_len": 512, "output_len": 64},
    })


def test_ranks_are_tp_times_pp_in_any_spelling() -> None:
    assert ranks_of(["--tp", "4", "--pp-size=2"]) == 8
    assert ranks_of(["--tensor-parallel-size", "2", "--pipeline-parallel-size", "3"]) == 6
    assert ranks_of(["--tp-size", "2", "--tp", "4"]) == 4  # the last occurrence, as SGLang reads it
    assert ranks_of(["--tp", "x"]) == 1 and ranks_of(["--tp", "0"]) == 1 and ranks_of([]) == 1


def test_the_port_check_reads_the_last_port_in_either_form() -> None:
    check_url_matches_port("http://127.0.0.1:31000", ["--port", "30000", "--port=31000"])
    with pytest.raises(StudyError, match="uses port 31000 but the server command has --port 30000"):
        check_url_matches_port("http://127.0.0.1:31000", ["--port=31000", "--port", "30000"])
    check_url_matches_port("http://127.0.0.1:31000", ["--port"])  # no value: nothing to compare


@pytest.mark.parametrize("flags", [["--sim-version", "0.5.23"], ["--sim-version=0.5.23"]])
def test_the_simulators_version_and_gpu_are_read_in_either_form(flags: list[str]) -> None:
    argv = [*SIM, *flags, "--sim-gpu=L4-24GB"]
    table = resolve_flag_table(_config(argv), argv)
    assert table.version == "0.5.23"
    env = resolve_environment(_config(argv), argv, table, gpu=None)
    assert env["gpu_name"] == "L4-24GB" and env["driver_version"] == "simulated"


def test_the_simulators_default_version_without_the_flag() -> None:
    assert resolve_flag_table(_config(SIM), SIM).version == "0.5.5"
    assert resolve_flag_table(_config([*SIM, "--sim-version"]), [*SIM, "--sim-version"]).version == "0.5.5"
