"""The HTTP client against a real HTTP server on 127.0.0.1 serving SGLang-shaped answers per version."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.net import free_port as _free_port
from tests.support.sglang_http import serve as _serve
from tuner.errors import ServerError
from tuner.sglang.client import ServerNotReady, SGLangClient
from tuner.sglang.failures import Failure, FailureClass

INFO_055 = {
    "version": "0.5.5.post3", "mem_fraction_static": 0.88, "chunked_prefill_size": 8192, "max_prefill_tokens": 16384,
    "cuda_graph_max_bs": 256, "max_running_requests": None, "page_size": 1, "tensor_parallel_size": 8,
    "context_length": None, "max_total_num_tokens": 159277, "max_req_input_len": 159270, "status": "ready",
    "internal_states": [{"memory_usage": {"weight": 72.33, "kvcache": 10.42, "token_capacity": 159277, "graph": 1.5}}],
}
INFO_0523 = {
    "version": "0.5.23", "mem_fraction_static": 0.9, "cuda_graph_max_bs_decode": 128, "max_running_requests": 64,
    "tp_size": 1, "page_size": 64, "max_req_input_len": 32762,
    "internal_states": [{"effective_max_running_requests_per_dp": 64, "memory_usage": {
        "weight": 15.0, "kvcache": 40.0, "startup_available": 6.95, "token_capacity": 327680,
        "graph": {"decode": 0.15, "prefill": 0.35}}}],
}
METRICS = """# HELP sglang:num_running_reqs running
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0
sglang:num_running_reqs{model_name="m",tp_rank="1"} 2.0
# HELP sglang:prompt_tokens_total prompt tokens
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 1000.0
# HELP sglang:time_to_first_token_seconds ttft
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 4.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 5.0
sglang:time_to_first_token_seconds_count{model_name="m"} 5.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 1.5
"""


@pytest.fixture
def old_server() -> Iterator[str]:
    yield from _serve({"/health": (200, ""), "/get_server_info": (200, json.dumps(INFO_055)),
                       "/get_model_info": (200, json.dumps({"model_path": "/m"})), "/flush_cache": (400, "Cache not flushed")})


@pytest.fixture
def new_server() -> Iterator[str]:
    yield from _serve({"/health": (200, ""), "/server_info": (200, json.dumps(INFO_0523)),
                       "/model_info": (200, json.dumps({"model_path": "/n"})), "/metrics": (200, METRICS),
                       "/flush_cache": (200, "Cache flushed.")})


def test_server_info_055(old_server: str) -> None:
    with SGLangClient(old_server) as c:
        info = c.wait_ready(10, poll_s=0.05)
        assert (info.version, info.max_total_num_tokens, info.tp_size, info.cuda_graph_max_bs) == ("0.5.5.post3", 159277, 8, 256)
        assert (info.weight_gib, info.kvcache_gib, info.graph_gib) == (72.33, 10.42, 1.5)
        assert info.effective_max_running_requests is None and info.max_running_requests is None
        assert c.model_info()["model_path"] == "/m"
        assert c.flush_cache() is False
        with pytest.raises(ServerError, match="--enable-metrics"):
            c.metrics()


def test_server_info_0523_falls_back_and_sums_graph(new_server: str) -> None:
    with SGLangClient(new_server) as c:
        info = c.server_info()
        assert info.max_total_num_tokens == 327680  # from memory_usage.token_capacity
        assert info.graph_gib == 0.5 and info.startup_available_gib == 6.95
        assert (info.effective_max_running_requests, info.cuda_graph_max_bs, info.page_size) == (64, 128, 64)
        assert c.model_info()["model_path"] == "/n"
        assert c.flush_cache() is True
        m = c.metrics()
        assert m["sglang:num_running_reqs"] == 5.0
        assert m["sglang:prompt_tokens_total"] == 1000.0
        assert m['sglang:time_to_first_token_seconds_bucket{le="0.5"}'] == 4.0
        assert m["sglang:time_to_first_token_seconds_count"] == 5.0


def test_unreachable_is_one_server_error() -> None:
    c = SGLangClient(f"http://127.0.0.1:{_free_port()}", timeout_s=2)
    assert c.health() is False
    with pytest.raises(ServerError, match=r"cannot reach the SGLang server at http://127\.0\.0\.1:\d+"):
        c.server_info()
    with pytest.raises(ServerError, match="not an http"):
        SGLangClient("localhost:30000")


def test_wait_ready_fails_fast_and_times_out() -> None:
    c = SGLangClient(f"http://127.0.0.1:{_free_port()}", timeout_s=1)
    failure = Failure(failure_class=FailureClass.STARTUP_KV_OOM, evidence="Not enough memory.")
    with pytest.raises(ServerNotReady) as err:
        c.wait_ready(600, failure_check=lambda: failure, poll_s=0.05)
    assert err.value.failure == failure
    with pytest.raises(ServerNotReady) as err:
        c.wait_ready(0.3, poll_s=0.05)
    assert err.value.failure is not None and err.value.failure.failure_class is FailureClass.STARTUP_TIMEOUT


@pytest.mark.parametrize("version", ["0.5.5", "0.5.23"])
def test_the_info_endpoints_read_without_a_deprecation_warning(version: str, tmp_path) -> None:  # noqa: ANN001
    """SGLang 0.5.23 logs a warning on every call of ``/get_model_info`` and ``/get_server_info``
    (deprecated for ``/model_info`` and ``/server_info``); the client asked the old paths first, so
    a study's server log filled with them. Against the simulator as a real server: 0.5.23 is asked
    the new paths (no warning), 0.5.5 (old paths only) still answers, one 404 the first time."""
    from tests.support.sim import start_healthy

    sim = start_healthy(["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--mem-fraction-static", "0.8",
                         "--sim-version", version], tmp_path)
    try:
        with SGLangClient(sim.url) as c:
            for _ in range(3):
                assert c.server_info().max_total_num_tokens > 0 and c.model_info()["model_path"] == "llama-3.1-8b"
        log = sim.log()
    finally:
        sim.stop()
    assert "is deprecated" not in log, log[-2000:]
    old_paths = ("GET /get_server_info", "GET /get_model_info")
    asked_old = sum(log.count(p) for p in old_paths)
    assert asked_old == (6 if version == "0.5.5" else 0), log[-2000:]


def test_the_simulator_warns_as_sglang_0523_on_a_deprecated_info_path(tmp_path) -> None:  # noqa: ANN001
    import requests

    from tests.support.sim import start_healthy

    sim = start_healthy(["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--mem-fraction-static", "0.8",
                         "--sim-version", "0.5.23"], tmp_path)
    try:
        assert requests.get(f"{sim.url}/get_model_info", timeout=10).json()["model_path"] == "llama-3.1-8b"
        log = sim.log()
    finally:
        sim.stop()
    assert "Endpoint '/get_model_info' is deprecated and will be removed in a future version. Please use '/model_info' instead." in log
