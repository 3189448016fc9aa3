"""The simulator's command line: flags by mimicked version, --sim-* options, bad input (§3)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tuner.sim.__main__ import main
from tuner.sim.args import SIMULATED_DESTS, build_parser, flag_table, parse_args
from tuner.sim.errors import SimError


def _bad(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("version", ["0.5.5", "0.5.10", "0.5.23"])
def test_every_flag_of_the_version_is_accepted(version: str) -> None:
    table = flag_table(version)
    parser = build_parser(version)
    known = {s for a in parser._actions for s in a.option_strings}
    for opt in table["options"]:
        assert set(opt["flags"]) - {"-h", "--help"} <= known, opt["flags"]
    # The simulated knobs of issue 2 all exist in every version under some spelling.
    dests = {a.dest for a in parser._actions}
    assert {"mem_fraction_static", "max_running_requests", "chunked_prefill_size", "page_size",
            "enable_hierarchical_cache", "hicache_ratio", "speculative_algorithm"} <= dests


def test_cuda_graph_max_bs_is_ambiguous_in_0_5_23(capsys: pytest.CaptureFixture[str]) -> None:
    err = _bad(["--sim-version", "0.5.23", "--model-path", "llama-3.1-8b", "--cuda-graph-max-bs", "64"], capsys)
    assert "ambiguous option: --cuda-graph-max-bs" in err
    ok = parse_args(["--sim-version", "0.5.23", "--model-path", "llama-3.1-8b", "--cuda-graph-max-bs-decode", "64"])
    assert ok.server["cuda_graph_max_bs_decode"] == 64
    assert parse_args(["--model-path", "llama-3.1-8b", "--cuda-graph-max-bs", "64"]).server["cuda_graph_max_bs"] == 64


def test_flag_the_version_lacks_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    err = _bad(["--model-path", "llama-3.1-8b", "--cuda-graph-max-bs-decode", "64"], capsys)
    assert "unrecognized arguments: --cuda-graph-max-bs-decode" in err
    err = _bad(["--model-path", "llama-3.1-8b", "--enable-hicache"], capsys)
    assert "--enable-hicache" in err
    assert parse_args(["--sim-version", "0.5.23", "--model-path", "m", "--enable-hicache"]).server[
        "enable_hierarchical_cache"]


def test_abbreviations_aliases_and_human_readable_ints() -> None:
    p = parse_args(["--model", "llama-3.1-8b", "--tp", "4", "--sim-version", "0.5.10", "--max-total-tokens", "128k",
                    "--max-prefill-tokens", "8Ki"])
    assert p.server["model_path"] == "llama-3.1-8b"
    assert p.server["tp_size"] == 4
    assert p.server["max_total_tokens"] == 128000
    assert p.server["max_prefill_tokens"] == 8192
    assert {"tp_size", "max_total_tokens"} <= p.given


def test_flags_not_simulated_are_accepted_with_a_warning() -> None:
    p = parse_args(["--model-path", "llama-3.1-8b", "--enable-torch-compile", "--attention-backend", "fa3"])
    assert "enable_torch_compile" not in SIMULATED_DESTS
    assert any("--enable-torch-compile" in w and "not simulated" in w for w in p.warnings)
    assert any("--attention-backend" in w for w in p.warnings)
    assert not any("--model-path" in w for w in p.warnings)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model-path", "llama-3.1-8b", "--mem-fraction-static", "-0.1"], "mem_fraction_static=-0.1"),
        (["--model-path", "llama-3.1-8b", "--page-size", "64", "--chunked-prefill-size", "100"], "divisible"),
        (["--model-path", "llama-3.1-8b", "--enable-hierarchical-cache", "--disable-radix-cache"],
         "mutually exclusive"),
    ],
)
def test_server_args_checks(argv: list[str], needle: str) -> None:
    with pytest.raises(SimError, match=needle):
        parse_args(argv)


def test_bad_input_gives_one_line_and_status_2(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model-path", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-model" in err[0] and "llama-3.1-8b" in err[0]
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 32,
                                                      "num_attention_heads": 32, "vocab_size": 32000}))
    assert main(["--model-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "max_position_embeddings" in err and "\n" not in err
    assert main(["--model-path", "llama-3.1-8b", "--mem-fraction-static", "1.5"]) == 2
    assert "--mem-fraction-static" in capsys.readouterr().err
    assert main(["--model-path", "llama-3.1-8b", "--speculative-algorithm", "STANDALONE",
                 "--speculative-draft-model-path", str(tmp_path / "missing")]) == 2
    assert "--speculative-draft-model-path" in capsys.readouterr().err
    err = _bad(["--model-path", "llama-3.1-8b", "--sim-gpu", "B300"], capsys)
    assert "unknown GPU preset 'B300'" in err and "H100-80GB" in err
    # more foreign memory than the GPU has: no "avail mem=-920.94 GB" startup (review N15)
    assert main(["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", "--sim-foreign-gib", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sim-foreign-gib 1000 is not below the H100-80GB's 79.6 GiB" in err and "\n" not in err


def test_cli_entry_points_pass_arguments_through() -> None:
    for cmd in ([sys.executable, "-m", "tuner.sim"], [sys.executable, "-m", "tuner.cli", "sim", "serve"]):
        out = subprocess.run([*cmd, "--model-path", "llama-3.1-8b", "--no-such-flag"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines()[-1].endswith("unrecognized arguments: --no-such-flag")
        assert "Traceback" not in out.stderr
