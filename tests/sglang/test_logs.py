"""The log parser: all four §4 formats, journald/ANSI/rank prefixes, interleaving, truncation, partial logs,
incremental watching and failure classification."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.errors import LogError
from tuner.sglang.failures import FailureClass
from tuner.sglang.logs import LogWatcher, classify, clean_line, parse_log, read_log

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "logs" / "reference-0.5.5-tp8.log"

LOG_0510 = """\
[2026-01-10 10:00:01 TP1] Init torch distributed ends. elapsed=3.21 s, mem usage=0.98 GB
[2026-01-10 10:00:01 TP0] Init torch distributed ends. elapsed=3.20 s, mem usage=0.97 GB
[2026-01-10 10:00:02 TP0] Load weight begin. avail mem=78.50 GB
[2026-01-10 10:00:02 TP1] Load weight begin. avail mem=78.40 GB
[2026-01-10 10:00:42 TP0] Load weight end. elapsed=40.12 s, type=LlamaForCausalLM, quant=fp8, fmt=e4m3, avail mem=70.90 GB, mem usage=7.60 GB.
[2026-01-10 10:00:42 TP1] Load weight end. elapsed=40.10 s, type=LlamaForCausalLM, quant=fp8, fmt=e4m3, avail mem=70.80 GB, mem usage=7.60 GB.
[2026-01-10 10:00:43 TP0] KV Cache is allocated. #tokens: 1000000, K size: 30.52 GB, V size: 30.52 GB
[2026-01-10 10:00:43 TP0] Memory pool end. avail mem=8.80 GB
[2026-01-10 10:00:43 TP0] Capture cuda graph begin. This can take up to several minutes. avail mem=8.80 GB
[2026-01-10 10:00:55 TP0] Capture cuda graph end. Time elapsed: 12.00 s. mem usage=0.60 GB. avail mem=8.20 GB.
[2026-01-10 10:01:15 TP0] Capture piecewise CUDA graph end. Time elapsed: 20.00 s. mem usage=0.40 GB. avail mem=7.80 GB.
[2026-01-10 10:01:16 TP0] max_total_num_tokens=1000000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=4096, context_len=131072, available_gpu_mem=7.80 GB
[2026-01-10 10:01:20] The server is fired up and ready to roll!
[2026-01-10 10:05:00 TP0] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 512, #new_token_ratio: 0.4000 -> 0.6000
"""

LOG_0516 = """\
[2026-05-01 08:00:01] Init torch distributed ends. elapsed=1.10 s, mem usage=0.51 GB
[2026-05-01 08:00:01] Load weight begin. avail mem=139.20 GB
[2026-05-01 08:01:01] Load weight end. elapsed=60.00 s, type=Qwen3ForCausalLM, avail mem=78.10 GB, mem usage=61.10 GB.
[2026-05-01 08:01:02] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 250000, K size: 30.52 GB, V size: 30.52 GB
[2026-05-01 08:01:02] Memory pool end. avail mem=16.90 GB
[2026-05-01 08:01:20] Capture decode full end. elapsed=18.00 s, mem usage=1.20 GB, avail mem=15.70 GB.
[2026-05-01 08:01:21] max_total_num_tokens=250000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=2048, context_len=40960, available_gpu_mem=15.70 GB
[2026-05-01 08:01:30] The server is fired up and ready to roll!
"""

LOG_0523 = """\
[2026-11-01 12:00:00] Init parallel ends. elapsed=2.00 s
[2026-11-01 12:00:00] Memory baseline taken. mem usage=0.55 GB
[2026-11-01 12:00:00] Load weight begin. avail mem=94.80 GB
[2026-11-01 12:00:30] Load weight end. elapsed=30.00 s, type=LlamaForCausalLM, avail mem=79.80 GB, mem usage=15.00 GB.
[2026-11-01 12:00:31] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 600000, K size: 36.62 GB, V size: 36.62 GB
[2026-11-01 12:00:31] Memory pool end. avail mem=6.40 GB
[2026-11-01 12:00:31] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, bs=[1, 2, 4, 8, 16, 32, 64, 128], avail mem=6.40 GB
[2026-11-01 12:00:33] Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16, 32, 64, 128], elapsed=1.90 s, mem usage=0.25 GB, avail mem=6.15 GB.
[2026-11-01 12:00:35] Capture target prefill CUDA graph end. elapsed=2.10 s, mem usage=0.30 GB, avail mem=5.85 GB.
[2026-11-01 12:00:35] Allocating hierarchical KV host pool: 1200000 tokens, 157.29 GB host memory.
[2026-11-01 12:00:35] max_running_requests was reduced from the requested 500000 to 300000 (per dp worker) due to the available KV cache capacity.
[2026-11-01 12:00:36] max_total_num_tokens=600000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=300000, context_len=131072, available_gpu_mem=5.85 GB
[2026-11-01 12:00:40] The server is fired up and ready to roll!
[2026-11-01 12:01:00] Prefill batch, #new-seq: 3, #new-token: 6000, #cached-token: 2000, #pending-token: 0, token usage: 0.01, #running-req: 0, #queue-req: 0, cuda graph: False, input throughput (token/s): 12000.50
[2026-11-01 12:01:02] Decode batch, #running-req: 200, #token: 420000, token usage: 0.70, cuda graph: False, gen throughput (token/s): 5000.00, #queue-req: 0
"""


def test_format_055_reference_tp8() -> None:
    r = read_log(REFERENCE)
    assert r.version_format == "0.5.5" and r.ready and r.failure is None
    assert sorted(r.ranks) == [f"TP{i}" for i in range(8)]
    tp0 = r.ranks["TP0"]
    assert (tp0.baseline_gib, tp0.load_begin_avail_gib, tp0.weight_gib, tp0.weight_end_avail_gib) == (1.05, 94.03, 72.33, 21.70)
    assert (tp0.kv_tokens, tp0.kv_size_gib, tp0.k_size_gib, tp0.memory_pool_end_avail_gib, tp0.graph_gib) == (159277, 10.42, None, 10.03, 1.10)
    assert tp0.model_class == "DeepseekV3ForCausalLM" and tp0.weight_dtype == "torch.bfloat16"
    assert tp0.draft is not None and (tp0.draft.weight_gib, tp0.draft.kv_size_gib, tp0.draft.graph_gib, tp0.draft.graph_end_avail_gib) == (0.78, 0.17, 0.55, 7.43)
    # The draft ModelRunner's own "Init torch distributed" lines are not a new start (§4.1).
    assert tp0.draft.baseline_gib == 0.0 and not any("more than one server start" in w for w in r.warnings)
    assert r.scheduler.max_total_num_tokens == 159277 and r.scheduler.available_gpu_mem_gib == 7.43
    assert r.kv_cache_dtype == "torch.bfloat16"
    assert r.primary().rank == "TP0"
    assert len(r.retractions) == 1 and r.retractions[0].new_token_ratio_after == 0.5
    assert r.batch_summary.decode_lines == 2 and r.batches[-1].accept_len == 2.55 and r.batches[-1].cuda_graph is True
    assert r.server_args["mem_fraction_static"] == "0.88"


def test_format_0510() -> None:
    r = parse_log(LOG_0510)
    assert r.version_format == "0.5.10" and r.ready
    tp0 = r.ranks["TP0"]
    assert (tp0.baseline_gib, tp0.weight_gib, tp0.weight_dtype, tp0.kv_pool_gib) == (0.97, 7.60, "fp8", pytest.approx(61.04))
    assert tp0.graph_gib == pytest.approx(1.0) and tp0.graph_end_avail_gib == 7.80 and tp0.graph_capture_s == 32.0
    assert r.ranks["TP1"].load_begin_avail_gib == 78.40 and r.ranks["TP1"].kv_tokens is None
    assert r.retractions[0].new_tokens_gained == 512


def test_format_0516() -> None:
    r = parse_log(LOG_0516)
    assert r.version_format == "0.5.16"
    one = r.ranks[""]
    assert one.rank is None and (one.kv_dtype, one.kv_tokens, one.graph_gib, one.graph_end_avail_gib) == ("torch.bfloat16", 250000, 1.20, 15.70)


def test_format_0523() -> None:
    r = parse_log(LOG_0523)
    assert r.version_format == "0.5.23" and r.ready
    one = r.ranks[""]
    assert one.baseline_gib == 0.55 and one.graph_gib == pytest.approx(0.55) and one.graph_end_avail_gib == 5.85
    assert one.cuda_graph_max_bs == 128 and one.graph_begin_avail_gib == 6.40
    assert (r.host_pool_tokens, r.host_pool_gb) == (1200000, 157.29)
    assert (r.max_running_requests_requested, r.max_running_requests_reduced_to) == (500000, 300000)
    assert r.batches[0].input_throughput_tok_s == 12000.5 and r.batches[1].running_req == 200
    assert r.batch_summary.decode_lines_without_cuda_graph == 1 and r.batch_summary.max_running_req_without_cuda_graph == 200


def _journald(lines: list[str], iso: bool) -> list[str]:
    head = "2026-11-29T10:00:00+0000 gpu-host python3[4242]: " if iso else "Nov 29 10:00:00 gpu-host python3[4242]: "
    return [head + ln for ln in lines]


@pytest.mark.parametrize("iso", [False, True])
def test_journald_ansi_and_noise_do_not_change_the_report(iso: bool) -> None:
    lines = REFERENCE.read_text().splitlines()
    plain = parse_log(lines)
    noisy: list[str] = []
    for i, ln in enumerate(lines):
        noisy.append(f"\x1b[32m{ln[:40]}\x1b[0m{ln[40:]}" if i % 3 == 0 else ln)
        if i % 10 == 0:
            noisy.append("some unrelated line with avail mem=1.00 GB? no: " + "x" * 20)
            noisy.append("[2026-11-20 09:00:00 TP0] Load weight e")  # truncated line
    noisy = _journald(noisy, iso) + ["Nov 29 10:30:00 gpu-host systemd[1]: sglang.service: Main process exited, code=killed, status=9/KILL"]
    r = parse_log(noisy)
    assert r.ranks == plain.ranks and r.scheduler == plain.scheduler and r.ready
    assert r.exit_status == 137


def test_clean_line_prefixes() -> None:
    assert clean_line("[2025-03-07 09:25:11 DP0 TP0] Memory pool end. avail mem=1.00 GB")[:2] == ("Memory pool end. avail mem=1.00 GB", "DP0 TP0")
    assert clean_line("2025-09-13 09:09:15 TP0] Decode batch. x")[1] == "TP0"
    assert clean_line("[03:51:54] Decode batch, x") == ("Decode batch, x", None, "03:51:54", None)
    assert clean_line("[gpu=0] Prefill batch. x")[0] == "Prefill batch. x"
    assert clean_line("[2025-12-02 07:04:51 DisaggregationMode.IGPUDECODE TP1] Allocating")[1] == "TP1"


def test_partial_log_reports_what_it_has_and_none_for_the_rest() -> None:
    lines = REFERENCE.read_text().splitlines()
    cut = next(i for i, ln in enumerate(lines) if "KV Cache is allocated" in ln)
    r = parse_log(lines[:cut])
    tp0 = r.ranks["TP0"]
    assert tp0.weight_gib == 72.33 and tp0.kv_tokens is None and tp0.graph_gib is None and r.scheduler is None
    assert r.max_total_num_tokens is None and not r.ready and r.failure is None
    assert any("no scheduler line" in w for w in r.warnings)


def test_restart_in_one_journal_reports_the_last_start() -> None:
    text = REFERENCE.read_text().splitlines()
    second = [ln.replace("#tokens: 159277, KV size: 10.42", "#tokens: 100000, KV size: 6.55") for ln in text]
    r = parse_log(text + second)
    assert r.ranks["TP0"].kv_tokens == 100000 and any("more than one server start" in w for w in r.warnings)


def test_watcher_sets_failure_at_once_and_upgrades_to_specific_evidence() -> None:
    w = LogWatcher()
    w.feed("[2026-01-01 00:00:00 TP0] Load weight begin. avail mem=70.00 GB")
    assert w.failure is None
    w.feed("[2026-01-01 00:00:01 TP0] Scheduler hit an exception: Traceback (most recent call last):")
    assert w.failure is not None and w.failure.failure_class is FailureClass.CRASH
    w.feed("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB")
    assert w.failure.failure_class is FailureClass.WEIGHT_LOAD_OOM
    rep = w.report(exit_status=137)
    assert rep.oom.tried_to_allocate_mib == 2048.0 and rep.failure.exit_status == 137


@pytest.mark.parametrize(
    ("lines", "exit_status", "expected"),
    [
        (["RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: mem_fraction_static=0.5"], None, "startup_kv_oom"),
        (["ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.6. Raise"], None, "startup_kv_oom"),
        (["Capture cuda graph begin. avail mem=1.00 GB", "torch.OutOfMemoryError: CUDA out of memory."], None, "cuda_graph_oom"),
        (["The server is fired up and ready to roll!", "Scheduler hit an exception: x", "torch.OutOfMemoryError: CUDA out of memory. Tried"], None, "runtime_oom"),
        (["Decode out of memory. Try to lower your batch size."], None, "kv_page_shortfall"),
        (["RuntimeError: memory allocation failed with OOM"], None, "kv_page_shortfall"),
        (["[2025-01-06 02:58:44 TP0] Decode out of memory happened. #retracted_reqs: 1, #new_token_ratio: 0.0980 -> 0.9446"], None, None),
        (["ValueError: Not enough host memory available. Requesting 160 GB but only have 90 GB free."], None, "host_memory"),
        (["The memory capacity is unbalanced. Some GPUs may be occupied by other processes. min_per_gpu_memory=1"], None, "unbalanced_memory"),
        (["launch_server.py: error: ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode"], 2, "invalid_arguments"),
        (["usage: launch_server.py [-h]"], 2, "invalid_arguments"),
        (["[2026-01-01 00:00:00] Load weight begin. avail mem=70.00 GB"], 1, "crash"),
        (["[2026-01-01 00:00:00] Load weight begin. avail mem=70.00 GB"], 0, None),
        (["[2026-01-01 00:00:00] Load weight begin. avail mem=70.00 GB"], None, None),
    ],
)
def test_classify(lines: list[str], exit_status: int | None, expected: str | None) -> None:
    f = classify(lines, exit_status=exit_status)
    assert (f.failure_class.value if f else None) == expected
    if f is not None and exit_status is not None:
        assert f.exit_status == exit_status


_WEIGHTS_DONE = [
    "[2026-01-01 00:00:00] Load weight begin. avail mem=21.91 GB",
    "[2026-01-01 00:00:01] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=6.95 GB, mem usage=14.96 GB.",
]
_OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.73 GiB. GPU 0 has a total capacity of 22.49 GiB of which 7115.49 MiB is free."
_EXC = "[2026-01-01 00:00:02] Scheduler hit an exception: Traceback (most recent call last):"


def _frame(func: str, file: str = "/usr/lib/python3/dist-packages/sglang/srt/model_executor/model_runner.py") -> str:
    return f'  File "{file}", line 10, in {func}'


@pytest.mark.parametrize(
    ("lines", "expected", "site"),
    [
        # §4.3: an OOM before any scheduler/ready line is a startup-memory failure, by where it was raised.
        ([*_WEIGHTS_DONE, _EXC, _frame("run_scheduler_process"), _frame("init_memory_pool"), _frame("__init__", "/x/memory_pool.py"), _OOM],
         "cuda_graph_oom", "__init__ (memory_pool.py)"),
        ([*_WEIGHTS_DONE, _EXC, _frame("run_scheduler_process"), _OOM], "cuda_graph_oom", None),  # phase: after the weights
        ([*_WEIGHTS_DONE[:1], _EXC, _frame("load_model"), _frame("load_weights", "/x/model_loader/loader.py"), _OOM], "weight_load_oom", "load_weights"),
        ([*_WEIGHTS_DONE, "Capture cuda graph begin. avail mem=1.00 GB", _EXC, _frame("capture"), _OOM], "cuda_graph_oom", "capture"),
        # the warm-up batch after the scheduler line, before the ready line: an activation OOM
        ([*_WEIGHTS_DONE, "max_total_num_tokens=1000, chunked_prefill_size=2048, max_running_requests=10, context_len=8192, available_gpu_mem=1.00 GB",
          _EXC, _frame("event_loop_normal", "/x/scheduler.py"), _frame("run_batch", "/x/scheduler.py"), _frame("forward"), _OOM], "runtime_oom", "run_batch"),
        # a 0.5.5/0.5.10 draft worker loads after the target's KV pool, from the reserve (§1.5)
        ([*_WEIGHTS_DONE, "KV Cache is allocated. #tokens: 1000, K size: 0.10 GB, V size: 0.10 GB", "Capture cuda graph end. Time elapsed: 1.00 s. mem usage=0.10 GB. avail mem=0.50 GB.",
          "Load weight begin. avail mem=0.50 GB", _EXC, _frame("load_model"), _OOM], "cuda_graph_oom", "load_model"),
        ([_OOM], "startup_oom", None),  # nothing of a start and nothing of serving: a startup OOM, phase unknown
    ],
)
def test_generic_oom_is_classified_by_where_it_was_raised(lines: list[str], expected: str, site: str | None) -> None:
    report = parse_log(lines)
    assert report.failure is not None and report.failure.failure_class.value == expected, report.failure
    assert report.failure_site == site
    # The launcher's incremental watcher reaches the same answer line by line.
    w = LogWatcher()
    for line in lines:
        w.feed(line)
    assert w.failure is not None and w.failure.failure_class.value == expected


def test_read_log_rejects_bad_input(tmp_path: Path) -> None:
    (tmp_path / "empty.log").write_text("")
    (tmp_path / "bin.log").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "nginx.log").write_text('127.0.0.1 - - [29/Nov/2026:10:00:00 +0000] "GET / HTTP/1.1" 200 612\n')
    for name, pattern in (("empty.log", "is empty"), ("bin.log", "binary"), ("nginx.log", "no SGLang line"), ("missing.log", "cannot read")):
        with pytest.raises(LogError, match=pattern):
            read_log(tmp_path / name)


def test_server_args_echo_is_no_failure_and_starts_a_new_start() -> None:
    echo = "[2026-01-01 00:00:00] server_args=ServerArgs(model_path='/m', watchdog_timeout=300, crash_dump_folder=None, mem_fraction_static=0.8)"
    text = REFERENCE.read_text().splitlines()
    r = parse_log([echo, *text[1:], echo.replace("0.8)", "0.9)"), *text[1:20]])
    assert r.failure is None and r.server_args["mem_fraction_static"] == "0.9"
    assert r.scheduler is None and r.ranks["TP0"].kv_tokens is None  # the second start had not reached the KV pool


def test_watcher_timeout_failure_names_the_phase() -> None:
    w = LogWatcher()
    w.feed("[2026-01-01 00:00:00] Capture cuda graph begin. This can take up to several minutes. avail mem=9.00 GB")
    f = w.timeout_failure(600)
    assert f.failure_class is FailureClass.STARTUP_TIMEOUT and "phase capture" in f.evidence and "Capture cuda graph begin" in f.evidence


def test_post_capture_sizing_swa_pool_and_numeric_journal_prefixes() -> None:
    r = parse_log([
        "1732874400.123456 gpu-host python3[7]: [2026-11-01 12:00:31] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 600000, KV size: 40.00 GB",
        "[ 1234.567890] gpu-host python3[7]: [2026-11-01 12:00:40] Post-capture KV sizing: KV cache allocated. dtype: torch.bfloat16, #tokens: 650000, KV size: 43.34 GB, avail mem=2.00 GB",
    ])
    one = r.ranks[""]
    assert (one.kv_tokens, one.kv_size_gib, r.version_format) == (650000, 43.34, "0.5.23")
    swa = parse_log(["[2026-01-01 00:00:00 TP0] SWAKVPool mem usage: 30.50 GB, swa size: 400000, full size: 2650000"]).ranks["TP0"]
    assert (swa.swa_pool_gib, swa.swa_tokens, swa.kv_tokens) == (30.5, 400000, 2650000)


def test_every_truncation_of_every_line_parses_without_error() -> None:
    lines = [*REFERENCE.read_text().splitlines(), *LOG_0510.splitlines(), *LOG_0516.splitlines(), *LOG_0523.splitlines()]
    watcher = LogWatcher()
    for line in lines:
        for cut in range(0, len(line), 3):
            watcher.feed(line[:cut])
            watcher.feed(line[cut:])
    report = watcher.report()
    assert report.sglang_lines > 0
    for rank in report.ranks.values():  # a cut number is read as a shorter number or not at all, never as garbage
        assert rank.kv_tokens is None or rank.kv_tokens >= 0


def test_progress_bars_glued_lines_and_mamba_cache() -> None:
    r = parse_log([
        "Loading safetensors checkpoint shards:  93% Completed | 13/14 [00:06<00:00,  1.95it/s]\r"
        "Loading safetensors checkpoint shards: 100% Completed | 14/14 [00:07<00:00,  1.85it/s]",
        "[2025-03-08 12:29:21 TP0] Memory pool end. avail mem=2.09 GB",
        "  0%|          | 0/13 [00:00<?, ?it/s][2025-03-08 12:29:21 TP1] Capture cuda graph begin. This can take up to several minutes. avail mem=1.45 GB",
        "[2025-12-29 18:33:03 TP0] Mamba Cache is allocated. max_mamba_cache_size: 85292, conv_state size: 4.88GB, ssm_state size: 0.00GB ",
    ])
    assert r.ranks["TP1"].graph_begin_avail_gib == 1.45 and "" not in r.ranks
    assert r.ranks["TP0"].mamba_cache_gib == 4.88


def test_0523_speculative_draft_and_target_lines() -> None:
    r = parse_log([
        "[2026-11-01 12:00:00 TP0] Memory baseline taken. mem usage=0.60 GB",
        "[2026-11-01 12:00:00 TP0] Load weight begin. avail mem=94.00 GB",
        "[2026-11-01 12:00:30 TP0] Load weight end. elapsed=30.00 s, type=DeepseekV3ForCausalLM, avail mem=21.00 GB, mem usage=73.00 GB.",
        "[2026-11-01 12:00:31 TP0] Load weight begin. avail mem=21.00 GB",
        "[2026-11-01 12:00:33 TP0] Load weight end. elapsed=2.00 s, type=DeepseekV3ForCausalLMNextN, avail mem=19.80 GB, mem usage=1.20 GB.",
        "[2026-11-01 12:00:34 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 120000, KV size: 7.98 GB",
        "[2026-11-01 12:00:34 TP0] Memory pool end. avail mem=10.50 GB",
        "[2026-11-01 12:00:40 TP0] Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=5.00 s, mem usage=0.40 GB, avail mem=10.10 GB.",
        "[2026-11-01 12:00:44 TP0] Capture target verify CUDA graph end. bs=[1, 2, 4, 8, 16], elapsed=4.00 s, mem usage=0.30 GB, avail mem=9.80 GB.",
        "[2026-11-01 12:00:48 TP0] Capture draft decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=4.00 s, mem usage=0.20 GB, avail mem=9.60 GB.",
        "[2026-11-01 12:00:49 TP0] max_total_num_tokens=120000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=48, context_len=163840, available_gpu_mem=9.60 GB",
    ])
    tp0 = r.ranks["TP0"]
    assert (tp0.weight_gib, tp0.kv_tokens, tp0.graph_gib, tp0.graph_bs) == (73.0, 120000, pytest.approx(0.7), [1, 2, 4, 8])
    assert tp0.draft is not None and (tp0.draft.weight_gib, tp0.draft.graph_gib, tp0.draft.kv_tokens) == (1.2, 0.2, None)
    assert r.version_format == "0.5.23" and r.failure is None


def test_0_5_23_lines_real_sglang_prints() -> None:
    """What the real 0.5.23 package prints (issue point 11): the settings echo as a dict, the
    overlap weight load's commit line, compressed-tensors, ATTN_CP/MOE_DP rank-prefix tokens."""
    r = parse_log(["[2026-01-01 00:00:00] server_args={'mem_fraction_static': 0.85, 'model_path': '/m', 'cuda_graph_bs': [1, 2]}"])
    assert r.server_args == {"mem_fraction_static": "0.85", "model_path": "/m", "cuda_graph_bs": "[1, 2]"}
    r = parse_log([
        "[2026-01-01 00:00:00 DP0 ATTN_CP1 MOE_DP0 TP3 EP3] Load weight end. elapsed=2.00 s, type=Qwen3ForCausalLM, "
        "quant=compressed-tensors, avail mem=60.00 GB, mem usage=10.00 GB.",
        "[2026-01-01 00:00:01 TP0] Load weight end. Committed real weights after CUDA graph capture in 3.21 s "
        "(capture overlap window 2.00 s, startup overlap total 9.10 s)",
    ])
    assert "DP0 ATTN_CP1 MOE_DP0 TP3 EP3" in r.ranks and r.ranks["DP0 ATTN_CP1 MOE_DP0 TP3 EP3"].weight_dtype == "compressed-tensors"
    assert r.weights_committed_after_capture and r.ranks.get("TP0") is None  # no memory numbers on the commit line
    assert r.logged["TP0"][0].values["startup overlap total"].value == 9.1


@pytest.mark.parametrize("kv_tokens", ["3307840", "26462720 (3307840 per rank * dcp_size 8)"])
def test_dcp_logical_count_is_read_per_rank(kv_tokens: str) -> None:
    """sglang#32730 prints a DCP server's logical capacity with the per-rank math; the report keeps
    ``max_total_num_tokens`` per rank (what the ladder and the trial multiply by dcp) and says both."""
    log = "\n".join([
        f"[2026-08-01 10:00:00 TP0] KV Cache is allocated. dtype: torch.float8_e4m3fn, #tokens: {kv_tokens}, KV size: 32.15 GB",
        "[2026-08-01 10:00:00 TP0] Memory pool end. avail mem=20.02 GB",
        "[2026-08-01 10:00:05 TP0] max_total_num_tokens=26462720 (3307840 per rank * dcp_size 8), chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=64, context_len=1048576, available_gpu_mem=9.12 GB",
    ])
    r = parse_log(log)
    assert r.ranks["TP0"].kv_tokens == 3307840 and r.ranks["TP0"].kv_size_gib == 32.15
    assert r.scheduler is not None
    assert (r.scheduler.max_total_num_tokens, r.scheduler.logical_tokens, r.scheduler.dcp_size) == (3307840, 26462720, 8)
    assert (r.scheduler.max_running_requests, r.scheduler.available_gpu_mem_gib) == (64, 9.12)
    assert r.max_total_num_tokens == 3307840


def test_per_rank_scheduler_line_has_no_logical_count() -> None:
    r = parse_log("[2026-08-01 10:00:05 TP0] max_total_num_tokens=3307840, chunked_prefill_size=8192, available_gpu_mem=9.12 GB")
    assert r.scheduler is not None and (r.scheduler.max_total_num_tokens, r.scheduler.logical_tokens, r.scheduler.dcp_size) == (3307840, None, None)


@pytest.mark.parametrize("server_args", [True, False])
def test_a_plain_logical_count_of_a_dcp_server_is_read_per_rank(server_args: bool) -> None:
    """From 0.5.21 a DCP server's scheduler line prints the logical count with no math (one rank's
    KV-line rows × dcp_size: ``tp_worker.get_worker_info`` → ``logical_max_total_num_tokens``); the
    report keeps one rank's pool, from the logged ``dcp_size`` or, in a cut log, the exact multiple."""
    lines = ['[2026-08-01 09:59:00] server_args={"tp_size": 8, "dcp_size": 8, "model_path": "m"}'] if server_args else []
    r = parse_log("\n".join([
        *lines,
        "[2026-08-01 10:00:00 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 3307840, KV size: 32.15 GB",
        "[2026-08-01 10:00:05 TP0] max_total_num_tokens=26462720, chunked_prefill_size=8192, "
        "max_prefill_tokens=16384, max_running_requests=64, context_len=1048576, available_gpu_mem=9.12 GB",
    ]))
    assert r.scheduler is not None
    assert (r.scheduler.max_total_num_tokens, r.scheduler.logical_tokens, r.scheduler.dcp_size) == (3307840, 26462720, 8)
    assert r.max_total_num_tokens == 3307840


def test_a_scheduler_count_that_is_not_the_logged_dcp_multiple_is_kept() -> None:
    """A server with ``dcp_size`` 1 (or a count that is not rows × dcp_size) reports one rank's pool as it is."""
    r = parse_log("\n".join([
        '[2026-08-01 09:59:00] server_args={"tp_size": 8, "dcp_size": 1}',
        "[2026-08-01 10:00:00 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 3307840, KV size: 32.15 GB",
        "[2026-08-01 10:00:05 TP0] max_total_num_tokens=6615680, chunked_prefill_size=8192, available_gpu_mem=9.12 GB",
    ]))
    assert r.scheduler is not None and (r.scheduler.max_total_num_tokens, r.scheduler.dcp_size) == (6615680, None)
