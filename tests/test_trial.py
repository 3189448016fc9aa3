"""One trial: :class:`tuner.trial.TrialExecutor`'s phases on the simulator's offline server (real
parts: the product's executor, the simulator's sizing and engine), and the study's environment
tag (the GPU size comes from the device's own reading, never its name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.offline_server import OfflineExecutor, OfflineServer
from tests.support.sim import spawn, wait_ready
from tuner.config import TunerConfig, load_config, parse_config
from tuner.entrypoints import resolve_environment as detect_environment
from tuner.gpu import GPUMonitor
from tuner.records import TrialRecord
from tuner.sglang.failures import FailureClass
from tuner.sglang.flags import FlagTable
from tuner.study.job import TrialJob
from tuner.trial import TrialExecutor

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo-sim.toml"
"""Llama-3.1-8B on a simulated L4, 2k contexts, ``--enable-metrics``: 21,032 KV tokens at its 0.80."""


def _run(job: TrialJob, config: TunerConfig | None = None) -> tuple[TrialRecord, list[str], OfflineExecutor]:
    """``job`` through the executor on the offline server: the record and the phases it began."""
    executor = OfflineExecutor(config or load_config(DEMO))
    began: list[str] = []

    def on_phase(name: str, detail: Any = None) -> None:
        if detail is None:
            began.append(name)

    return executor.run(job, on_phase), began, executor


def _job(params: dict[str, Any] | None = None, **kwargs: Any) -> TrialJob:
    return TrialJob(number=1, kind="sampled" if params else "baseline", params=params or {}, context_tokens=2048,
                    **kwargs)


def test_a_started_trial_runs_every_phase_and_records_what_the_server_resolved() -> None:
    record, began, _ = _run(_job())
    assert began == ["render", "start", "probe", "measure", "stress", "quality", "record"]  # the study's reference answers
    assert record.outcome == "ok" and record.feasible
    assert record.quality.status == "reference" and record.quality.answers and record.constraints["quality"] < 0
    # the baseline's knobs are what SGLang resolved for its command (the scheduler line), not assumed
    assert record.params == {"mem_fraction_static": 0.8, "max_running_requests": 2048, "chunked_prefill_size": 2048}
    assert record.resolved["max_total_num_tokens"] == {"value": 21032, "source": "log:scheduler"}
    assert record.token_capacity == 21032 and record.context_capacity == 21032 // 2048
    assert [p.name for p in record.phases] == ["measure", "stress"]
    assert record.constraints["oom_or_crash"] < 0 and record.constraints["stress"] < 0 and record.constraints["slo"] <= 0
    assert record.output_throughput_tok_s and record.measured_load.streams >= 1
    assert record.memory.capacity_model and (record.memory.peak_activation_gib or 0) > 0
    assert record.cache.hit_rate_source == "/metrics"  # 0.5.5 has no per-request tiers; the demo exports /metrics
    assert record.duration_s == 1.0 and record.artifacts == {}  # virtual time; no work dir, no files


def test_with_a_work_dir_a_trial_keeps_the_server_log_its_info_and_the_requests(tmp_path: Path) -> None:
    config = load_config(DEMO)
    server = OfflineServer(config)
    executor = TrialExecutor(config, server, server.table, work_dir=tmp_path, workload=server.workload,
                             clock=server.now_s)
    record = executor.run(_job(), lambda *_: None)
    assert sorted(record.artifacts) == ["requests", "server_info", "server_log"]
    assert Path(record.artifacts["server_log"]).read_text(encoding="utf-8").splitlines() == server.logs()
    assert all(Path(path).parent == tmp_path / "trial-1" for path in record.artifacts.values())


def test_a_startup_oom_is_a_failed_record_with_every_constraint_violated() -> None:
    record, began, _ = _run(_job({"mem_fraction_static": 0.97}))
    assert began == ["render", "start"]
    assert record.outcome == "failed" and record.failure_class is FailureClass.CUDA_GRAPH_OOM
    assert record.constraints == {"oom_or_crash": 1.0, "slo": 1.0, "stress": 1.0, "quality": 1.0, "context_fits": 1.0} and not record.feasible
    assert record.token_capacity is None and record.phases == []
    assert record.memory.ranks  # the startup's memory lines, for the memory model's bound
    evidence = record.failure_evidence or ""
    assert evidence.startswith("torch.OutOfMemoryError") and any(evidence[:200] in line for line in record.log_excerpt)


def test_a_runtime_oom_under_the_stress_load_makes_the_config_infeasible() -> None:
    record, began, _ = _run(_job({"mem_fraction_static": 0.95, "max_running_requests": 4,
                                  "chunked_prefill_size": 8192}))
    assert began == ["render", "start", "probe", "measure", "stress", "record"]
    assert record.outcome == "failed" and record.failure_class is FailureClass.RUNTIME_OOM
    assert record.constraints["oom_or_crash"] == 1.0 and record.constraints["stress"] == 1.0
    assert record.constraints["slo"] <= 0  # the measured window itself held its SLO
    stress = record.phases[-1]
    assert stress.name == "stress" and stress.stopped_early  # the server died mid-run
    assert record.context_capacity and record.memory.capacity_model  # its start still calibrates the model


def test_below_the_capacity_floor_a_trial_stops_after_the_probe() -> None:
    record, began, _ = _run(_job(capacity_floor=100))
    assert began == ["render", "start", "probe"]
    assert record.outcome == "ok" and not record.feasible and record.phases == []
    assert record.skipped_reason is not None and record.skipped_reason.startswith("probe only: context capacity 10")
    assert record.memory.probe_only and record.constraints["oom_or_crash"] < 0


def test_flags_sglang_would_reject_are_a_failed_record_without_a_restart() -> None:
    record, began, executor = _run(_job({"enable_hierarchical_cache": True, "hicache_ratio": 0.5}))
    assert began == ["render"]
    assert record.failure_class is FailureClass.INVALID_ARGUMENTS and "hicache_ratio=0.5" in (record.failure_evidence or "")
    assert executor.offline.now_s() == 0.0  # nothing was started


def test_a_start_killed_while_pinning_host_pools_is_a_host_memory_failure() -> None:
    twin = load_config(ROOT / "configs" / "reference-multiturn-sim.toml")
    command = [*(twin.service.command or []), "--sim-memory-max", "100"]  # 3 of 8 ranks' 33.6 GB pools fit
    config = twin.model_copy(update={"service": twin.service.model_copy(update={"command": command})})
    record, began, _ = _run(TrialJob(number=1, kind="sampled", context_tokens=14848, params={
        "mem_fraction_static": 0.88, "enable_hierarchical_cache": True, "hicache_ratio": 3.0}), config)
    assert began == ["render", "start"]
    assert record.failure_class is FailureClass.HOST_MEMORY
    assert "killed while pinning the hierarchical cache's host pools" in (record.failure_evidence or "")


def test_a_window_without_a_completed_request_names_the_measure_window_to_raise() -> None:
    demo = load_config(DEMO)
    config = demo.model_copy(update={
        "budget": demo.budget.model_copy(update={"warmup_s": 0, "measure_s": 1}),
        "workload": type(demo).model_validate({**demo.model_dump(), "workload": {
            "kind": "random", "input_len": 1024, "output_len": 1000}}).workload})
    record, _, _ = _run(_job(), config)
    assert record.outcome == "failed" and record.failure_class is None
    assert (record.failure_evidence or "").startswith("measure window held no completed request")
    assert "raise [budget] measure_s to ≥ 2" in (record.failure_evidence or "")
    assert "slo" not in record.constraints and record.output_throughput_tok_s is None  # unknown, not violated


def test_sim_gpu_size_is_read_from_the_ledger(tmp_path: Path) -> None:
    args = ["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--mem-fraction-static", "0.9"]
    sim = spawn(args, tmp_path)
    try:
        wait_ready(sim)
        config = parse_config({
            "study": {"name": "env"},
            "service": {"launcher": "process", "command": ["python", "-m", "tuner.sim", *args], "url": sim.url},
            "workload": {"kind": "random", "input_len": 512, "output_len": 64},
        })
        argv = ["python", "-m", "tuner.sim", *args]
        env = detect_environment(config, argv, FlagTable.for_version("0.5.5"), GPUMonitor.for_target("sim", sim.url))
    finally:
        sim.stop()
    assert env["gpu_name"] == "L4-24GB"
    assert env["gpu_total_mib"] == 23034  # nvidia-smi's L4 size, not 24 × 1024
    assert env["driver_version"] == "simulated"


def test_identity_does_not_depend_on_whether_the_unit_runs(tmp_path: Path) -> None:
    """A systemd unit running the simulator, read while it serves and after it stopped (a resume
    after a kill at daemon-reload): the same environment identity, so the resume is not refused."""
    from tuner.study.optuna_io import check_environment

    args = ["--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--mem-fraction-static", "0.9"]
    sim = spawn(args, tmp_path)
    argv = ["python", "-m", "tuner.sim", *args]
    config = parse_config({
        "study": {"name": "env"},
        "service": {"launcher": "systemd", "unit": "sglang-sim.service", "url": sim.url, "gpu_monitor": "sim"},
        "workload": {"kind": "random", "input_len": 512, "output_len": 64},
    })
    table = FlagTable.for_version("0.5.5")
    monitor = GPUMonitor.for_target("sim", sim.url)
    try:
        wait_ready(sim)
        running = detect_environment(config, argv, table, monitor)
    finally:
        sim.stop()
    stopped = detect_environment(config, argv, table, monitor)
    keys = ("sglang_version", "gpu_name", "gpu_count", "driver_version", "model")
    assert {k: running.get(k) for k in keys} == {k: stopped.get(k) for k in keys}
    assert stopped["gpu_name"] == "L4-24GB"
    check_environment(running, stopped, allow_mixed=False)  # raises StudyError when they differ
