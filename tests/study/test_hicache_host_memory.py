"""Host-memory safety of the hierarchical cache, end to end (real simulator processes, SQLite, CLI).

The simulated host has 40 GiB (``--sim-host-memory-gib``) and the server runs tp 2 with a 60,000-token
device pool: ``--hicache-ratio 4.5`` pins 2 × 17.7 GB, more than SGLang's own check leaves on that
host; ``--hicache-ratio 2`` pins 2 × 7.9 GB. Both are enqueued into a study after its baseline:
the first must be skipped (PRUNED, no restart) with the arithmetic, the second must run and record
its host pool and per-tier hit rates. A workload without reuse keeps the cache out of the space and
says why.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.support.cli import run_tuner as tuner
from tests.support.configs import load_study as load
from tests.support.net import free_port
from tuner.records import TrialRecord
from tuner.sim.startup import plan_from_argv

SIM = ["-m", "tuner.sim", "--model-path", "llama-3.1-8b", "--sim-gpu", "L4-24GB", "--tp", "2",
       "--mem-fraction-static", "0.80", "--max-total-tokens", "60000", "--sim-version", "0.5.10",
       "--sim-host-memory-gib", "40", "--sim-time-scale", "0.01", "--enable-metrics", "--host", "127.0.0.1"]


def _config(tmp_path: Path, name: str, workload: str, space: str = "") -> Path:
    port = free_port()
    command = ["{python}", *SIM, "--port", str(port)]
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f'[study]\nname = "{name}"\nseed = 0\n\n'
        f'[service]\nlauncher = "process"\ncommand = {json.dumps(command)}\nurl = "http://127.0.0.1:{port}"\n'
        f'state_dir = "{tmp_path / "state"}"\nstart_timeout_s = 60\nstop_timeout_s = 30\ngpu_monitor = "sim"\n\n'
        f"[space]\nmem_fraction_step = 0.01\n{space}\n"
        f"[workload]\n{workload}\n"
        '[slo]\nitl_ms = { p99 = 10000 }\n\n[objective]\n'
        # a multi-turn session's longest context (3 turns: 1024 + 2 × (64 + 8) + 8 + ...) is what it reaches
        f'context_tokens = {1176 if "multi_turn" in workload else 2048}\n\n'
        "[budget]\nwarmup_s = 1\nmeasure_s = 4\nstress_s = 0\nmax_concurrency = 8\n"
    )
    return path


MULTI_TURN = 'kind = "multi_turn"\nnum_sessions = 8\nturns = 3\nfirst_input_len = 1024\nturn_input_len = 64\noutput_len = 8\n'


@pytest.mark.slow
def test_a_host_pool_that_does_not_fit_is_never_launched(tmp_path: Path) -> None:
    base = [a for a in SIM if a not in ("-m",)][1:]
    # The simulator agrees: ratio 4.5 fails startup on this host (SGLang's own check), ratio 2 starts.
    assert plan_from_argv([*base, "--enable-hierarchical-cache", "--hicache-ratio", "4.5"])[1].failure.kind == "host_memory"
    assert plan_from_argv([*base, "--enable-hierarchical-cache", "--hicache-ratio", "2"])[1].failure is None

    config = _config(tmp_path, "hostmem", MULTI_TURN, 'hierarchical_cache = true\nhicache_ratio = [2.0, 4.5]\n')
    first = tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=300)
    assert first.returncode == 0, first.stderr[-3000:]
    storage = f"sqlite:///{tmp_path}/studies/hostmem.db"
    study = load(storage, "hostmem")
    baseline = TrialRecord.model_validate(study.trials[0].user_attrs["tuner.record"])
    space = study.user_attrs["tuner.space"]
    assert space["hierarchical_cache"] and "[space] hierarchical_cache = true" in space["hicache_reason"]
    common = {"mem_fraction_static": 0.8, "max_running_requests": baseline.params["max_running_requests"],
              "chunked_prefill_size": baseline.params["chunked_prefill_size"], "enable_hierarchical_cache": True,
              "hicache_write_policy": "write_through", "hicache_io_backend": "kernel",
              "hicache_mem_layout": "layer_first"}
    study.enqueue_trial({**common, "hicache_ratio": 4.5})
    study.enqueue_trial({**common, "hicache_ratio": 2.0})

    # one launch: the skipped 4.5 costs no restart and does not count against --trials
    second = tuner("run", "--config", str(config), "--trials", "1", cwd=tmp_path, timeout_s=300)
    assert second.returncode == 0, second.stderr[-3000:]
    trials = load(storage, "hostmem").trials
    assert len(trials) == 3
    pruned, ran = trials[1], trials[2]
    assert pruned.state == TrialState.PRUNED and ran.state == TrialState.COMPLETE
    skipped = TrialRecord.model_validate(pruned.user_attrs["tuner.record"])
    assert skipped.outcome == "skipped" and not skipped.argv and skipped.duration_s == 0.0
    reason = skipped.skipped_reason or ""
    # host tokens per rank: (60,000 x 4.5 // 1 + 1) x 64 KiB = 17.69 GB, x 2 ranks = 35.39 GB (the
    # tuner's cell comes from the log's rounded KV size, so the last digit may differ)
    assert re.search(r"^host memory: host pool 17\.[67]\d GB per rank × 2 ranks = 35\.[34]\d GB", reason), reason
    assert "--hicache-ratio 4.5 × 60,000 device tokens" in reason, reason
    assert "does not fit the host: MemAvailable 40.0 GiB" in reason and "10.0 GiB SGLang reserve" in reason, reason
    assert "--sim-host-memory-gib 40" in reason
    assert "skipped" in second.stdout and "host memory" in second.stdout
    record = TrialRecord.model_validate(ran.user_attrs["tuner.record"])
    assert record.outcome == "ok" and "--hicache-ratio" in record.argv
    assert record.cache.host_pool_gb_per_rank == pytest.approx(7.86, abs=0.01)
    assert record.cache.host_pool_ranks == 2 and record.cache.host_pool_gb == pytest.approx(15.73, abs=0.02)
    assert record.cache.hit_rate_source == "cached_tokens_details"
    assert (record.cache.device_hit_rate or 0) + (record.cache.host_hit_rate or 0) == pytest.approx(record.cache.hit_rate)
    show = tuner("show", "2", "--config", str(config), cwd=tmp_path, timeout_s=120)
    assert show.returncode == 0, show.stderr[-2000:]
    assert "host tier" in show.stdout and "7.86 GB × 2 ranks = 15.72 GB" in show.stdout, show.stdout
    # The baseline is the same flags without the cache: the comparison is measured, not assumed.
    assert "without → with, trial 0" in show.stdout, show.stdout
    skipped_view = tuner("show", "1", "--config", str(config), cwd=tmp_path, timeout_s=120)
    assert "does not fit the host" in skipped_view.stdout
    report = tuner("report", "--config", str(config), "-o", str(tmp_path / "r.html"), cwd=tmp_path, timeout_s=120)
    assert report.returncode == 0, report.stderr[-2000:]
    page = (tmp_path / "r.html").read_text()
    assert "prefix cache</b>: prefix-cache hits" in page and "15.72 GB pinned" in page


@pytest.mark.slow
def test_no_reuse_keeps_the_cache_out_and_says_why(tmp_path: Path) -> None:
    config = _config(tmp_path, "noreuse", 'kind = "random"\ninput_len = 1000\noutput_len = 8\n')
    dry = tuner("run", "--config", str(config), "--dry-run", cwd=tmp_path, timeout_s=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "hierarchical cache: left out: the workload reuses 0% of its prompt tokens" in dry.stdout, dry.stdout
    assert "enable_hierarchical_cache" not in dry.stdout.split("hierarchical cache:")[0]
    run = tuner("run", "--config", str(config), "--trials", "3", cwd=tmp_path, timeout_s=400)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "hierarchical cache left out: the workload reuses 0% of its prompt tokens" in run.stdout, run.stdout
    study = load(f"sqlite:///{tmp_path}/studies/noreuse.db", "noreuse")
    assert study.user_attrs["tuner.space"]["hierarchical_cache"] is False
    for t in study.trials:
        assert not TrialRecord.model_validate(t.user_attrs["tuner.record"]).params.get("enable_hierarchical_cache")
