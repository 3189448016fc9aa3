"""The quality gate's detection rate by fault size, its false alarms, and the probe's cost.

Graded faults (``--sim-numerics-fault kv_cache_dtype=fp8_e4m3:NATS``: a noise of NATS nats per
token on top of the fp8 KV cache's own drift, :mod:`tuner.sim.answers`) are judged by the
product's gate (:func:`tuner.load.quality.gate` with the default ``[quality]`` and a GSM8K-style
task set of word problems scored by the last number, ``task_margin`` 0.02) against the baseline's
reference answers, over ``REPEATS`` prompt and task sets (the shipped 16 prompts each with a
set's own suffix, 60 word problems with the set's own numbers). Reported per fault size: the
share of sets whose candidate fails the gate (detection), and which signal failed it first. False
alarms: a healthy fp8 KV cache (no fault), and a request-slot change alone (the same numerics
under another ``max_running_requests``: the simulated model is batch-invariant, so its answers
are the baseline's by construction; real SGLang is not batch-invariant by default, which this
simulator does not model).

The answers come from the simulator's model in-process (:func:`tuner.sim.answers.answer`, what
its ``/generate`` returns); the probe's cost per distinct numerics is its size in tokens (16
prompts × ``max_new_tokens`` and the task set × ``task_max_new_tokens`` generated, two batch
requests). Run: ``.venv/bin/python -m pytest tests/benchmarks/bench_gate.py --run-benchmarks -s``
(``BENCH_GATE_REPEATS``, default 20; a reduced run: ``BENCH_GATE_REPEATS=5``).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.load.test_task_gate import _word_problems
from tuner.load.quality import QualityConfig, TaskItem, gate, probe_digest, probe_prompts, run_probe
from tuner.sglang.client import GreedyAnswer
from tuner.sim.answers import NumericsFault, answer
from tuner.sim.models import load_model
from tuner.sim.server import _WORDS, tokenize

REPEATS = int(os.environ.get("BENCH_GATE_REPEATS", "20"))
SIZES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
FP8 = {"kv_cache_dtype": "fp8_e4m3"}
VOCAB = load_model("llama-3.1-8b").vocab_size


def _generate(args: Mapping[str, Any], fault: NumericsFault | None, suffix: str):  # type: ignore[no-untyped-def]
    def generate(texts: list[str], max_new_tokens: int, timeout_s: float) -> list[GreedyAnswer]:
        out = []
        for text in texts:
            text = text if "?" in text and "answer" not in text.lower() else text + suffix
            got = answer(text, tokenize(text, VOCAB), max_new_tokens, args, vocab_size=VOCAB, words=_WORDS, fault=fault)
            out.append(GreedyAnswer(token_ids=got.token_ids, logprobs=got.logprobs, text=got.text))
        return out
    return generate


def _tasks(k: int) -> list[TaskItem]:
    rows = _word_problems(60 + k)[k:]
    return [TaskItem(question=r["question"], answer=str(r["answer"])) for r in rows]


def _judge(config: QualityConfig, tasks: list[TaskItem], k: int, args: Mapping[str, Any],
           fault: NumericsFault | None) -> tuple[str, str | None]:
    suffix = f" (set {k})"
    digest = probe_digest(config, tasks)
    base = gate(0, {}, [], config, reference=None, probes=[], digest=digest,
                probe=lambda: run_probe(_generate({}, None, suffix), config, tasks))
    reference = {"trial": 0, **(base.answers or {})}
    changes = ["kv_cache_dtype"] if args else []
    got = gate(1, dict(args), changes, config, reference=reference if changes else None, probes=[], digest=digest,
               probe=lambda: run_probe(_generate(args, fault, suffix), config, tasks))
    return got.status or "", got.reason


def _signal(reason: str | None) -> str:
    for key in ("task_margin", "min_exact_match", "min_first_divergence", "max_mean_abs_logprob_delta"):
        if reason and key in reason:
            return key
    return "-"


def test_detection_rate_by_fault_size_and_false_alarms(tmp_path: Path) -> None:
    config = QualityConfig(tasks="gsm8k-style", task_max_new_tokens=16)
    rows = []
    healthy = [_judge(config, _tasks(k), k, FP8, None) for k in range(REPEATS)]
    slots = [_judge(config, _tasks(k), k, {}, None) for k in range(REPEATS)]  # the baseline's numerics: not gated
    for size in SIZES:
        fault = NumericsFault(f"kv_cache_dtype=fp8_e4m3:{size}")
        got = [_judge(config, _tasks(k), k, FP8, fault) for k in range(REPEATS)]
        failed = [reason for status, reason in got if status == "failed"]
        rows.append((size, len(failed) / REPEATS, Counter(_signal(r) for r in failed)))
    tokens = len(probe_prompts()) * config.max_new_tokens + 60 * config.task_max_new_tokens
    print(f"\n{REPEATS} prompt and task sets (16 prompts, 60 GSM8K-style word problems, last-number extractor, "
          f"task_margin {config.task_margin})")
    print("| fault (nats per token, fp8 KV) | detected | first failing signal |")
    print("|---|---|---|")
    for size, rate, signals in rows:
        print(f"| {size:g} | {rate:.0%} | {', '.join(f'{k} {v}' for k, v in signals.most_common()) or '-'} |")
    alarms = sum(status == "failed" for status, _ in healthy)
    print(f"| healthy fp8 KV (false alarm) | {alarms / REPEATS:.0%} | "
          f"{', '.join(f'{k} {v}' for k, v in Counter(_signal(r) for s, r in healthy if s == 'failed').items()) or '-'} |")
    print(f"| request slots alone (false alarm) | {sum(s == 'failed' for s, _ in slots) / REPEATS:.0%} | - |")
    print(f"probe cost per distinct numerics: {tokens} generated tokens in 2 batch requests "
          f"(16 × {config.max_new_tokens} + 60 × {config.task_max_new_tokens})")
    assert alarms == 0 and all(s != "failed" for s, _ in slots)
    assert rows[-1][1] == 1.0  # a large fault is always caught
