"""CUDA-graph batch sizes (§2.1): the product's facts agree with the simulator's startup and SGLang's rules."""

from __future__ import annotations

import pytest

from tuner.sglang.graphs import GraphCoverage, captured_bs, default_capture_bs, default_cuda_graph_max_bs
from tuner.sim.startup import plan_from_argv


def test_default_lists_as_sglang_generates_them() -> None:
    assert default_capture_bs(32) == (1, 2, 4, 8, 12, 16, 24, 32)
    assert len(default_capture_bs(512)) == 52 and default_capture_bs(512)[-3:] == (480, 496, 512)
    assert default_capture_bs(48, speculative=True)[-4:] == (32, 40, 44, 48)
    assert default_capture_bs(5, disable_padding=True) == (1, 2, 3, 4, 5)
    assert default_cuda_graph_max_bs(46068) == 32 and default_cuda_graph_max_bs(81559) == 256
    assert default_cuda_graph_max_bs(81559, tp_size=4) == 512
    assert default_cuda_graph_max_bs(24564, version="0.5.23") == 48


def test_the_request_table_adds_its_size_and_cuts_above_it() -> None:
    assert captured_bs(default_capture_bs(256), 31) == (1, 2, 4, 8, 12, 16, 24, 31)
    assert captured_bs(default_capture_bs(256), 160)[-2:] == (152, 160)
    assert captured_bs(default_capture_bs(32), 48) == default_capture_bs(32)


@pytest.mark.parametrize("argv", [
    ["--cuda-graph-max-bs", "32", "--max-running-requests", "31"],
    ["--cuda-graph-max-bs", "32", "--max-running-requests", "100"],
    ["--max-running-requests", "167"],
    ["--max-running-requests", "9", "--sim-version", "0.5.23"],
    ["--cuda-graph-max-bs", "16", "--disable-cuda-graph-padding", "--max-running-requests", "40"],
    ["--cuda-graph-max-bs", "300", "--max-running-requests", "400", "--sim-version", "0.5.10"],
    ["--cuda-graph-max-bs", "300", "--max-running-requests", "400"],
])
def test_prediction_matches_the_simulated_startup(argv: list[str]) -> None:
    plan = plan_from_argv(["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", *argv])[1]
    cfg = plan.config
    explicit = "--cuda-graph-max-bs" in argv
    predicted = GraphCoverage.predict(
        max_bs=cfg.cuda_graph_max_bs if explicit else default_cuda_graph_max_bs(cfg.gpu.memory_mib, 1, cfg.version),
        max_running_requests=cfg.max_running_requests, disable_padding=cfg.disable_cuda_graph_padding,
        version=cfg.version, max_bs_is_default=not explicit)
    assert predicted.captured == plan.capture_bs


def test_coverage_runs_and_the_monotone_rule() -> None:
    wide = GraphCoverage(captured_bs(default_capture_bs(256), 32))
    narrow = GraphCoverage(default_capture_bs(24))
    assert wide.graph_bs(25) == 32 and narrow.graph_bs(25) is None and narrow.eager_above(31) == 25
    # A window broken with batches 25..31 eager says nothing of a server that graphs them.
    assert not narrow.covers_as_well(wide, 31)
    assert wide.covers_as_well(narrow, 31) and wide.covers_as_well(wide, 40)
    assert narrow.covers_as_well(narrow, 31)
    assert narrow.snap_down(31) == 24 and wide.snap_down(31) == 24 and wide.snap_down(32) == 32
    unpadded = GraphCoverage((8, 16), padding=False)
    assert unpadded.graph_bs(9) is None and unpadded.eager_above(16) == 1


def test_newer_versions_append_max_bs() -> None:
    assert default_capture_bs(300)[-1] == 288
    assert default_capture_bs(300, version="0.5.10")[-2:] == (288, 300)
    assert default_capture_bs(31, version="0.5.23")[-2:] == (24, 31)
