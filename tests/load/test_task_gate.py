"""The task probe's statistics over HTTP on the simulator as a real process (issue 38): a
GSM8K-style file (word problems, a chain of thought before the answer) is scored by the numeric
extractor (the last number), not the first word; the gate refuses a candidate whose accuracy falls
past the pre-declared margin (a graded fault on its numerics) and passes a healthy fp8 KV cache;
a task probe whose reference scores too low to carry a signal records no reference, in one line.

Before, the scorer read the first word: the file scored 0 % on the baseline and the gate passed
any candidate with "0 % vs 0 %"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.sim import SimProcess, start_healthy
from tuner.load.quality import (
    QualityConfig,
    TaskItem,
    gate,
    probe_digest,
    read_tasks,
    run_probe,
    score_answer,
    task_drop,
)
from tuner.sglang.client import GreedyAnswer, SGLangClient

SIM = ["--model-path", "llama-3.1-8b", "--sim-gpu", "H100-80GB", "--mem-fraction-static", "0.85"]
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]


def _word_problems(n: int = 60) -> list[dict[str, Any]]:
    """GSM8K-style items whose arithmetic is written out (what the simulated model can solve)."""
    rows = []
    for i in range(n):
        a, b = 12 + (i * 37) % 80, 3 + (i * 11) % 20
        if i % 2:
            q = f"A baker made {a} loaves in the morning and {b} in the afternoon, {a} + {b} in all. How many loaves?"
            rows.append({"question": q, "answer": a + b})
        else:
            q = f"Sam packs {b} boxes of {a} pens each, {b} * {a} pens. How many pens does Sam pack?"
            rows.append({"question": q, "answer": f"{a * b:,}"})
    return rows


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimProcess]]:
    folder = tmp_path_factory.mktemp("task-sims")
    started: dict[str, SimProcess] = {}
    try:
        for name, extra in (("baseline", []), ("fp8", FP8),
                            ("fault", [*FP8, "--sim-numerics-fault", "kv_cache_dtype=fp8_e4m3:0.8@10"])):
            started[name] = start_healthy([*SIM, *extra], folder)
        yield started
    finally:
        for sim in started.values():
            sim.stop()


def _generate(url: str):  # type: ignore[no-untyped-def]
    client = SGLangClient(url)

    def generate(texts: list[str], max_new_tokens: int, timeout_s: float) -> list[GreedyAnswer]:
        return client.greedy_answers(texts, max_new_tokens=max_new_tokens, timeout_s=timeout_s)

    return generate


def _gate(url: str, number: int, config: QualityConfig, tasks: list[TaskItem], reference: dict[str, Any] | None):  # type: ignore[no-untyped-def]
    changes = ["kv_cache_dtype"] if number else []
    return gate(number, {"kv_cache_dtype": "fp8_e4m3"} if number else {}, changes, config, reference=reference,
                probes=[], probe=lambda: run_probe(_generate(url), config, tasks), digest=probe_digest(config, tasks))


def test_a_numeric_extractor_scores_word_problems_and_the_gate_refuses_a_drop_past_the_margin(
        sims: dict[str, SimProcess], tmp_path: Path) -> None:
    path = tmp_path / "gsm8k-style.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _word_problems()), encoding="utf-8")
    tasks = read_tasks(path)
    config = QualityConfig(tasks=str(path))
    assert config.task_margin == 0.02  # declared before the run
    base = _gate(sims["baseline"].url, 0, config, tasks, None)
    assert base.status == "reference" and base.task_accuracy is not None and 0.8 <= base.task_accuracy < 1.0
    reference = {"trial": 0, **(base.answers or {})}
    healthy = _gate(sims["fp8"].url, 1, config, tasks, reference)
    assert healthy.status == "passed", healthy.reason
    assert healthy.task_accuracy == base.task_accuracy and healthy.task_drop_ci == [0.0, 0.0]
    faulty = _gate(sims["fault"].url, 2, config, tasks, reference)
    assert faulty.status == "failed" and "beyond the [quality] task_margin 0.02" in (faulty.reason or ""), faulty.reason
    assert faulty.task_lost and faulty.task_drop_ci and faulty.task_drop_ci[0] > 0  # a real drop, its interval above 0
    # the first-word scorer of old reads 0 %: the probe carries no signal, no reference, one line
    blind = QualityConfig(tasks=str(path), task_scoring="exact")
    none = _gate(sims["baseline"].url, 0, blind, tasks, None)
    assert none.status == "same" and none.task_accuracy == 0.0 and none.answers is None
    assert "carries no signal" in (none.reason or "") and "\n" not in (none.reason or "")


def test_the_extractor_and_the_paired_drop() -> None:
    assert score_answer(" so 3 boxes of 4 is 12. The answer is 1,212.", "1212")
    assert score_answer("#### 72", "72.0") and not score_answer("72 then 73", "72")
    assert score_answer("Paris.", "paris") and not score_answer("Lyon", "Paris")
    assert score_answer(" 85 the of", "85", "exact") and not score_answer("The answer is 85", "85", "exact")
    drop, (low, high), p = task_drop(1, 0, 40)  # one near tie: no evidence of a drop
    assert drop == 0.025 and low < 0 < high and p == 0.5
    drop, (low, _), p = task_drop(8, 1, 40)
    assert drop == 0.175 and low > 0 and p < 0.05


def test_the_simulator_behind_a_logprob_stripping_proxy_is_refused_by_the_client_in_one_line(tmp_path: Path) -> None:
    from tuner.errors import QualityError

    sim = start_healthy([*SIM, "--sim-no-logprobs"], tmp_path)
    try:
        with pytest.raises(QualityError, match="returned no output_token_logprobs") as err:
            SGLangClient(sim.url).greedy_answers(["What is 2 + 3?"], max_new_tokens=4, timeout_s=30)
        assert "native /generate" in str(err.value) and "\n" not in str(err.value)
    finally:
        sim.stop()
