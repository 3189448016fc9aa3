"""The quality gate in a study on the simulator's offline evaluation (the product's trial and loop,
real SQLite files): a planted numerics fault on the fp8 KV candidate is never chosen nor applied, a
healthy fp8 KV cache passes with the default thresholds, speculative settings under greedy
decoding pass, one probe per distinct numerics; ``tuner apply`` refuses a numerics change that was
never probed with one line; the readers show the gate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.offline_server import OfflineExecutor
from tuner.config import TunerConfig, load_config
from tuner.records import TrialRecord
from tuner.study.job import TrialJob, quality_context
from tuner.study.loop import run_study

ROOT = Path(__file__).resolve().parents[2]
DEMO = (ROOT / "configs" / "demo-sim.toml").read_text(encoding="utf-8")
FAULT = '"--enable-metrics", "--sim-numerics-fault", "kv_cache_dtype=fp8_e4m3"]'


def _config(tmp_path: Path, *, fault: bool, quality: str = "") -> TunerConfig:
    """The demo (Llama-3.1-8B on a simulated L4) searching the KV cache's dtype too."""
    text = DEMO.replace("chunked_prefill_size = [1024, 2048, 4096]",
                        'chunked_prefill_size = [1024, 2048, 4096]\nkv_cache_dtype = ["auto", "fp8_e4m3"]')
    if fault:
        text = text.replace('"--enable-metrics"]', FAULT)
    text += f"\n[storage]\nartifacts_dir = {json.dumps(str(tmp_path / 'artifacts'))}\n"  # not the checkout's studies/
    path = tmp_path / "quality.toml"
    path.write_text(text + (f"\n[quality]\n{quality}\n" if quality else ""), encoding="utf-8")
    return load_config(path)


def _study(tmp_path: Path, *, fault: bool, quality: str = "", trials: int = 16) -> tuple[OfflineExecutor, Any, str]:
    config = _config(tmp_path, fault=fault, quality=quality)
    runner = OfflineExecutor(config)
    url = f"sqlite:///{tmp_path / 'quality.db'}"
    summary = run_study(config, runner, max_trials=trials, storage_url=url)
    return runner, summary, url


def _fp8(history: list[tuple[int, TrialRecord]]) -> list[tuple[int, TrialRecord]]:
    return [(n, r) for n, r in history if r.params.get("kv_cache_dtype") == "fp8_e4m3"]


def test_a_planted_fault_on_the_fp8_kv_cache_is_never_chosen_nor_applied(tmp_path: Path, tuner_cli: Any) -> None:
    runner, summary, url = _study(tmp_path, fault=True)
    fp8 = _fp8(runner.history)
    assert fp8, "the study launched no fp8 KV candidate"
    (number, first), *later = fp8
    assert first.quality.status == "failed" and first.quality.exact_match_share == 0.0
    assert first.constraints["quality"] > 0 and not first.feasible
    assert "min_exact_match" in (first.quality.reason or "")
    assert all(r.quality.probed_on_trial == number for _, r in later)  # one probe per distinct numerics
    assert summary.best is not None and summary.best.record.params.get("kv_cache_dtype") != "fp8_e4m3"
    # the readers: the gate's column in `tuner trials`, its figures in `tuner show`
    trials = tuner_cli("trials", "--storage", url)
    assert trials.returncode == 0 and "quality" in trials.stdout and "FAIL 0% @0" in trials.stdout
    show = tuner_cli("show", str(number), "--storage", url)
    assert "quality gate" in show.stdout and "exact-match share" in show.stdout
    row = json.loads(tuner_cli("trials", "--storage", url, "--json").stdout)[number]
    assert row["quality"]["status"] == "failed" and "answers" not in row["quality"]
    # apply: best is not the broken candidate; the broken one is refused as infeasible
    dry = tuner_cli("apply", "best", "--storage", url, "--dry-run")
    assert dry.returncode == 0 and "--kv-cache-dtype auto" in dry.stdout and "--kv-cache-dtype fp8" not in dry.stdout
    refused = tuner_cli("apply", str(number), "--storage", url, "--dry-run")
    assert refused.returncode == 1 and "not feasible (" in refused.stderr, refused.stderr
    assert "quality" in refused.stderr.split("not feasible (", 1)[1].split(")", 1)[0].split(","), refused.stderr


def test_a_healthy_fp8_kv_cache_passes_with_the_default_thresholds(tmp_path: Path, tuner_cli: Any) -> None:
    runner, _summary, url = _study(tmp_path, fault=False)
    fp8 = _fp8(runner.history)
    assert fp8
    probed = {r.quality.probed_on_trial for _, r in fp8}
    assert len(probed) == 1  # one probe per distinct numerics per study
    for _, record in fp8:
        facts = record.quality
        assert facts.status == "passed" and facts.changes == ["kv_cache_dtype"] and record.constraints["quality"] < 0
        assert 0.5 <= (facts.exact_match_share or 0) < 1.0 and (facts.first_divergence or 0) >= 8
    baseline = runner.history[0][1]
    assert baseline.quality.status == "reference" and baseline.quality.answers
    assert tuner_cli("best", "--storage", url).returncode == 0


def test_apply_refuses_a_numerics_change_that_was_never_probed(tmp_path: Path, tuner_cli: Any) -> None:
    runner, _summary, url = _study(tmp_path, fault=True, quality="enabled = false", trials=14)
    fp8 = [(n, r) for n, r in _fp8(runner.history) if r.feasible]
    assert fp8, "no feasible fp8 KV candidate with the gate off"
    number, record = fp8[0]
    assert record.quality.status == "unprobed" and record.constraints["quality"] < 0  # not gated: feasible
    db = (tmp_path / "quality.db").read_bytes()
    for target in (str(number), *(["best"] if _best_is(url, tuner_cli, number) else [])):
        proc = tuner_cli("apply", target, "--storage", url, "--dry-run")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"error: trial {number} changes numerics (kv_cache_dtype)")
        assert "never compared with the baseline's" in line and "tuner run --config" in line
    assert (tmp_path / "quality.db").read_bytes() == db  # nothing written


def _best_is(url: str, tuner_cli: Any, number: int) -> bool:
    proc = tuner_cli("best", "--storage", url, "--json")
    return proc.returncode == 0 and json.loads(proc.stdout).get("number") == number


def test_speculative_settings_under_greedy_decoding_pass_the_gate() -> None:
    config = load_config(ROOT / "configs" / "reference-sim.toml")  # EAGLE-3 on the reference twin
    runner = OfflineExecutor(config)
    baseline = runner.run(TrialJob(number=0, kind="baseline", context_tokens=32768), lambda *_: None)
    assert baseline.quality.status == "reference"
    job = TrialJob(number=1, kind="sampled", context_tokens=32768,
                   params={"speculative_num_steps": 5, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 6},
                   **quality_context([(0, baseline)]))
    record = runner.run(job, lambda *_: None)
    facts = record.quality
    # against the shape SGLang chose for the baseline (3, 1, 4: Kimi is DeepSeek-V3-like), topk 1 is no change
    assert facts.changes == ["speculative_num_draft_tokens", "speculative_num_steps"]
    assert facts.status == "passed" and facts.exact_match_share == 1.0 and facts.first_divergence is None
    assert facts.mean_abs_logprob_delta == 0.0 and record.constraints["quality"] < 0


@pytest.mark.parametrize("bad", ['tasks = "missing.jsonl"'])
def test_a_malformed_task_set_stops_before_any_trial(tmp_path: Path, bad: str) -> None:
    from tuner.errors import QualityError

    config = _config(tmp_path, fault=False, quality=bad)
    with pytest.raises(QualityError, match="cannot read it"):
        OfflineExecutor(config)


def test_a_malformed_evaluation_jsonl_is_one_line_before_the_run_changes_anything(
        tmp_path: Path, tuner_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default studies/ folder would land here
    tasks = tmp_path / "eval.jsonl"
    tasks.write_text('{"question": "What is 2 + 3?", "answer": 5}\n{"question": oops\n', encoding="utf-8")
    config = _config(tmp_path, fault=False, quality=f"tasks = {json.dumps(str(tasks))}")
    for args in (("--dry-run",), ("--trials", "1")):
        proc = tuner_cli("run", "--config", str(config.path), *args)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert "eval.jsonl' line 2: not JSON" in line and "one JSON object per line" in line
    assert not (tmp_path / "studies").exists() and not list(tmp_path.glob("*.db"))  # nothing stored


def test_a_task_probe_without_signal_launches_no_candidate_of_changed_numerics(tmp_path: Path) -> None:
    """A GSM8K-style file scored by the first word reads 0 % on the baseline: the gate records no
    reference and says why, and no fp8 KV candidate is launched (it could only be unprobed)."""
    from tests.load.test_task_gate import _word_problems

    tasks = tmp_path / "gsm8k-style.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in _word_problems(24)), encoding="utf-8")
    config = _config(tmp_path, fault=False, quality=f'tasks = {json.dumps(str(tasks))}\ntask_scoring = "exact"')
    runner = OfflineExecutor(config)
    skips: list[str] = []
    run_study(config, runner, max_trials=10, storage_url=f"sqlite:///{tmp_path / 'quality.db'}",
              on_progress=lambda e: skips.append(e.message or "") if e.event == "skip" else None)
    baseline = runner.history[0][1].quality
    assert baseline.status == "same" and baseline.task_accuracy == 0.0 and "carries no signal" in (baseline.reason or "")
    assert all(not r.quality.changes for _, r in runner.history), [r.params for _, r in runner.history]
    assert any("no reference to compare it with" in s and "task_scoring" in s for s in skips), skips


def test_apply_s_hint_enable_the_gate_and_run_again_leads_to_a_probed_result(tmp_path: Path, tuner_cli: Any) -> None:
    """Issue 38: the study ran with the gate off (no reference recorded); following apply's hint
    (the gate on, the same study run again) launches the baseline's flags first (they record the
    reference) and then the unprobed candidate's config (probed), and that result is appliable."""
    runner, _summary, url = _study(tmp_path, fault=False, quality="enabled = false", trials=14)
    unprobed = [(n, r) for n, r in _fp8(runner.history) if r.feasible]
    assert unprobed and unprobed[0][1].quality.status == "unprobed"
    number = unprobed[0][0]
    hint = tuner_cli("apply", str(number), "--storage", url, "--dry-run")
    assert hint.returncode == 1 and "[quality] enabled = true" in hint.stderr and "reference" in hint.stderr
    config = _config(tmp_path, fault=False)  # the hint followed: the gate on, the same study
    dry = tuner_cli("run", "--config", str(config.path), "--storage", url, "--dry-run")
    assert dry.returncode == 0 and "the baseline's flags (trial 0) run first to record them" in dry.stdout, dry.stderr
    notes: list[str] = []
    again = OfflineExecutor(config)
    run_study(config, again, max_trials=3, storage_url=url,
              on_progress=lambda e: notes.append(e.message or "") if e.event == "note" else None)
    assert any("the baseline's flags (trial 0) run first" in n and f"trial {number}'s config" in n for n in notes), notes
    (_, reference), (probed_number, probed), *_ = again.history
    assert reference.quality.status == "reference" and not reference.quality.changes
    assert probed.params == unprobed[0][1].params and probed.quality.status == "passed", probed.quality
    dry = tuner_cli("apply", str(probed_number), "--storage", url, "--dry-run")
    assert dry.returncode == 0 and "--kv-cache-dtype fp8_e4m3" in dry.stdout, dry.stderr


def test_a_server_without_logprobs_is_one_line_naming_the_fix_and_no_changed_numerics_is_launched(
        tmp_path: Path, tuner_cli: Any) -> None:
    """Issue 38: a server behind a proxy that strips logprobs (``--sim-no-logprobs``): the
    baseline's record names the fix in one line, no fp8 KV candidate is launched (it could only
    be unprobed), each skip says why."""
    config = _config(tmp_path, fault=False)
    path = tmp_path / "nologprobs.toml"
    path.write_text(Path(config.path).read_text(encoding="utf-8").replace('"--enable-metrics"', '"--enable-metrics", "--sim-no-logprobs"'),
                    encoding="utf-8")
    config = load_config(path)
    runner = OfflineExecutor(config)
    skips: list[str] = []
    url = f"sqlite:///{tmp_path / 'nolp.db'}"
    run_study(config, runner, max_trials=8, storage_url=url,
              on_progress=lambda e: skips.append(e.message or "") if e.event == "skip" else None)
    reason = runner.history[0][1].quality.reason or ""
    assert "returned no output_token_logprobs" in reason and "native /generate" in reason and "\n" not in reason
    assert all(not r.quality.changes for _, r in runner.history), [r.params for _, r in runner.history]
    assert any("no reference to compare it with" in s and "native /generate" in s for s in skips), skips
    show = tuner_cli("show", "0", "--storage", url)
    assert "native /generate" in show.stdout
