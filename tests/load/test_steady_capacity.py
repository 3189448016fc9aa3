"""SLO-safe capacity under steady traffic (issue 36), on the simulator as a real server process over
HTTP on 127.0.0.1: a burst of N longest prompts breaks the SLO where N sessions of the same
workload, started over a ramp, hold it; and the bad inputs of the steady window, one line each."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import run_tuner
from tests.support.configs import config_copy
from tests.support.sim import SimProcess, start_healthy
from tuner.errors import LoadError
from tuner.load import SLO, RandomSpec, build_workload, capacity_probe, run_load_sync
from tuner.load.search import judge_contexts
from tuner.load.steady import SteadyWindow, session_workload
from tuner.load.workloads import MultiTurnSpec

CONTEXT = 16384
"""The longest context (tokens): Llama-3.1-8B on an H100 prefills it in about half a second."""
N = 8
SLO_LIMITS = SLO(ttft_ms={"p99": 8000}, itl_ms={"p99": 600})
"""A burst of 8 × 16k prompts stalls every decode behind 7 prefills (p99 ITL ≈ 2.2 s on the
simulator); 8 sessions of 256-token answers keep a prefill chunk in under 1 % of the token gaps."""
SIM = ["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", "--mem-fraction-static", "0.85"]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    server = start_healthy(SIM, tmp_path_factory.mktemp("steady-sim"))
    yield server
    server.stop()


def test_a_burst_of_n_longest_prompts_breaks_the_slo_where_n_staggered_sessions_hold_it(sim: SimProcess) -> None:
    burst = run_load_sync(sim.url, capacity_probe(N, CONTEXT, output_len=32, seed=1), concurrency=N,
                          slo=SLO_LIMITS, request_timeout_s=120, timeout_s=180)
    burst_step = judge_contexts(burst.summary, N, SLO_LIMITS)
    assert burst.summary.completed == N and not burst_step.met, burst.summary
    assert (burst_step.violations["p99_itl_ms"] or 0) > 0  # decodes stalled behind the queued prefills

    window = SteadyWindow(duration_s=4.0, ramp_s=2.0, settle_s=0.5).check()
    sessions = session_workload(build_workload(RandomSpec(input_len=1024, output_len=256), seed=2), CONTEXT, 1.0)
    steady = run_load_sync(sim.url, sessions, concurrency=N, warmup_s=window.warmup_s, ramp_s=window.ramp,
                           duration_s=window.duration_s, slo=SLO_LIMITS, request_timeout_s=120, timeout_s=240)
    step = judge_contexts(steady.summary, N, SLO_LIMITS)
    assert step.met, (step, steady.summary)
    assert steady.summary.completed >= N and all(r.input_len == CONTEXT - 256 for r in steady.measured())
    # the ramp staggered the sessions' first sends; the warm-up (ramp included) is not in the window
    first_sends = sorted(r.send_time_s for r in steady.records)[:N]
    assert first_sends[-1] - first_sends[0] >= 0.8 * window.ramp * (N - 1) / N
    assert all(r.send_time_s >= window.warmup_s for r in steady.measured())
    assert step.attainment is not None and step.attainment_low is not None and step.attainment_low <= step.attainment


def test_tuner_run_reports_the_slo_safe_sessions_with_the_burst_beside(tmp_path: Path) -> None:
    """The trial on a real server: the OOM stress bursts N longest prompts (it breaks the SLO),
    then N sessions hold it in a steady window: the SLO-safe capacity is N (capped by
    ``[budget] max_concurrency``, so ≥ N), the burst admission reported beside it."""
    config = config_copy("demo-sim.toml", tmp_path, replace={
        '"--sim-gpu", "L4-24GB"': '"--sim-gpu", "H100-80GB"',
        "input_len = 2016\noutput_len = 32\nrange_ratio = 0.5": "input_len = 1024\noutput_len = 256",
        "ttft_ms = { p99 = 10000 }\nitl_ms = { p99 = 2500 }": "ttft_ms = { p99 = 8000 }\nitl_ms = { p99 = 600 }",
        "context_tokens = 2048": f"context_tokens = {CONTEXT}",
        "warmup_s = 2\nmeasure_s = 10\nstress_s = 6\nmax_concurrency = 32":
            f"warmup_s = 0.5\nmeasure_s = 3\nstress_s = 4\nramp_s = 2\nslo_capacity_steps = 0\nmax_concurrency = {N}",
    })
    db = tmp_path / "cap.db"
    proc = run_tuner("run", "--config", str(config), "--trials", "1", "--storage", f"sqlite:///{db}",
                     cwd=tmp_path, timeout_s=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shown = run_tuner("show", "0", "--storage", f"sqlite:///{db}", cwd=tmp_path)
    assert f"SLO-safe ≥ {N} sessions (steady window: {N} meet the SLO" in shown.stdout, shown.stdout
    assert f"burst admission (the OOM stress): {N} longest contexts at once break the SLO" in shown.stdout
    rows = json.loads(run_tuner("trials", "--storage", f"sqlite:///{db}", "--json", cwd=tmp_path).stdout)
    slo = rows[0]["slo_capacity"]
    assert slo["measure"] == "steady" and slo["contexts"] == N and slo["at_least"]
    assert slo["burst"]["contexts"] == N and slo["burst"]["met"] is False and slo["steps"][0]["met"]


def test_sessions_that_never_reach_the_longest_context_are_refused_in_one_line(tmp_path: Path) -> None:
    short = build_workload(MultiTurnSpec(num_sessions=4, turns=2, first_input_len=1024, turn_input_len=128,
                                         output_len=64), seed=0)
    with pytest.raises(LoadError, match=r"reach 1280 tokens at their last turn, never the longest context of 4096"):
        session_workload(short, 4096, 1.0)
    config = config_copy("reference-multiturn-sim.toml", tmp_path, replace={
        "context_tokens = 14848": "context_tokens = 16384"})
    before = config.read_text()
    proc = run_tuner("run", "--config", str(config), "--dry-run", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    line = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "never the longest context of 16384 tokens" in line[0], proc.stderr
    assert "raise [workload] turns or turn_input_len" in proc.stderr and "context_tokens = 14848" in proc.stderr
    assert config.read_text() == before and not (tmp_path / "studies").exists()  # nothing written
    _refused_before_any_write(config, tmp_path, "never the longest context of 16384 tokens")


def test_a_ramp_longer_than_the_window_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match=r"ramp \(--ramp 20 s\) is longer than the measured window \(--duration 5 s\)"):
        SteadyWindow(duration_s=5, ramp_s=20).check()
    proc = run_tuner("load", "--url", "http://127.0.0.1:9", "--concurrency", "4", "--ramp", "20", "--duration", "5",
                     cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "longer than the measured window (--duration 5 s)" in proc.stderr and "set --ramp to at most 5 s" in proc.stderr
    config = config_copy("reference-sim.toml", tmp_path, replace={"stress_s = 10": "stress_s = 10\nramp_s = 30"})
    proc = run_tuner("run", "--config", str(config), "--dry-run", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "[budget] ramp_s 30 s) is longer than the measured window ([budget] stress_s 10 s)" in proc.stderr
    _refused_before_any_write(config, tmp_path, "is longer than the measured window ([budget] stress_s 10 s)")


def _refused_before_any_write(config: Path, tmp_path: Path, needle: str) -> None:
    """A real ``tuner run`` (no ``--dry-run``) of ``config`` stops at one ``error:`` line naming
    ``needle`` before any server, lock or storage exists: nothing is written."""
    db = tmp_path / "refused.db"
    before = config.read_text()
    proc = run_tuner("run", "--config", str(config), "--storage", f"sqlite:///{db}", "--budget", "5m",
                     cwd=tmp_path, timeout_s=60)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and len(errors) == 1 and needle in errors[0], proc.stderr
    assert not db.exists() and not (tmp_path / "studies").exists() and config.read_text() == before


def test_multi_turn_sessions_grow_their_prefix_a_block_of_sessions_at_a_time() -> None:
    """N streams each carry one conversation turn after turn (its prefix grows and stays cached),
    not every conversation's first turn before any second one."""
    chat = build_workload(MultiTurnSpec(num_sessions=4, turns=3, first_input_len=64, turn_input_len=16,
                                        output_len=8), seed=0)
    sent = list(itertools.islice(session_workload(chat, chat.context_tokens, 1.0, sessions=2).passes(), 12))
    assert [(r.group, r.rid.rsplit("-", 1)[1]) for r in sent] == [
        ("s0", "t0"), ("s1", "t0"), ("s0", "t1"), ("s1", "t1"), ("s0", "t2"), ("s1", "t2"),
        ("s2", "t0"), ("s3", "t0"), ("s2", "t1"), ("s3", "t1"), ("s2", "t2"), ("s3", "t2")]
    assert sent[4].input_ids[:len(sent[2].input_ids)] == sent[2].input_ids  # the history is re-sent


def test_an_slo_no_session_count_meets_is_one_line_naming_the_fix_and_keeps_the_steps(sim: SimProcess,
                                                                                      tmp_path: Path) -> None:
    out = tmp_path / "search.json"
    proc = run_tuner("load", "--url", sim.url, "--max-under-slo", "--slo", "p99_ttft_ms=1", "--ramp", "0.5",
                     "--duration", "1", "--warmup", "0", "--input-len", "512", "--output-len", "8", "--max-value", "2",
                     "--time-budget", "60", "--json", str(out), cwd=tmp_path, timeout_s=180)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "none_pass" in errors[0] and "no session count meets --slo: loosen it" in errors[0]
    found = json.loads(out.read_text())  # nothing lost: the measured steps are written
    assert found["status"] == "none_pass" and found["steps"] and found["steps"][0]["verdict"] == "fail"
