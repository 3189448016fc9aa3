"""The quality probe (:mod:`tuner.load.quality`) against the simulator as a real process on
127.0.0.1: SGLang's native ``/generate`` with ``return_logprob``, greedy, compared with the
baseline's answers; and its bad inputs (a server without logprobs, a malformed JSONL, thresholds
out of range), each one line naming the fix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.support.sglang_http import serve
from tests.support.sim import SimProcess, start_healthy
from tuner.config import load_config
from tuner.errors import ConfigError, QualityError
from tuner.load.quality import (
    QualityConfig,
    arithmetic_tasks,
    compare,
    exact_answer,
    judge,
    probe_prompts,
    read_tasks,
    run_probe,
    write_tasks,
)
from tuner.sglang.client import GreedyAnswer, SGLangClient

SIM = ["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", "--mem-fraction-static", "0.85"]
FAULT = ["--sim-numerics-fault", "kv_cache_dtype=fp8_e4m3"]
DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo-sim.toml"


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimProcess]]:
    """The baseline (bf16 KV), a healthy fp8 KV cache, and an fp8 KV cache with a planted fault."""
    folder = tmp_path_factory.mktemp("sims")
    started: dict[str, SimProcess] = {}
    try:
        for name, extra in (("baseline", []), ("fp8", ["--kv-cache-dtype", "fp8_e4m3"]),
                            ("fault", ["--kv-cache-dtype", "fp8_e4m3", *FAULT])):
            started[name] = start_healthy([*SIM, *extra], folder)
        yield started
    finally:
        for sim in started.values():
            sim.stop()


def _probe(url: str, config: QualityConfig, tasks: list | None = None):  # type: ignore[no-untyped-def]
    client = SGLangClient(url)

    def generate(texts: list[str], max_new_tokens: int, timeout_s: float) -> list[GreedyAnswer]:
        return client.greedy_answers(texts, max_new_tokens=max_new_tokens, timeout_s=timeout_s)

    return run_probe(generate, config, tasks or [])


def test_the_native_generate_answers_greedily_with_sglangs_logprob_triples(sims: dict[str, SimProcess]) -> None:
    body = {"text": ["What is 37 + 48? Answer with the number only."], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    got = requests.post(sims["baseline"].url + "/generate", json=body, timeout=30).json()
    triples = got[0]["meta_info"]["output_token_logprobs"]  # [logprob, token_id, text or null] per output token
    assert len(triples) == 6 and all(lp <= 0 and isinstance(t, int) and text is None for lp, t, text in triples)
    assert [t for _, t, _ in triples] == got[0]["output_ids"] and got[0]["text"].split()[0] == "85"
    again = requests.post(sims["baseline"].url + "/generate", json=body, timeout=30).json()
    assert again[0]["meta_info"]["output_token_logprobs"] == triples  # deterministic


def test_a_healthy_fp8_kv_cache_drifts_late_and_passes_a_planted_fault_fails(sims: dict[str, SimProcess]) -> None:
    config = QualityConfig()
    tasks = arithmetic_tasks()
    ref = _probe(sims["baseline"].url, config, tasks)
    reference = [(a.token_ids, a.logprobs) for a in ref.answers]
    assert len(ref.answers) == len(probe_prompts()) == 16 and ref.task_accuracy == 1.0

    fp8 = _probe(sims["fp8"].url, config, tasks)
    drift = compare(reference, fp8.answers)
    # a few answers diverge, late; the logprobs of the shared prefixes move slightly
    assert 0.5 < drift.exact_match_share < 1.0
    assert drift.first_divergence is not None and drift.first_divergence >= 16
    assert drift.mean_abs_logprob_delta is not None and 0 < drift.mean_abs_logprob_delta < 0.02
    assert judge(drift, config, fp8.task_accuracy, ref.task_accuracy) is None and fp8.task_accuracy == 1.0

    broken = _probe(sims["fault"].url, config, tasks)
    fault = compare(reference, broken.answers)
    assert fault.exact_match_share == 0.0 and fault.first_divergence is not None and fault.first_divergence <= 2
    why = judge(fault, config, broken.task_accuracy, ref.task_accuracy)
    assert why is not None and "task_margin" in why  # the task accuracy, the operator's signal, is judged first
    assert "min_exact_match" in (judge(fault, config, None, None) or "")
    assert broken.task_accuracy is not None and broken.task_accuracy < 0.5


def test_a_server_without_logprobs_is_one_line_naming_the_fix() -> None:
    no_meta = '[{"text": " 85", "output_ids": [5], "meta_info": {"id": "a", "completion_tokens": 1}}]'
    for routes, what in (({"/generate": (200, no_meta)}, "returned no output_token_logprobs"),
                         ({}, "has no /generate (404)")):
        with pytest.raises(QualityError) as err:
            gen = serve(routes)
            url = next(gen)
            try:
                SGLangClient(url).greedy_answers(["What is 2 + 3?"], max_new_tokens=4, timeout_s=5)
            finally:
                gen.close()
        line = str(err.value)
        assert what in line and "\n" not in line
        assert "[quality] enabled = false" in line and "native /generate" in line


def test_a_malformed_task_jsonl_is_one_line_naming_the_line(tmp_path: Path) -> None:
    good = tmp_path / "tasks.jsonl"
    write_tasks(arithmetic_tasks(4), good)
    assert [t.answer for t in read_tasks(good)] == [t.answer for t in arithmetic_tasks(4)]
    for text, what in (('{"question": "2+3?", "answer": "5"}\nnot json\n', "line 2: not JSON"),
                       ('{"question": "2+3?"}\n', 'line 1: needs a non-empty string "question"'),
                       ("\n\n", "holds no task")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(QualityError) as err:
            read_tasks(bad)
        assert what in str(err.value) and "\n" not in str(err.value) and "JSON object per line" in str(err.value)
    with pytest.raises(QualityError, match="cannot read it"):
        read_tasks(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(("line", "what"), [
    ("min_exact_match = 1.5", "quality.min_exact_match"),
    ("max_mean_abs_logprob_delta = 0", "quality.max_mean_abs_logprob_delta"),
    ("min_first_divergence = 100", "min_first_divergence (100) must be at most max_new_tokens"),
    ("threshold = 3", "quality.threshold"),
])
def test_quality_thresholds_out_of_range_are_one_config_line(tmp_path: Path, line: str, what: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(DEMO.read_text(encoding="utf-8") + f"\n[quality]\n{line}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert what in str(err.value) and "\n" not in str(err.value)


def test_the_exact_answer_scorer_reads_the_first_word() -> None:
    assert exact_answer(" 85 the of", "85") and exact_answer("85.", "85") and exact_answer("85.0 and", "85")
    assert not exact_answer(" 86 the", "85") and not exact_answer("", "85") and not exact_answer("the 85", "85")


def test_the_comparison_finds_the_first_divergence_and_the_shared_prefix_drift() -> None:
    reference = [([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), ([5, 6], [-1.0, -1.0])]
    candidate = [GreedyAnswer(token_ids=[1, 2, 9, 9], logprobs=[-0.1, -0.25, -2.0, -2.0]),
                 GreedyAnswer(token_ids=[5, 6], logprobs=[-1.0, -1.0])]
    got = compare(reference, candidate)
    assert got.exact_match_share == 0.5 and got.first_divergence == 2
    assert got.mean_abs_logprob_delta == pytest.approx(0.05 / 4)  # over the 2 + 2 shared tokens
