"""Flags by version: bundled tables, rendering, replacing, parsing, validation, live introspection."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tuner.errors import FlagError
from tuner.sglang.flags import (
    FlagTable,
    flag_int,
    flag_value,
    parse_argv,
    parse_human_int,
    render,
    replace_flags,
    unknown_flags,
    validate,
)

BASE = "python -m sglang.launch_server --model /m --tp 8 --mem-fraction-static=0.8 --cuda-graph-max-bs 8 --enable-metrics --port 30000".split()


@pytest.mark.parametrize(
    ("version", "table", "graph_flag", "tp_flag"),
    [
        ("0.5.5", "0.5.5.post3", "--cuda-graph-max-bs", "--tensor-parallel-size"),
        ("0.5.10", "0.5.10", "--cuda-graph-max-bs", "--tensor-parallel-size"),
        ("0.5.16", "0.5.10", "--cuda-graph-max-bs", "--tensor-parallel-size"),
        ("0.5.23", "0.5.23", "--cuda-graph-max-bs-decode", "--tp-size"),
        ("v0.6.1", "0.5.23", "--cuda-graph-max-bs-decode", "--tp-size"),
    ],
)
def test_render_uses_the_versions_spelling(version: str, table: str, graph_flag: str, tp_flag: str) -> None:
    t = FlagTable.for_version(version)
    assert t.table_version == table
    argv = render({"mem_fraction_static": 0.88, "cuda_graph_max_bs": 256, "tp_size": 8, "chunked_prefill_size": -1,
                   "enable_hierarchical_cache": True, "disable_radix_cache": False, "max_running_requests": None}, t)
    assert argv == ["--mem-fraction-static", "0.88", graph_flag, "256", tp_flag, "8", "--chunked-prefill-size", "-1",
                    "--enable-hierarchical-cache"]


def test_unknown_flag_names_version_and_nearest_spelling() -> None:
    with pytest.raises(FlagError, match=r"SGLang 0\.5\.5 has no flag --cuda-graph-max-bs-prefill — .*--cuda-graph-max-bs"):
        render({"cuda_graph_max_bs_prefill": 8}, FlagTable.for_version("0.5.5"))
    with pytest.raises(FlagError, match="choices|one of"):
        render({"kv_cache_dtype": "fp4_e2m1"}, FlagTable.for_version("0.5.23"))
    assert not FlagTable.for_version("0.5.23").has("--cuda-graph-max-bs")
    assert FlagTable.for_version("0.5.10").has("--cuda-graph-max-bs")


@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
def test_replace_keeps_everything_else(version: str) -> None:
    t = FlagTable.for_version(version)
    new = replace_flags(BASE, {"mem_fraction_static": 0.9, "tp_size": 8, "cuda_graph_max_bs": 16, "enable_metrics": False}, t)
    parsed = parse_argv(new, t)
    assert parsed == {"model_path": "/m", "tp_size": 8, "mem_fraction_static": 0.9, "cuda_graph_max_bs": 16, "port": 30000}
    assert new[:5] == BASE[:5]  # program, module and untouched flags in place
    assert "--mem-fraction-static=0.8" not in new and new.count("--port") == 1
    again = replace_flags(new + ["--enable-metrics"], {"enable_metrics": True}, t)
    assert again.count("--enable-metrics") == 1


def test_parse_argv_types_and_aliases() -> None:
    t = FlagTable.for_version("0.5.23")
    got = parse_argv(["--max-total-tokens", "128k", "--cuda-graph-bs-decode", "1", "2", "4", "--dp", "2",
                      "--enable-tf32-matmul", "--no-dllm-fdfo", "--unknown-x", "1"], t)
    assert got == {"max_total_tokens": 128000, "cuda_graph_bs": [1, 2, 4], "dp_size": 2, "enable_tf32_matmul": True, "dllm_fdfo": False}
    assert parse_human_int("1Mi") == 2**20


def test_flag_value_reads_a_command_as_argparse_does_without_a_table() -> None:
    argv = [*BASE, "--port=31000", "--page-size", "64", "--tp-size", "x"]
    assert flag_value(argv, "--port") == "31000"  # the last occurrence wins (argparse's store action)
    assert flag_value(argv, "--model-path", "--model") == "/m"  # any spelling of one option
    assert flag_value(argv, "--tp-size", "--tp") == "x" and flag_value(argv, "--tp") == "8"
    assert flag_value(argv, "--tensor-parallel") is None  # exact spellings only: prefixes need the table
    assert flag_value(["--port"], "--port") is None and flag_value([], "--port") is None
    assert flag_int(argv, "--page-size") == 64 and flag_int(["--page-size=16"], "--page-size") == 16
    assert flag_int(argv, "--tp-size", "--tp") is None  # "x": SGLang refuses the command
    assert flag_int(argv, "--dp-size") is None
    # The typed reader with a table agrees where both read.
    assert parse_argv(argv, FlagTable.for_version("0.5.23"))["port"] == int(flag_value(argv, "--port") or 0)


def test_parse_human_int_is_sglangs_case_sensitive_rule() -> None:
    """SGLang's human_readable_int (srt/utils/common.py, 0.5.10 and 0.5.23): case-sensitive
    suffixes, decimals with SI suffixes only."""
    assert parse_human_int("16k") == 16000 and parse_human_int("25.6k") == 25600 and parse_human_int("2Ki") == 2048
    assert parse_human_int("-1") == -1
    for bad in ("16K", "1.5Ki", "1 k", "1kb"):
        with pytest.raises(ValueError):
            parse_human_int(bad)


def test_validate_reasons() -> None:
    old, new = FlagTable.for_version("0.5.10"), FlagTable.for_version("0.5.23")
    bad = {"enable_hierarchical_cache": True, "disable_radix_cache": True, "hicache_ratio": 1.0,
           "chunked_prefill_size": 100, "page_size": 64, "mem_fraction_static": 1.2}
    reasons = validate(bad, old)
    assert any("mutually exclusive" in r for r in reasons)
    assert any("host pool must be larger" in r for r in reasons)
    assert any("not a multiple of page_size=64" in r for r in reasons)
    assert any("outside (0, 1)" in r for r in reasons)
    assert not any("host pool" in r for r in validate(bad, new))  # 0.5.16+ only warns (§7)
    assert validate({"mem_fraction_static": 0.88, "chunked_prefill_size": 8192, "page_size": 64, "cuda_graph_max_bs": 128}, new) == []
    assert any("no flag --foo" in r for r in validate({"foo": 1}, new))


FAKE_SGLANG = textwrap.dedent('''
    __version__ = "0.5.99"
''')
FAKE_SERVER_ARGS = textwrap.dedent('''
    class ServerArgs:
        @staticmethod
        def add_cli_args(parser):
            parser.add_argument("--mem-fraction-static", type=float, default=None)
            parser.add_argument("--cuda-graph-max-bs-decode", type=int)
            parser.add_argument("--enable-hierarchical-cache", "--enable-hicache", action="store_true")
''')


def test_from_python_reads_the_installed_parser(tmp_path: Path) -> None:
    pkg = tmp_path / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text(FAKE_SGLANG)
    (pkg / "__init__.py").write_text("")
    (pkg / "server_args.py").write_text(FAKE_SERVER_ARGS)
    t = FlagTable.from_python(sys.executable, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout_s=60)
    assert t.version == "0.5.99"
    assert render({"cuda_graph_max_bs": 64, "enable_hierarchical_cache": True}, t) == ["--cuda-graph-max-bs-decode", "64", "--enable-hierarchical-cache"]
    assert t.has("--enable-hicache")


def test_from_python_without_sglang_is_a_flag_error(tmp_path: Path) -> None:
    with pytest.raises(FlagError, match="sglang is not importable"):
        FlagTable.from_python(sys.executable, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout_s=60)
    with pytest.raises(FlagError, match="not found"):
        FlagTable.from_python(str(tmp_path / "no-python"))


def test_unknown_flags_of_a_command() -> None:
    argv = ["python", "-m", "sglang.launch_server", "--model", "/m", "--tp", "2", "--cuda-graph-max-bs", "64", "--mem-fracton-static", "0.8"]
    reasons = unknown_flags(argv, FlagTable.for_version("0.5.23"))
    assert reasons[0] == "SGLang 0.5.23 has no flag --cuda-graph-max-bs; its spelling is --cuda-graph-max-bs-decode"
    assert "--mem-fracton-static" in reasons[1] and "--mem-fraction-static" in reasons[1] and len(reasons) == 2
    assert unknown_flags(argv[:-2], FlagTable.for_version("0.5.10")) == []


@pytest.mark.parametrize(("argv", "sim"), [
    (["python3", "-m", "tuner.sim", "--model-path", "m"], True),
    (["/opt/venv/bin/tuner", "sim", "serve", "--model-path", "m"], True),
    (["python3", "-m", "sglang.launch_server", "--model-path", "tuner.sim-like"], False),
    (["sglang", "serve", "--model-path", "m"], False),
    (["docker", "run", "img", "python3", "-m", "sglang.launch_server"], False),
])
def test_one_rule_says_whether_a_command_runs_the_simulator(argv: list[str], sim: bool) -> None:
    from tuner.sglang.flags import runs_simulator

    assert runs_simulator(argv) is sim


def test_the_auto_gpu_monitor_reads_the_simulator_of_a_tuner_sim_serve_command(tmp_path: Path) -> None:
    """``tuner sim serve`` is the simulator too: ``gpu_monitor = "auto"`` chose NVML for it (a
    substring test on ``tuner.sim``), which fails on a machine without a GPU."""
    from tests.support.configs import config_copy
    from tuner.config import load_config
    from tuner.entrypoints import resolve_gpu_monitor
    from tuner.gpu import SimBackend

    config = config_copy("demo-sim.toml", tmp_path, replace={
        '"{python}", "-m", "tuner.sim"': '"tuner", "sim", "serve"', 'gpu_monitor = "sim"': 'gpu_monitor = "auto"'})
    monitor = resolve_gpu_monitor(load_config(config))
    assert monitor is not None and isinstance(monitor.backend, SimBackend)
