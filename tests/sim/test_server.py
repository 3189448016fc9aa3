"""The simulator's HTTP API (§5) against a real server process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import io
import json
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import replace

import aiohttp
import psutil
import pytest
import requests
from aiohttp import web

from tests.support.net import free_port
from tests.support.sim import SimProcess, spawn, wait_ready
from tuner.sim.costmodel import activation_bytes
from tuner.sim.engine import Engine
from tuner.sim.server import SimServer
from tuner.sim.startup import SimLogger, engine_spec, plan_from_argv

TIMEOUT_S = 30


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    proc = spawn(["--model-path", "llama-3.1-8b", "--enable-metrics", "--enable-cache-report",
                  "--served-model-name", "sim-llama", "--mem-fraction-static", "0.85"],
                 tmp_path_factory.mktemp("server"))
    try:
        wait_ready(proc)
        yield proc
    finally:
        proc.stop()


def sse(resp: requests.Response) -> list[dict | str]:
    """The ``data:`` payloads of an SSE response, JSON-decoded except ``[DONE]``."""
    out: list[dict | str] = []
    for line in resp.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_info_and_models(sim: SimProcess) -> None:
    assert requests.get(f"{sim.url}/health", timeout=TIMEOUT_S).status_code == 200
    assert requests.get(f"{sim.url}/health_generate", timeout=TIMEOUT_S).status_code == 200
    info = requests.get(f"{sim.url}/get_server_info", timeout=TIMEOUT_S).json()
    tokens = int(re.search(r"KV Cache is allocated\. #tokens: (\d+)", sim.log()).group(1))
    assert info["max_total_num_tokens"] == tokens
    assert info["version"] == "0.5.5.post3"
    assert info["mem_fraction_static"] == 0.85 and info["chunked_prefill_size"] == 8192
    assert info["cuda_graph_max_bs"] == 256 and info["max_running_requests"] is None
    mem = info["internal_states"][0]["memory_usage"]
    assert set(mem) == {"weight", "kvcache", "token_capacity", "graph"}
    assert mem["token_capacity"] == tokens and mem["weight"] == pytest.approx(14.96, abs=0.01)
    assert isinstance(mem["graph"], float)
    assert requests.get(f"{sim.url}/server_info", timeout=TIMEOUT_S).status_code == 404  # added in 0.5.10
    model = requests.get(f"{sim.url}/get_model_info", timeout=TIMEOUT_S).json()
    assert model["model_path"] == "llama-3.1-8b" and model["is_generation"] is True
    models = requests.get(f"{sim.url}/v1/models", timeout=TIMEOUT_S).json()
    assert models["data"][0]["id"] == "sim-llama"


def test_generate_streams_cumulative_text_and_meta_info(sim: SimProcess) -> None:
    body = {"text": "one two three four five", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
            "stream": True}
    with requests.post(f"{sim.url}/generate", json=body, stream=True, timeout=TIMEOUT_S) as resp:
        assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        chunks = sse(resp)
    assert chunks[-1] == "[DONE]"
    data = [c for c in chunks if isinstance(c, dict)]
    assert [c["meta_info"]["completion_tokens"] for c in data] == [1, 2, 3, 4, 5, 6]
    assert all(len(c["output_ids"]) == 1 for c in data)  # only the new ids
    assert data[-1]["text"].startswith(data[-2]["text"])  # 0.5.5: cumulative text
    last = data[-1]["meta_info"]
    assert last["prompt_tokens"] == 5 and last["finish_reason"] == {"type": "length", "length": 6}
    assert last["e2e_latency"] > 0 and "cached_tokens" in last
    assert all(c["meta_info"]["finish_reason"] is None for c in data[:-1])


def test_generate_non_streaming_ids_and_prefix_cache(sim: SimProcess) -> None:
    ids = list(range(100, 164))
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    first = requests.post(f"{sim.url}/generate", json=body, timeout=TIMEOUT_S).json()
    assert len(first["output_ids"]) == 4 and first["meta_info"]["prompt_tokens"] == 64
    second = requests.post(f"{sim.url}/generate", json=body, timeout=TIMEOUT_S).json()
    assert second["meta_info"]["cached_tokens"] >= 63 > first["meta_info"]["cached_tokens"]
    stop = requests.post(f"{sim.url}/generate", json={"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 50}},
                         timeout=TIMEOUT_S).json()
    assert stop["meta_info"]["completion_tokens"] <= 50
    batch = requests.post(f"{sim.url}/generate", json={"text": ["a b", "c d e"], "sampling_params":
                                                       {"max_new_tokens": 2, "ignore_eos": True}}, timeout=TIMEOUT_S)
    assert [b["meta_info"]["prompt_tokens"] for b in batch.json()] == [2, 3]
    bad = requests.post(f"{sim.url}/generate", json={"input_ids": [], "sampling_params": {}}, timeout=TIMEOUT_S)
    assert bad.status_code == 400 and "empty" in bad.json()["message"]
    for path in ("/generate", "/v1/completions"):
        broken = requests.post(f"{sim.url}{path}", data="{", timeout=TIMEOUT_S)
        assert broken.status_code == 400 and "not valid JSON" in broken.json()["message"]
    negative = requests.post(f"{sim.url}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": -3}},
                             timeout=TIMEOUT_S)
    assert negative.status_code == 400 and "at least 0" in negative.json()["message"]
    wordy = requests.post(f"{sim.url}/v1/completions", json={"prompt": "x", "max_tokens": "many"}, timeout=TIMEOUT_S)
    assert wordy.status_code == 400 and "integer" in wordy.json()["message"]


def test_completions_stream_with_usage(sim: SimProcess) -> None:
    body = {"model": "sim-llama", "prompt": list(range(1, 33)), "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with requests.post(f"{sim.url}/v1/completions", json=body, stream=True, timeout=TIMEOUT_S) as resp:
        chunks = sse(resp)
    assert chunks[-1] == "[DONE]"
    data = [c for c in chunks if isinstance(c, dict)]
    text_chunks = [c for c in data if c["choices"]]
    assert len(text_chunks) == 5 and text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] == 5
    assert data[-1]["usage"]["prompt_tokens"] == 32 and data[-1]["usage"]["total_tokens"] == 37
    again = requests.post(f"{sim.url}/v1/completions", json={**body, "stream": False}, timeout=TIMEOUT_S).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 31  # --enable-cache-report
    assert again["choices"][0]["finish_reason"] == "length"
    text = requests.post(f"{sim.url}/v1/completions", json={"prompt": "hello there", "max_tokens": 1},
                         timeout=TIMEOUT_S).json()
    assert text["usage"]["prompt_tokens"] == 2


def test_metrics_names(sim: SimProcess) -> None:
    requests.post(f"{sim.url}/generate", json={"text": "x y", "sampling_params": {"max_new_tokens": 3}},
                  timeout=TIMEOUT_S)
    text = requests.get(f"{sim.url}/metrics", timeout=TIMEOUT_S).text
    for name in ("sglang:num_running_reqs", "sglang:num_used_tokens", "sglang:token_usage", "sglang:gen_throughput",
                 "sglang:num_queue_reqs", "sglang:cache_hit_rate", "sglang:prompt_tokens_total",
                 "sglang:generation_tokens_total", "sglang:cached_tokens_total", "sglang:num_requests_total",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_sum",
                 "sglang:e2e_request_latency_seconds_count"):
        assert re.search(rf"^{re.escape(name)}\{{[^}}]*model_name=\"sim-llama\"", text, re.M), name
    assert "sglang:max_total_num_tokens" not in text  # not a metric in 0.5.5 (§5.5)
    assert re.search(r'sglang:num_running_reqs\{.*tp_rank="0".*\} 0\.0', text)


def test_flush_cache_refused_while_busy(sim: SimProcess) -> None:
    body = {"input_ids": [5] * 16, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}, "stream": True}
    with requests.post(f"{sim.url}/generate", json=body, stream=True, timeout=TIMEOUT_S) as resp:
        lines = resp.iter_lines()  # kept alive: a dropped iterator closes the connection
        next(lines)
        busy = requests.post(f"{sim.url}/flush_cache", timeout=TIMEOUT_S)
        assert busy.status_code == 400 and busy.text.startswith("Cache flushed.")
    deadline = time.monotonic() + TIMEOUT_S
    while requests.get(f"{sim.url}/flush_cache", timeout=TIMEOUT_S).status_code != 200:
        assert time.monotonic() < deadline, "flush never succeeded after the stream was closed"
        time.sleep(0.1)
    assert "Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 1" in sim.log()


def test_device_memory_ledger(sim: SimProcess) -> None:
    gpus = requests.get(f"{sim.url}/sim/device_memory", timeout=TIMEOUT_S).json()
    assert [g["index"] for g in gpus] == [0]
    g = gpus[0]
    assert g["total_mib"] == 81559 and g["used_mib"] + g["free_mib"] == 81559 and g["peak_used_mib"] >= g["used_mib"]
    free = float(re.search(r"available_gpu_mem=([\d.]+) GB", sim.log()).group(1))
    assert g["free_mib"] / 1024 == pytest.approx(free, abs=0.01)


def test_peak_memory_includes_the_largest_step_activations(sim: SimProcess) -> None:
    """``peak_used_mib`` = the ledger + the largest step's activations so far (here a 6,000-token
    prefill, larger than any other step of this module's server)."""
    body = {"input_ids": list(range(1000, 7000)), "sampling_params": {"max_new_tokens": 1}}
    assert requests.post(f"{sim.url}/generate", json=body, timeout=TIMEOUT_S).status_code == 200
    g = requests.get(f"{sim.url}/sim/device_memory", timeout=TIMEOUT_S).json()[0]
    plan = plan_from_argv(["--model-path", "llama-3.1-8b", "--mem-fraction-static", "0.85"])[1]
    expected_mib = (plan.used_bytes(0) + activation_bytes(engine_spec(plan).cost, 6000, 1)) / (1 << 20)
    assert g["peak_used_mib"] == pytest.approx(expected_mib, abs=1) and g["peak_used_mib"] > g["used_mib"] + 100


def test_too_long_input_gets_sglang_error_at_once_and_the_server_stays_idle(tmp_path) -> None:
    """An input longer than the pool allows (§1.4) is refused with SGLang's text on every endpoint,
    promptly, and the process then uses (almost) no CPU: nothing is left spinning on it."""
    proc = spawn(["--model-path", "llama-3.1-8b", "--max-total-tokens", "4096"], tmp_path)
    try:
        wait_ready(proc)
        # max_req_len = min(context_len - 1, 4096 - 1) = 4095; max_req_input_len = 4090
        text = "Input length (5000 tokens) exceeds the maximum allowed length (4090 tokens)."
        ids = list(range(5000))
        start = time.monotonic()
        for path, body in (("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}),
                           ("/generate", {"input_ids": ids, "stream": True}),
                           ("/v1/completions", {"prompt": ids, "max_tokens": 8, "stream": True})):
            resp = requests.post(f"{proc.url}{path}", json=body, timeout=TIMEOUT_S)
            assert resp.status_code == 400 and resp.json()["message"] == text, (path, resp.text)
        assert time.monotonic() - start < TIMEOUT_S
        ps = psutil.Process(proc.proc.pid)
        before = sum(ps.cpu_times()[:2])
        time.sleep(2.0)
        assert sum(ps.cpu_times()[:2]) - before < 0.3  # a spinning driver burns ~1-2 s of CPU here
        ok = requests.post(f"{proc.url}/generate", json={"input_ids": ids[:4000], "sampling_params":
                                                         {"max_new_tokens": 500, "ignore_eos": True}}, timeout=TIMEOUT_S)
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4095 - 4000 - 1
    finally:
        proc.stop()


def test_a_request_the_engine_can_never_admit_is_aborted_with_an_error() -> None:
    """The server's side of the engine's stall rule, over real HTTP in this process: the request is
    answered at once (400, or an abort as the stream's last chunk) and the driver goes idle.

    No command line reaches the rule (SGLang's args refuse a chunk that holds no page), so the
    engine gets such a chunk directly."""
    plan = plan_from_argv(["--model-path", "llama-3.1-8b", "--page-size", "64", "--enable-metrics"])[1]
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> float:
        server = SimServer(plan, SimLogger(io.StringIO(), 1), skip_warmup=True)
        server.engine = Engine(replace(server.engine.spec, chunked_prefill_size=32))
        runner = web.AppRunner(server.app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        driver = asyncio.create_task(server.drive())
        try:
            await server.warmup()
            text = "Input length (100 tokens) exceeds the maximum allowed length (0 tokens)."
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http:
                body = {"input_ids": list(range(100)), "sampling_params": {"max_new_tokens": 8}}
                async with http.post(f"{url}/generate", json=body) as resp:
                    assert resp.status == 400 and (await resp.json())["message"] == text
                async with http.post(f"{url}/v1/completions", json={"prompt": list(range(100))}) as resp:
                    assert resp.status == 400 and (await resp.json())["message"] == text
                async with http.post(f"{url}/generate", json={**body, "stream": True}) as resp:
                    chunks = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
                assert chunks[-1] == "[DONE]"
                reason = json.loads(chunks[-2])["meta_info"]["finish_reason"]
                assert reason == {"type": "abort", "message": text, "status_code": 400, "err_type": "BadRequestError"}
                async with http.get(f"{url}/metrics") as resp:
                    metrics = await resp.text()
            assert re.search(r'^sglang:num_aborted_requests_total\{model_name="llama-3.1-8b"\} 3\.0$', metrics, re.M)
            assert not server.engine.has_work()
            cpu = time.process_time()
            await asyncio.sleep(1.0)
            return time.process_time() - cpu
        finally:
            driver.cancel()
            await runner.cleanup()

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=2 * TIMEOUT_S)) < 0.2


def test_version_differences(tmp_path) -> None:
    proc = spawn(["--model-path", "llama-3.1-8b", "--sim-version", "0.5.23", "--enable-metrics", "--tp", "2",
                  "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/models/eagle"], tmp_path)
    try:
        wait_ready(proc)
        info = requests.get(f"{proc.url}/server_info", timeout=TIMEOUT_S).json()
        state = info["internal_states"][0]
        assert info["version"] == "0.5.23" and "cuda_graph_max_bs_decode" in info
        assert set(state["memory_usage"]["graph"]) == {"decode"}
        mrr = int(re.search(r"max_running_requests=(\d+)", proc.log()).group(1))
        assert state["effective_max_running_requests_per_dp"] == mrr == 48  # speculative decoding (§1.5)
        assert "avg_spec_accept_length" not in state  # SGLang reports it after a logged decode window
        out = requests.post(f"{proc.url}/generate", json={"input_ids": [1, 2, 3], "sampling_params":
                                                          {"max_new_tokens": 20, "ignore_eos": True}},
                            timeout=TIMEOUT_S).json()["meta_info"]
        assert out["completion_tokens"] == 20 and out["num_retractions"] == 0
        assert out["spec_verify_ct"] < 20 and out["spec_accept_length"] == pytest.approx(20 / out["spec_verify_ct"])
        assert out["spec_num_proposed_drafts"] == out["spec_verify_ct"] * 7  # 0.5.23: verify_ct x (draft tokens 8 - 1)
        assert requests.get(f"{proc.url}/ready", timeout=TIMEOUT_S).status_code == 200
        # 0.5.10+ stream all output ids so far (no --incremental-streaming-output); 0.5.23 refuses an
        # unknown sampling_params field with 400 (its /generate contract gate).
        with requests.post(f"{proc.url}/generate", json={"input_ids": [1, 2, 3], "stream": True, "sampling_params":
                                                         {"max_new_tokens": 5, "ignore_eos": True}},
                           stream=True, timeout=TIMEOUT_S) as resp:
            data = [c for c in sse(resp) if isinstance(c, dict)]
        assert [len(c["output_ids"]) for c in data] == [c["meta_info"]["completion_tokens"] for c in data] and len(data[-1]["output_ids"]) == 5
        bad = requests.post(f"{proc.url}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokenz": 5}}, timeout=TIMEOUT_S)
        assert bad.status_code == 400 and "max_new_tokenz" in bad.json()["error"]["message"]
        text = requests.get(f"{proc.url}/metrics", timeout=TIMEOUT_S).text
        assert "_created" not in text  # SGLang's multiprocess collector emits no *_created series
        for family in ("sglang:spec_accept_length", "sglang:spec_accept_rate", "sglang:kv_evictable_tokens", "sglang:startup_time_seconds"):
            assert re.search(rf"^{family}\{{.*\}} [\d.e+-]+$", text, re.M), family
        assert re.search(r"^sglang:max_total_num_tokens\{.*\} \d+", text, re.M)
        assert "sglang:graph_memory_usage_gb" in text
        assert [g["index"] for g in requests.get(f"{proc.url}/sim/device_memory", timeout=TIMEOUT_S).json()] == [0, 1]
        # SIGTERM ends it within a few seconds, as systemctl stop needs.
        start = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=5) == -signal.SIGTERM
        assert time.monotonic() - start < 5
    finally:
        proc.stop()


def test_health_is_503_while_starting(tmp_path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16"}))
    proc = spawn(["--model-path", str(model)], tmp_path, time_scale=2.5)  # a 2.5 s warm-up window
    codes: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and 200 not in codes:
            try:
                codes.append(requests.get(f"{proc.url}/health", timeout=TIMEOUT_S).status_code)
            except requests.ConnectionError:
                assert proc.proc.poll() is None, proc.log()
            time.sleep(0.1)
        assert codes and codes[0] == 503 and codes[-1] == 200
        assert requests.get(f"{proc.url}/metrics", timeout=TIMEOUT_S).status_code == 404  # no --enable-metrics
        assert "Uvicorn running on" in proc.log()
    finally:
        proc.stop()


def test_runtime_oom_kills_the_server_and_cuts_streams(tmp_path) -> None:
    proc = spawn(["--model-path", "llama-3.1-8b", "--mem-fraction-static", "0.975"], tmp_path)
    try:
        wait_ready(proc)
        body = {"input_ids": list(range(10000)), "sampling_params": {"max_new_tokens": 8}, "stream": True}
        with pytest.raises(requests.RequestException):
            with requests.post(f"{proc.url}/generate", json=body, stream=True, timeout=TIMEOUT_S) as resp:
                sse(resp)
        assert proc.proc.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
        log = proc.log()
        assert "torch.OutOfMemoryError: CUDA out of memory." in log
        assert "Scheduler hit an exception:" in log
        assert "SIGQUIT received. signum=None, frame=None. It usually means one child failed." in log
    finally:
        proc.stop()


def test_chat_completions(sim: SimProcess) -> None:
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": "say three words"}], "max_tokens": 3,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(f"{sim.url}/v1/chat/completions", json=body, stream=True, timeout=TIMEOUT_S) as resp:
        chunks = [c for c in sse(resp) if isinstance(c, dict)]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and len(deltas) == 3
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    whole = requests.post(f"{sim.url}/v1/chat/completions", json={**body, "stream": False}, timeout=TIMEOUT_S).json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["choices"][0]["finish_reason"] == "length"
