"""Defect classes of real public logs (issue 26): fatal lines that are not memory, the caching
allocator's warning, the phase of an OOM from its traceback, prose, hybrid SWA pools, and levers
made from the log's numbers. Log text is SGLang's own (§4.2-§4.5 of the reference, 0.5.5 and
0.5.10 formats); ``tuner explain`` runs as a subprocess where the CLI is what is tested."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tuner.sglang.explain import explain
from tuner.sglang.failures import FailureClass
from tuner.sglang.logs import parse_log

TUNER = str(Path(sys.executable).with_name("tuner"))

STARTED = """\
[2025-03-01 10:00:00 TP0] Init torch distributed ends. mem usage=0.51 GB
[2025-03-01 10:00:01 TP0] Load weight begin. avail mem=78.50 GB
[2025-03-01 10:00:30 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=63.40 GB, mem usage=15.10 GB.
[2025-03-01 10:00:31 TP0] KV Cache is allocated. #tokens: 400000, K size: 24.41 GB, V size: 24.41 GB
[2025-03-01 10:00:31 TP0] Memory pool end. avail mem=13.90 GB
"""

GRAPHS = """\
[2025-03-01 10:00:31 TP0] Capture cuda graph begin. This can take up to several minutes. avail mem=13.40 GB
[2025-03-01 10:00:45 TP0] Capture cuda graph end. Time elapsed: 14.00 s. mem usage=0.80 GB. avail mem=12.60 GB.
"""


def _tuner(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TUNER, *args], capture_output=True, text=True, timeout=120, check=False, input=stdin)


def test_no_kernel_image_at_capture_is_a_crash_with_no_memory_lever() -> None:
    log = STARTED + GRAPHS.splitlines()[0] + "\n" + (
        "CUDA error (/src/csrc/smxx/get_mla_metadata.cu:93): no kernel image is available for execution on the device\n"
        "[2025-03-01 10:00:32 TP0] Scheduler hit an exception: Traceback (most recent call last):\n")
    report = parse_log(log)
    assert report.failure is not None and report.failure.failure_class is FailureClass.CRASH
    assert "no kernel image" in report.failure.evidence and report.failure.phase == "capture"
    e = explain(report)
    assert e.lever is not None and e.lever.knob is None


def test_triton_shared_memory_limit_is_a_crash_not_an_oom() -> None:
    report = parse_log(STARTED + "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 131072, "
                       "Hardware limit: 65536. Reducing block sizes or `num_stages` may help.\n")
    assert report.failure is not None and report.failure.failure_class is FailureClass.CRASH
    assert report.logged[""][-1].values["Required"].value == 131072


ALLOC_WARNING = ("[W910 23:40:43.144601916 CUDACachingAllocator.cpp:3933] memory allocation failed with OOM on device 0 while "
                 "trying to allocate 7516192768 bytes (free: 1547173888, total: 191495471104).")


def test_caching_allocator_warning_is_not_a_kv_page_shortfall() -> None:
    """torch retried after freeing its cache: a warning about GPU headroom, so the lever lowers the
    fraction (more KV, the page-shortfall lever, would be the wrong way)."""
    report = parse_log(STARTED + GRAPHS + "[2025-03-01 10:00:46 TP0] max_total_num_tokens=400000, chunked_prefill_size=8192, "
                       "max_prefill_tokens=16384, max_running_requests=2048, context_len=131072, available_gpu_mem=12.60 GB\n"
                       "[2025-03-01 10:01:00] The server is fired up and ready to roll!\n" + ALLOC_WARNING + "\n")
    assert report.failure is None and report.kv_shortfall is None
    assert report.allocator_retry is not None and report.allocator_retry.tried_bytes == 7516192768
    e = explain(report)
    trap = next(t for t in e.traps if t.id == "allocator_retry")
    assert trap.lever is not None and (trap.lever.knob, trap.lever.direction) == ("mem_fraction_static", "lower")
    assert ("mem_fraction_static", "raise") not in [(lv.knob, lv.direction) for lv in e.levers[:1]]
    # A hard OOM after it is classified as the OOM it is.
    hard = parse_log(STARTED + GRAPHS + "[2025-03-01 10:00:50 TP0] Decode batch. #running-req: 40, #token: 90000, token usage: 0.22, "
                     "gen throughput (token/s): 900.00, #queue-req: 0\n" + ALLOC_WARNING + "\n"
                     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.00 GiB. GPU 0 has a total capacity of 178.35 GiB\n")
    assert hard.failure is not None and hard.failure.failure_class is FailureClass.RUNTIME_OOM


TRACEBACK = """\
[2025-03-01 10:02:00 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/sglang/python/sglang/srt/managers/scheduler.py", line 2400, in run_scheduler_process
    scheduler.event_loop_overlap()
  File "/sglang/python/sglang/srt/managers/scheduler.py", line 780, in event_loop_overlap
    batch_result = self.run_batch(batch)
  File "/sglang/python/sglang/srt/managers/scheduler.py", line 1720, in run_batch
    logits_output, next_token_ids = self.tp_worker.forward_batch_generation(model_worker_batch)
  File "/sglang/python/sglang/srt/model_executor/model_runner.py", line 1700, in forward
    return self.forward_extend(forward_batch)
  File "/sglang/python/sglang/srt/models/deepseek_v2.py", line 900, in forward
    topk = self.indexer(hidden_states, forward_batch)
  File "/sglang/python/sglang/srt/layers/attention/nsa/nsa_indexer.py", line 300, in forward
    k_fp8 = self._get_k_bf16(forward_batch)
  File "/sglang/python/sglang/srt/mem_cache/memory_pool.py", line 1200, in get_index_k_continuous
    buf = torch.empty(shape, dtype=dtype, device=self.device)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.10 GiB is free.
"""


def test_oom_in_an_indexer_kernel_under_the_scheduler_loop_is_a_runtime_oom() -> None:
    """The innermost frame is in memory_pool.py (a startup site), but the stack runs under
    event_loop_overlap → run_batch: the OOM was raised serving a batch, not at startup."""
    report = parse_log(STARTED + GRAPHS + TRACEBACK)
    assert report.failure is not None and report.failure.failure_class is FailureClass.RUNTIME_OOM
    # The same frames without the scheduler loop (init_memory_pool at startup) stay a startup OOM.
    startup = TRACEBACK.replace("event_loop_overlap", "init_memory_pool").replace("run_batch", "init_memory_pool").replace(
        "forward_batch_generation", "init_memory_pool")
    assert parse_log(STARTED + startup).failure.failure_class is FailureClass.CUDA_GRAPH_OOM  # type: ignore[union-attr]


def test_prose_naming_the_sglang_server_is_refused_with_one_line(tmp_path: Path) -> None:
    prose = tmp_path / "notes.txt"
    prose.write_text("We restarted the sglang server twice yesterday and it came back fine.\n"
                     "Next week we will try the sglang server with more GPUs and a longer context.\n")
    proc = _tuner("explain", "--log", str(prose))
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and "no SGLang line" in proc.stderr
    assert "Traceback" not in proc.stderr
    # A sentence that names the error is not the error; torch's own line, even quoted, is.
    sentence = tmp_path / "issue.md"
    sentence.write_text("When we run the sglang server with long prompts it crashes with CUDA out of memory after a few minutes.\n")
    refused = _tuner("explain", "--log", str(sentence))
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    quoted = parse_log(["> torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"])
    assert quoted.failure is not None and quoted.oom is not None and quoted.oom.total_capacity_gib == 79.19
    # A real launch command still counts (its flags are read).
    report = parse_log(["python3 -m sglang.launch_server --model-path /models/llama --tp 2 --mem-fraction-static 0.85"])
    assert report.server_args["mem_fraction_static"] == "0.85" and report.sglang_lines == 1


def test_server_without_graphs_shows_no_free_after_graphs(tmp_path: Path) -> None:
    log = tmp_path / "nograph.log"
    log.write_text(STARTED + "[2025-03-01 10:00:32 TP0] max_total_num_tokens=400000, chunked_prefill_size=8192, max_prefill_tokens=16384, "
                   "max_running_requests=2048, context_len=131072, available_gpu_mem=13.90 GB\n"
                   "[2025-03-01 10:00:40] The server is fired up and ready to roll!\n")
    text = _tuner("explain", "--log", str(log))
    doc = _tuner("explain", "--log", str(log), "--json")
    assert text.returncode == 0 and doc.returncode == 0, text.stderr + doc.stderr
    assert "after graphs" not in text.stdout.replace("\n", " ") and "after CUDA graphs" not in doc.stdout
    items = [s["item"] for s in json.loads(doc.stdout)["waterfall"]]
    assert "free_after_graphs" not in items and "free_at_start" in items


def test_tight_headroom_after_graphs_is_a_warning_with_a_lower_fraction() -> None:
    report = parse_log(STARTED.replace("avail mem=13.90", "avail mem=1.50") + GRAPHS.replace("13.40", "1.20").replace("12.60", "0.40")
                       + "[2025-03-01 10:00:46 TP0] max_total_num_tokens=400000, chunked_prefill_size=8192, max_prefill_tokens=16384, "
                       "max_running_requests=2048, context_len=131072, available_gpu_mem=0.40 GB\n")
    e = explain(report)
    trap = next(t for t in e.traps if t.id == "tight_headroom")
    assert "0.40 GiB" in trap.title and e.lever is not None and (e.lever.knob, e.lever.direction) == ("mem_fraction_static", "lower")


def test_transformers_fallback_outranks_more_gpus() -> None:
    log = ("[2025-03-01 10:00:00 TP0] Load weight begin. avail mem=78.50 GB\n"
           "[2025-03-01 10:00:00 TP0] Fuyu2ForCausalLM has no SGLang implementation, falling back to Transformers implementation. "
           "Some features may not be supported and performance may not be optimal.\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which 0.90 GiB is free.\n")
    e = explain(parse_log(log))
    assert e.diagnosis is not None and e.diagnosis.failure_class is FailureClass.WEIGHT_LOAD_OOM
    shown = [(lv.knob, lv.direction) for lv in e.levers]
    assert shown[0] == ("model_impl", "set") and ("tp_size", "raise") in shown


def test_few_long_requests_cap_the_output_many_short_ones_admit_fewer() -> None:
    def retracting(running: int, tokens: int) -> list[str]:
        return [f"[2025-01-06 02:58:41 TP0] Decode batch. #running-req: {running}, #token: {tokens}, token usage: 0.99, "
                "gen throughput (token/s): 10.93, #queue-req: 0",
                "[2025-01-06 02:58:44 TP0] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_token_ratio: 0.0980 -> 0.9446"]
    few = explain(parse_log(retracting(3, 300000)))
    many = explain(parse_log(retracting(120, 300000)))
    assert few.lever is not None and (few.lever.knob, few.lever.direction) == ("max_new_tokens", "lower")
    assert ("mem_fraction_static", "raise") in [(lv.knob, lv.direction) for lv in few.levers]
    assert many.lever is not None and (many.lever.knob, many.lever.direction) == ("max_running_requests", "lower")
    assert few.retractions is not None and few.retractions.running_req_before == 3 and few.retractions.num_token_before == 300000


def test_swa_pool_parts_are_one_pool_not_a_draft() -> None:
    log = ("[2025-12-19 07:42:57 TP2] KV Cache is allocated. #tokens: 1496958, K size: 41.76 GB, V size: 27.84 GB\n"
           "[2025-12-19 07:42:57 TP2] KV Cache is allocated. #tokens: 1496958, K size: 4.82 GB, V size: 3.21 GB\n"
           "[2025-12-19 07:42:57 TP2] SWAKVPool mem usage: 77.63 GB, swa size: 1496958, full size: 1496958\n"
           "[2025-12-19 07:42:57 TP2] Memory pool end. avail mem=22.56 GB\n")
    report = parse_log(log)
    rank = report.ranks["TP2"]
    assert rank.draft is None and rank.kv_pool_gib == 77.63
    assert [e.role for e in report.logged["TP2"] if e.line == "kv_cache_allocated"] == ["swa", "full"]
    steps = {s.item: s for s in explain(report).waterfall}
    assert steps["kv_pool"].gib == 77.63 and "draft_kv_pool" not in steps and "swa_pool" not in steps


# 0.4.x (tp_worker_overlap_thread.py, forward_thread_func): the overlap scheduler's worker thread logs
# its own exception; that thread only runs batches, so a CUDA OOM under it is a runtime OOM.
LOG_04X_WORKER = """\
[2025-01-28 17:50:01 TP0] Load weight begin. avail mem=78.50 GB
[2025-01-28 17:50:30 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=63.40 GB, mem usage=15.10 GB.
[2025-01-28 17:50:31 TP0] Memory pool end. avail mem=13.90 GB
[2025-01-28 17:50:31 TP0] Capture cuda graph begin. This can take up to several minutes.
[2025-01-28 17:50:45 TP0] Capture cuda graph end. Time elapsed: 14.00 s
[2025-01-28 17:58:17 TP0] TpModelWorkerClient hit an exception: Traceback (most recent call last):
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.20 GiB is free.
"""


def test_04x_worker_thread_exception_before_a_cuda_oom_is_a_runtime_oom() -> None:
    report = parse_log(LOG_04X_WORKER)
    assert report.failure is not None and report.failure.failure_class is FailureClass.RUNTIME_OOM
    assert any(e.line == "oom" for e in report.logged[""]) and report.oom is not None and report.oom.tried_to_allocate_mib == 3.5 * 1024
    e = explain(report)
    assert e.lever is not None and (e.lever.knob, e.lever.direction) == ("chunked_prefill_size", "lower")
    # The worker's exception alone (the OOM line cut off) is still a failure, not a clean log.
    cut = parse_log(LOG_04X_WORKER.splitlines()[:-1])
    assert cut.failure is not None and cut.failure.failure_class is FailureClass.CRASH
    assert cut.failure.evidence.startswith("TpModelWorkerClient hit an exception")


def test_fatal_cuda_errors_that_are_not_memory_are_crashes() -> None:
    """An illegal memory access is not an OOM: a crash with no memory lever; a CUDA OOM in the same
    log is the more specific evidence."""
    line = "RuntimeError: CUDA error: an illegal memory access was encountered"
    report = parse_log(STARTED + GRAPHS + "[2025-03-01 10:01:00] The server is fired up and ready to roll!\n" + line + "\n")
    assert report.failure is not None and report.failure.failure_class is FailureClass.CRASH and report.failure.evidence == line
    assert explain(report).lever.knob is None  # type: ignore[union-attr]
    both = parse_log(STARTED + GRAPHS + line + "\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    assert both.failure is not None and both.failure.failure_class is not FailureClass.CRASH


def test_a_vllm_fallback_line_is_not_sglang_output() -> None:
    vllm = parse_log(["WARNING 03-13 03:20:24 [utils.py:217] Gemma3ForConditionalGeneration has no vLLM implementation, "
                      "falling back to Transformers implementation."])
    assert vllm.sglang_lines == 0 and vllm.transformers_fallback is None


def test_weight_and_host_levers_carry_the_log_s_numbers() -> None:
    host = explain(parse_log(["ValueError: Not enough host memory available. Requesting 160 GB but only have 90 GB free. "
                              "Please reduce the size of the hierarchical cache."]))
    assert host.lever is not None and (host.lever.knob, host.lever.direction) == ("hicache_size", "lower") and "90 GB" in host.lever.why
    weights = explain(parse_log(["[2025-03-01 10:00:01 TP0] Load weight begin. avail mem=23.50 GB",
                                 "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 23.65 GiB"]))
    assert weights.lever is not None and weights.lever.knob == "tp_size" and "23.50 GiB free" in weights.lever.why
