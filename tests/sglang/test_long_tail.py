"""Issue 40, the long tail of real logs: one test per class, each on a log written for it from the
message strings SGLang 0.5.5.post3 prints (file and line cited per test; torch's own lines where
torch prints them), so that the next log of the same kind is read right without a case of its own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tuner.sglang.explain import explain, explain_from
from tuner.sglang.failures import FailureClass
from tuner.sglang.ladder import LadderBase, evaluate
from tuner.sglang.logs import outcome_of, parse_log
from tuner.sglang.memory import KVCapacityModel, cell_size_bytes
from tuner.sglang.modelconfig import model_arch_from_dict

UNKNOWN = "unknown"  # tuner.sglang.phases.UNKNOWN, spelled out so this file also runs against the code before issue 40

HERE = Path(__file__).resolve().parent
REFERENCE = HERE.parents[0] / "fixtures" / "logs" / "reference-0.5.5-tp8.log"
KIMI = HERE.parents[1] / "tuner" / "data" / "models" / "kimi-k2.5-int4"

# torch's OOM text (torch/csrc/cuda/... via c10 CUDACachingAllocator, "CUDA out of memory. Tried to allocate").
_TORCH_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU 0 has a total capacity of 79.19 GiB of which "
              "{free} is free. Process 1 has 78.09 GiB memory in use.")


def _shown(e) -> list[tuple[str | None, str]]:
    return [(lv.knob, lv.direction) for lv in e.levers]


# -- 1. a phase only where the log shows it ---------------------------------------------------------

PREFILL_PLAN_OOM = "\n".join([
    "Traceback (most recent call last):",
    '  File "/usr/local/lib/python3.10/dist-packages/sglang/srt/model_executor/model_runner.py", line 2110, in forward_extend',
    "    self.attn_backend.init_forward_metadata(forward_batch)",
    '  File "/usr/local/lib/python3.10/dist-packages/sglang/srt/layers/attention/flashinfer_backend.py", line 411, in init_forward_metadata',
    "    self.indices_updater_prefill.update(",
    '  File "/usr/local/lib/python3.10/dist-packages/sglang/srt/layers/attention/flashinfer_backend.py", line 1283, in call_begin_forward',
    "    wrapper_paged.begin_forward(",
    '  File "/usr/local/lib/python3.10/dist-packages/flashinfer/prefill.py", line 1540, in plan',
    "    self._plan_info = self._cached_module.plan(",
    _TORCH_OOM.format(tried="2.00 GiB", free="1.10 GiB"),
])
"""An OOM inside flashinfer's prefill ``plan`` (0.5.5.post3 ``layers/attention/flashinfer_backend.py``
``init_forward_metadata`` line 411, ``call_begin_forward`` line 1283), no startup or serving line."""


def test_prefill_plan_oom_without_markers_states_no_phase() -> None:
    e = explain(parse_log(PREFILL_PLAN_OOM))
    d = e.diagnosis
    assert d is not None and d.failure_class is FailureClass.RUNTIME_OOM and d.phase == UNKNOWN  # a batch ran; when, unknown
    trap = next(t for t in e.traps if t.id == "failure")
    assert "phase unknown" in trap.title and "init" not in trap.title
    assert "'Load weight begin'" in trap.detail and "'Prefill batch'" in trap.detail  # the line that would settle it
    assert "warm-up request)" not in trap.detail  # not asserted either


BATCHES = "\n".join([
    # 0.5.5.post3 managers/scheduler_metrics_mixin.py log_prefill_stats / log_decode_stats
    "[2025-11-20 10:00:01] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, token usage: 0.05, #running-req: 0, #queue-req: 3, ",
    "[2025-11-20 10:00:02] Decode batch, #running-req: 4, #token: 9000, token usage: 0.06, cuda graph: True, gen throughput (token/s): 310.55, #queue-req: 0, ",
    "[2025-11-20 10:00:03] Decode batch, #running-req: 4, #token: 9160, token usage: 0.06, cuda graph: True, gen throughput (token/s): 312.01, #queue-req: 0, ",
])


def test_crash_after_batch_lines_is_in_the_serving_phase() -> None:
    # 0.5.5.post3 managers/scheduler.py line 2756: logger.error(f"Scheduler hit an exception: {traceback}")
    report = parse_log(BATCHES + "\n[2025-11-20 10:00:04] Scheduler hit an exception: Traceback (most recent call last):\n"
                       "RuntimeError: NCCL error: unhandled system error\n")
    assert report.failure is not None and report.failure.phase == "serving"
    only = parse_log("[2025-11-20 10:00:04] Scheduler hit an exception: Traceback (most recent call last):\n")
    assert only.failure is not None and only.failure.phase == UNKNOWN  # never "init" without a startup line


# -- 2. torch's allocator warning joined to the exception that follows -------------------------------

ALLOCATOR_THEN_EXCEPTION = "\n".join([
    # c10/cuda/CUDACachingAllocator.cpp TORCH_WARN, then 0.5.5.post3 scheduler.py line 2756 and its frames
    "[rank0]:[W1120 10:00:05.000000000 CUDACachingAllocator.cpp:3933] memory allocation failed with OOM on device 0 while trying to "
    "allocate 2147483648 bytes (free: 1610612736, total: 85024112640).",
    "[rank0]:[W1120 10:00:05.000000001 CUDACachingAllocator.cpp:3933] memory allocation failed with OOM on device 0 while trying to "
    "allocate 2147483648 bytes (free: 1610612736, total: 85024112640).",
    "[2025-11-20 10:00:05 TP0] Scheduler hit an exception: Traceback (most recent call last):",
    '  File "/usr/local/lib/python3.10/dist-packages/sglang/srt/managers/scheduler.py", line 2700, in run_scheduler_process',
    "    scheduler = Scheduler(",
    '  File "/usr/local/lib/python3.10/dist-packages/sglang/srt/managers/scheduler.py", line 300, in __init__',
    "    self.init_model_worker()",
])


def test_allocator_oom_warning_is_joined_to_the_scheduler_exception() -> None:
    report = parse_log(ALLOCATOR_THEN_EXCEPTION)
    assert report.failure is not None and outcome_of(report.failure) == "startup_oom"
    assert report.failure.phase == "startup"  # Scheduler.__init__ → init_model_worker: starting, the step not logged
    assert "memory allocation failed with OOM on device 0" in report.failure.evidence
    assert report.oom is not None and report.oom.tried_to_allocate_mib == 2048 and report.oom.free_mib == 1536
    e = explain(report)
    assert _shown(e)[0] == ("mem_fraction_static", "lower")
    # a line that names its own cause wins: no join
    nccl = parse_log(ALLOCATOR_THEN_EXCEPTION + "\nRuntimeError: NCCL error: unhandled system error")
    assert nccl.failure is not None and nccl.failure.failure_class is FailureClass.CRASH


# -- 3. "Capture cuda graph failed" is memory only when what it wraps is -------------------------------

# 0.5.5.post3 model_executor/cuda_graph_runner.py line 396: f"Capture cuda graph failed: {e}\n{CUDA_GRAPH_CAPTURE_FAILED_MSG}"
ADVICE = ("Possible solutions:\n1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
          "2. set --cuda-graph-max-bs to a smaller value (e.g., 16)\n")


@pytest.mark.parametrize(("wrapped", "cls", "knob"), [
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:23456", FailureClass.CRASH, None),
    ("CUDA out of memory. Tried to allocate 448.00 MiB. GPU 7 has a total capacity of 95.00 GiB of which 120.00 MiB is free.",
     FailureClass.CUDA_GRAPH_OOM, "mem_fraction_static"),
    ("CUDA error: no kernel image is available for execution on the device", FailureClass.CRASH, None),
])
def test_capture_failed_is_classed_by_what_it_wraps(wrapped: str, cls: FailureClass, knob: str | None) -> None:
    e = explain(parse_log(f"Exception: Capture cuda graph failed: {wrapped}\n{ADVICE}"))
    assert e.diagnosis is not None and e.diagnosis.failure_class is cls
    assert (e.levers[0].knob if e.levers else None) == knob


def test_capture_failed_cut_before_its_cause_is_unknown_until_torch_says_more() -> None:
    cut = parse_log("Exception: Capture cuda graph failed: \n")
    assert cut.failure is not None and cut.failure.failure_class is FailureClass.CRASH
    trap = next(t for t in explain(cut).traps if t.id == "failure")
    assert "unknown" in (trap.lever.why if trap.lever else "")
    more = parse_log("Exception: Capture cuda graph failed: \n" + _TORCH_OOM.format(tried="448.00 MiB", free="120.00 MiB") + "\n")
    assert more.failure is not None and more.failure.failure_class is FailureClass.CUDA_GRAPH_OOM


# -- 4. low headroom from the capture line, threshold from the deployment's chunk ------------------

GRAPHS_ONLY = "\n".join([
    # 0.5.5.post3 mem_cache/memory_pool.py line 502, model_runner.py lines 1912, 2025, 2039
    "[2025-03-28 04:27:07 TP0] KV Cache is allocated. #tokens: 46045, K size: 2.99 GB, V size: 2.99 GB",
    "[2025-03-28 04:27:07 TP0] Memory pool end. avail mem=0.07 GB",
    "[2025-03-28 04:27:08 TP0] Capture cuda graph begin. This can take up to several minutes. avail mem=0.00 GB",
    "[2025-03-28 04:27:12 TP0] Capture cuda graph end. Time elapsed: 4.00 s. mem usage=0.00 GB. avail mem=0.00 GB.",
])


def test_no_headroom_after_capture_warns_without_a_scheduler_line() -> None:
    e = explain(parse_log(GRAPHS_ONLY))
    trap = next(t for t in e.traps if t.id == "tight_headroom")
    assert "0.00 GiB" in trap.title and "chunk size is not in the log" in trap.detail
    assert _shown(e)[0] == ("mem_fraction_static", "lower")


def _started(chunk: int, free: float) -> str:
    # 0.5.5.post3 managers/scheduler.py line 411
    return (GRAPHS_ONLY.replace("avail mem=0.00 GB.", f"avail mem={free:.2f} GB.") + "\n"
            f"[2025-03-28 04:27:13 TP0] max_total_num_tokens=46045, chunked_prefill_size={chunk}, max_prefill_tokens=16384, "
            f"max_running_requests=2048, context_len=131072, available_gpu_mem={free:.2f} GB\n")


def test_headroom_threshold_follows_the_prefill_chunk() -> None:
    """SGLang reserves max(chunk, 2048) × 1.5 MB for prefill activations (server_args.py lines
    801-806): 5 GB after graphs is short for a 16,384-token chunk (24 GiB), enough for 2,048 (3 GiB)."""
    big = explain(parse_log(_started(16384, 5.0)))
    trap = next(t for t in big.traps if t.id == "tight_headroom")
    assert trap.lever is not None and "24.00 GiB" in trap.lever.why
    small = explain(parse_log(_started(2048, 5.0)))
    assert not any(t.id == "tight_headroom" for t in small.traps)


# -- 5. an OOM the log cannot place ranks the fraction first -----------------------------------------

def test_unplaced_round_allocation_ranks_the_fraction_above_the_context() -> None:
    e = explain(parse_log(_TORCH_OOM.format(tried="4.00 GiB", free="3.10 GiB")))
    shown = _shown(e)
    assert shown[0] == ("mem_fraction_static", "lower") and ("context_length", "lower") in shown
    assert "does not place" in e.levers[0].why
    # a frame that names a context-sized buffer places it: the context comes first
    placed = explain(parse_log("\n".join([
        "Traceback (most recent call last):",
        '  File "/sgl/python/sglang/srt/mem_cache/memory_pool.py", line 120, in __init__',
        '  File "/sgl/python/sglang/srt/mem_cache/memory_pool.py", line 130, in ReqToTokenPool',
        _TORCH_OOM.format(tried="4.00 GiB", free="3.10 GiB")])))
    assert _shown(placed)[0] == ("context_length", "lower")


# -- 6. a structural cause in the command line ---------------------------------------------------------

def _kv_oom(command: str) -> str:
    # 0.5.5.post3 model_executor/model_runner.py line 1666
    return (command + "\n[2025-11-20 10:00:00 TP0] Load weight begin. avail mem=78.50 GB\n"
            "[2025-11-20 10:01:00 TP0] Load weight end. type=DeepseekV3ForCausalLM, dtype=torch.bfloat16, avail mem=9.20 GB, mem usage=69.30 GB.\n"
            "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
            "self.server_args.mem_fraction_static=0.8\n")


def test_dp_attention_is_the_lever_of_a_kv_oom_it_causes() -> None:
    dp = explain(parse_log(_kv_oom("python3 -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 --tp 8 --dp 8 --enable-dp-attention")))
    assert dp.diagnosis is not None and dp.diagnosis.failure_class is FailureClass.STARTUP_KV_OOM
    assert _shown(dp)[0] == ("enable_dp_attention", "set") and ("mem_fraction_static", "raise") in _shown(dp)
    assert "attn_tp = 1" in dp.levers[0].why
    plain = explain(parse_log(_kv_oom("python3 -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V3 --tp 8")))
    assert _shown(plain)[0] == ("mem_fraction_static", "raise")
    off = explain(parse_log(_kv_oom("python3 -m sglang.launch_server --model-path m --tp 8 --dp 1 --enable-dp-attention")))
    assert _shown(off)[0] == ("mem_fraction_static", "raise")  # SGLang turns DP attention off at dp 1


# -- 7. 0.5.5's speculative headroom from the scheduler line -------------------------------------------

def test_speculative_headroom_from_the_scheduler_line(tmp_path: Path) -> None:
    """The reference 0.5.5 EAGLE3 log with ``max_running_requests`` omitted from its arguments: the
    scheduler line's 48 (0.5.5 ``server_args.py`` ``_handle_speculative_decoding``) prices the headroom
    48 × 3 × 1 + 48 × 4 + 100 = 436 rows, and the fp8 rung reads 2 × (159,277 − 436) + 436 = 318,118."""
    text = REFERENCE.read_text().replace("max_running_requests=2048, ", "", 1)
    text = re.sub(r"(max_total_num_tokens=159277.*?max_running_requests=)2048", r"\g<1>48", text)
    assert "max_running_requests=2048" not in text
    log = tmp_path / "spec.log"
    log.write_text(text)
    rungs = explain_from(log=str(log), model_config=str(KIMI)).ladder
    fp8 = next(r for r in rungs if r.lever.get("kv_cache_dtype") == "fp8_e4m3" and set(r.lever) <= {"kv_cache_dtype", "attention_backend"})
    assert fp8.tokens_per_rank == pytest.approx(318118, abs=1) and "436 speculative headroom" in fp8.why


# -- 8. the DCP rung keeps the deployment's flashmla row ---------------------------------------------

def test_dcp_rung_on_dsa_keeps_the_logged_flashmla_row() -> None:
    """A DSA model on Hopper with the flashmla_kv fp8 row (656 B + 132 B indexer per layer): DCP 8 on
    0.5.23 replicates the indexer (×8) and keeps the 656 B latent row (``_dsa_dcp_overrides`` sets
    trtllm only where no backend is set): 8 × 788 / (656 + 8 × 132) = 3.68×, not trtllm's 576 B (3.86×)."""
    model = model_arch_from_dict({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}, name="v32")
    cell = cell_size_bytes(model, tp=8, kv_cache_dtype="fp8_e4m3")
    assert cell == (656 + 132) * 61
    mem = KVCapacityModel(baseline_gib=90.0, static_gib=40.0, cell_bytes=cell, observed_mem_fraction_static=0.85, observed_tokens=300000)
    flags = {"kv_cache_dtype": "fp8_e4m3", "dsa_prefill_backend": "flashmla_kv", "dsa_decode_backend": "flashmla_kv"}
    base = LadderBase(memory=mem, model=model, version="0.5.23", tp=8, mem_fraction_static=0.85, kv_cache_dtype="fp8_e4m3",
                      context_len=163840, gpu="H20", flags=flags)
    now = evaluate(base, {})
    dcp = evaluate(base, {"dcp_size": 8})
    assert dcp.logical_tokens / now.tokens_per_rank == pytest.approx(8 * 788 / (656 + 8 * 132), rel=0.002)


# -- 9. a ladder without 'Load weight begin' -------------------------------------------------------------

@pytest.mark.parametrize("dropped", [("Load weight",), ("Load weight", "Memory pool end")])
def test_ladder_without_weight_lines_is_back_solved_from_the_pool_end(tmp_path: Path, dropped: tuple[str, ...]) -> None:
    """The reference log without its 'Load weight begin/end' lines (and without 'Memory pool end': then
    'Capture cuda graph begin ... avail mem' is the free memory after the pool): the KV line, the
    scheduler line, the fraction and the model's config still give the ladder (the baseline back-solved
    from SGLang's rest = post − pre × (1 − mfs)), within 1 % of the ladder from the whole log."""
    full = explain_from(log=str(REFERENCE), model_config=str(KIMI)).ladder
    cut = tmp_path / "cut.log"
    cut.write_text("\n".join(ln for ln in REFERENCE.read_text().splitlines() if not any(d in ln for d in dropped)) + "\n")
    rungs = explain_from(log=str(cut), model_config=str(KIMI)).ladder
    assert rungs and rungs[0].tokens_per_rank == full[0].tokens_per_rank
    priced = 0
    for got in rungs[1:]:
        want = next(r for r in full if r.lever == got.lever)
        if got.tokens_per_rank is None:  # the draft's own weight line went with the cut: said, not guessed
            assert "draft" in got.why
            continue
        assert got.tokens_per_rank == pytest.approx(want.tokens_per_rank, rel=0.01), got.lever
        priced += 1
    assert priced >= 3  # fp8, DP attention, speculative off
    model = explain_from(log=str(cut), model_config=str(KIMI)).model
    assert model is not None and model["baseline_gib"] == pytest.approx(94.03, rel=0.001)  # 'Load weight begin. avail mem=94.03 GB', not read
