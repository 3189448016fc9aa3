"""The quality probe and gate: a candidate that changes numerics must answer as the baseline does.

One concept: output quality as a constraint. A launch whose numerics-relevant flags
(:mod:`tuner.sglang.numerics`) differ from the baseline's answers a fixed prompt set greedily
(temperature 0, the chosen tokens' logprobs through SGLang's native ``/generate``,
:meth:`tuner.sglang.client.SGLangClient.greedy_answers`); its answers are compared with the
baseline's, recorded once per study (the *reference*):

- **exact-match share**: answers token-for-token identical to the reference's (0-1);
- **first divergence**: the earliest token position at which any answer differs;
- **mean |Δ logprob|**: of the chosen tokens over each answer's prefix shared with the reference
  (nats): kernels that still pick the same tokens but with moved probabilities.

Optionally a *task probe* scores answers on a JSONL of ``{"question", "answer"}`` lines (the
operator's own evaluation set, or ``arithmetic``: a set this module generates) with an extractor
(:func:`score_answer`: the last number of the answer for a numeric answer, as GSM8K is scored;
exact match of a short answer otherwise). The candidate is judged against the reference item by
item (paired), with a non-inferiority margin declared before the run (``[quality] task_margin``,
as sgl-project/sglang#39215 judges DCP by a 1-point GSM8K margin): it fails when its accuracy
drop is beyond the margin *and* the drop is real (an exact sign test over the discordant items,
one-sided, 5 %), so one near tie does not fail a healthy candidate; the drop's 95 % interval is
recorded. A reference that scores below ``min_reference_task_accuracy`` carries no signal (a
wrong extractor reads 0 % on both sides): the study takes no reference and launches no candidate
of changed numerics, and says why in one line.

The prompts are shipped in ``tuner/data/quality-prompts.json`` (chat, code, arithmetic and
long-context prompts; nothing is downloaded). The thresholds are ``[quality]``
(:class:`QualityConfig`); their defaults come from the simulator's fp8 KV drift (``docs/quality-gate.md``). A study pays one probe per distinct numerics: a later trial with the same numerics reuses
the figures (judged again against the current thresholds).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictBool, model_validator

from tuner.errors import QualityError, ServerError
from tuner.records import QualityFacts
from tuner.sglang.client import GreedyAnswer
from tuner.units import NonEmptyStr

__all__ = [
    "QualityConfig",
    "QualityPrompt",
    "TaskItem",
    "ProbeAnswers",
    "Comparison",
    "Generate",
    "probe_prompts",
    "read_tasks",
    "arithmetic_tasks",
    "write_tasks",
    "exact_answer",
    "score_answer",
    "task_drop",
    "run_probe",
    "compare",
    "judge",
    "gate",
    "quality_constraint",
]

Generate = Callable[[list[str], int, float], list[GreedyAnswer]]
"""``(prompts, max_new_tokens, timeout_s) -> answers``: greedy answers with logprobs, in order
(:meth:`tuner.trial.ServerUnderTest.generate`).

Raises:
    QualityError: The server returns no logprobs.
    ServerError: It did not answer.
"""


class QualityConfig(BaseModel):
    """``[quality]``: the quality gate (a failed gate makes a candidate infeasible).

    Attributes:
        enabled: Probe candidates that change numerics (off: they are not gated, and ``tuner
            apply`` refuses them).
        max_new_tokens: Tokens of each greedy answer (tokens).
        min_exact_match: Least share of answers identical to the baseline's (0-1).
        min_first_divergence: The earliest divergence of any answer may not come before this
            token position (tokens; 0 disables the check).
        max_mean_abs_logprob_delta: Largest mean |Δ logprob| over the shared prefixes (nats).
        tasks: A JSONL of ``{"question": ..., "answer": ...}`` lines scored by exact answer, or
            ``arithmetic`` (a generated set of 32 sums and products); unset: no task probe.
        task_max_new_tokens: Tokens of each task answer (a chain-of-thought answer needs room
            for its reasoning: 256 for GSM8K on a real model).
        task_scoring: How an answer is read (:func:`score_answer`): ``auto`` (the last number
            for a numeric answer, else exact match), ``number`` (the last number), ``exact``
            (the answer's first line, or its first word, equals the expected one).
        task_margin: The non-inferiority margin, declared before the run: the largest accuracy
            drop below the baseline's the gate accepts (0-1; 0.02 = 2 points). The old spelling
            ``max_task_accuracy_drop`` is read as it.
        min_reference_task_accuracy: The least accuracy of the baseline's answers for the task
            probe to carry a signal (0-1); below it the study launches no candidate of changed
            numerics (fix the set or ``task_scoring``).
        timeout_s: Limit of one probe, seconds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # "48" is not a number of tokens

    enabled: StrictBool = True
    max_new_tokens: int = Field(default=48, ge=8, le=512)
    min_exact_match: float = Field(default=0.5, ge=0.0, le=1.0)
    min_first_divergence: int = Field(default=4, ge=0, le=512)
    max_mean_abs_logprob_delta: float = Field(default=0.05, gt=0.0, le=10.0)
    tasks: NonEmptyStr | None = None
    task_max_new_tokens: int = Field(default=16, ge=1, le=1024)
    task_scoring: Literal["auto", "number", "exact"] = "auto"
    task_margin: float = Field(default=0.02, ge=0.0, le=1.0,
                               validation_alias=AliasChoices("task_margin", "max_task_accuracy_drop"))
    min_reference_task_accuracy: float = Field(default=0.2, ge=0.0, le=1.0)
    timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)

    @model_validator(mode="after")
    def _divergence_within_answer(self) -> QualityConfig:
        if self.min_first_divergence > self.max_new_tokens:
            raise ValueError(f"min_first_divergence ({self.min_first_divergence}) must be at most max_new_tokens "
                             f"({self.max_new_tokens})")
        return self


@dataclass(frozen=True)
class QualityPrompt:
    """One prompt of the shipped set: ``id``, ``kind`` (chat, code, arithmetic, long-context), ``text``."""

    id: str
    kind: str
    text: str


@dataclass(frozen=True)
class TaskItem:
    """One task: a question and its exact answer."""

    question: str
    answer: str


@cache
def probe_prompts() -> tuple[QualityPrompt, ...]:
    """The shipped prompt set (``tuner/data/quality-prompts.json``): 16 prompts, chat, code,
    arithmetic and long-context (inventory logs of about 1.5-2.5k words)."""
    data = json.loads(resources.files("tuner.data").joinpath("quality-prompts.json").read_text(encoding="utf-8"))
    return tuple(QualityPrompt(id=p["id"], kind=p["kind"], text=p["text"]) for p in data["prompts"])


def read_tasks(path: str | Path) -> list[TaskItem]:
    """A task set: ``arithmetic`` (:func:`arithmetic_tasks`), or a JSONL file of
    ``{"question": str, "answer": str|number}`` lines (blank lines skipped).

    Raises:
        QualityError: The file is missing or unreadable, a line is not such an object, or it holds
            no task (naming the file, the line and the fix).
    """
    if str(path) == "arithmetic":
        return arithmetic_tasks()
    fix = 'write one JSON object per line: {"question": "What is 2 + 3?", "answer": "5"}'
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise QualityError(f"[quality] tasks {str(path)!r}: cannot read it ({type(err).__name__})",
                           hint="give a readable JSONL file, or tasks = \"arithmetic\"") from err
    items: list[TaskItem] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise QualityError(f"[quality] tasks {str(path)!r} line {number}: not JSON ({err.args[0][:60]})",
                               hint=fix) from err
        if not (isinstance(row, dict) and isinstance(row.get("question"), str) and row["question"].strip()
                and isinstance(row.get("answer"), (str, int, float)) and not isinstance(row.get("answer"), bool)):
            raise QualityError(f"[quality] tasks {str(path)!r} line {number}: needs a non-empty string \"question\" "
                               "and a string or number \"answer\"", hint=fix)
        items.append(TaskItem(question=row["question"], answer=str(row["answer"]).strip()))
    if not items:
        raise QualityError(f"[quality] tasks {str(path)!r} holds no task", hint=fix)
    return items


def arithmetic_tasks(n: int = 32, seed: int = 0) -> list[TaskItem]:
    """A generated arithmetic set: ``n`` sums, differences and products of two-digit numbers,
    each asking for the number only (``What is 37 + 48? Answer with the number only.`` → ``85``)."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = "+-*"[i % 3]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        items.append(TaskItem(question=f"What is {a} {op} {b}? Answer with the number only.", answer=str(value)))
    return items


def write_tasks(items: Sequence[TaskItem], path: str | Path) -> None:
    """Write ``items`` as a JSONL task set (what :func:`read_tasks` reads)."""
    Path(path).write_text("".join(json.dumps({"question": t.question, "answer": t.answer}) + "\n" for t in items),
                          encoding="utf-8")


_WORD = re.compile(r"[^\s]+")


def exact_answer(output: str, expected: str) -> bool:
    """Whether ``output`` answers ``expected`` exactly: its first word (trailing punctuation
    stripped, case ignored) is the answer, or the same number (``85.0`` for ``85``)."""
    found = _WORD.search(output)
    if found is None:
        return False
    got, want = found.group(0).rstrip(".,;:!?").strip().lower(), expected.strip().lower()
    if got == want:
        return True
    try:
        return float(got.replace(",", "")) == float(want.replace(",", ""))
    except ValueError:
        return False


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def score_answer(output: str, expected: str, scoring: str = "auto") -> bool:
    """Whether ``output`` answers ``expected``.

    Args:
        output: The model's answer text.
        expected: The task's answer.
        scoring: ``number``: the last number in ``output`` equals ``expected`` as a number (GSM8K's
            convention: a chain of thought ends with its answer, ``The answer is 72`` / ``#### 72``;
            ``1,000`` reads 1000); ``exact``: :func:`exact_answer`, or ``output``'s first line
            equals ``expected`` (case, surrounding spaces and end punctuation ignored); ``auto``:
            ``number`` when ``expected`` is a number, else ``exact``.
    """
    want = _number(expected.strip())
    if scoring == "number" or (scoring == "auto" and want is not None):
        found = _NUMBER.findall(output)
        got = _number(found[-1]) if found else None
        return got is not None and want is not None and got == want
    line = output.strip().splitlines()[0] if output.strip() else ""
    return exact_answer(output, expected) or line.rstrip(".,;:!?").strip().lower() == expected.strip().lower()


def task_drop(lost: int, gained: int, n: int) -> tuple[float, tuple[float, float], float]:
    """The paired accuracy drop of a candidate below the reference on ``n`` items.

    Args:
        lost: Items the reference answered right and the candidate wrong.
        gained: Items the other way round.
        n: Items.

    Returns:
        ``(drop, (low, high), p)``: the drop (0-1), its 95 % interval (normal approximation of
        the paired difference), and the one-sided exact sign test's p-value that the candidate
        loses no more items than it gains (McNemar's exact test over the ``lost + gained``
        discordant items).
    """
    drop = (lost - gained) / max(1, n)
    spread = math.sqrt(max(0.0, lost + gained - (lost - gained) ** 2 / max(1, n))) / max(1, n)
    k = lost + gained
    p = sum(math.comb(k, i) for i in range(lost, k + 1)) / 2**k if k else 1.0
    return drop, (drop - 1.96 * spread, drop + 1.96 * spread), p


@dataclass(frozen=True)
class ProbeAnswers:
    """One probe's answers: the prompt set's (in order), the task accuracy (0-1, ``None``
    without tasks) and which tasks were answered right, the wall time (s) and the digest of
    what was asked."""

    answers: list[GreedyAnswer]
    task_accuracy: float | None
    elapsed_s: float
    digest: str
    task_correct: list[bool] | None = None


def probe_digest(config: QualityConfig, tasks: Sequence[TaskItem]) -> str:
    """What makes two probes comparable: the prompts, the answer lengths and the task set (a
    reference recorded with other ones is not reused)."""
    text = json.dumps([[p.text for p in probe_prompts()], config.max_new_tokens, config.task_max_new_tokens,
                       [[t.question, t.answer] for t in tasks], *([config.task_scoring] if tasks else [])])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_probe(generate: Generate, config: QualityConfig, tasks: Sequence[TaskItem],
              clock: Callable[[], float] = time.monotonic) -> ProbeAnswers:
    """Ask the server the prompt set (and the task set), greedily.

    Raises:
        QualityError: The server returns no logprobs.
        ServerError: It did not answer (in ``config.timeout_s``).
    """
    begun = clock()
    prompts = probe_prompts()
    answers = generate([p.text for p in prompts], config.max_new_tokens, config.timeout_s)
    accuracy, correct = None, None
    if tasks:
        left = max(1.0, config.timeout_s - (clock() - begun))
        outs = generate([t.question for t in tasks], config.task_max_new_tokens, left)
        correct = [score_answer(o.text, t.answer, config.task_scoring) for o, t in zip(outs, tasks, strict=True)]
        accuracy = sum(correct) / len(tasks)
    return ProbeAnswers(answers=answers, task_accuracy=accuracy, elapsed_s=clock() - begun,
                        digest=probe_digest(config, tasks), task_correct=correct)


@dataclass(frozen=True)
class Comparison:
    """A candidate's answers against the reference's.

    Attributes:
        exact_match_share: Identical answers (0-1).
        first_divergence: The earliest differing token position (tokens), ``None`` when all match.
        mean_abs_logprob_delta: Mean |Δ logprob| over the shared prefixes (nats); ``None`` when no
            answer shares a token with the reference.
    """

    exact_match_share: float
    first_divergence: int | None
    mean_abs_logprob_delta: float | None


def compare(reference: Sequence[tuple[Sequence[int], Sequence[float]]], candidate: Sequence[GreedyAnswer]) -> Comparison:
    """Compare answers prompt by prompt.

    Args:
        reference: ``(token_ids, logprobs)`` per prompt.
        candidate: The candidate's answers, same order.
    """
    same, firsts, deltas = 0, [], []
    for (ref_ids, ref_lps), got in zip(reference, candidate, strict=True):
        shared = next((i for i, (a, b) in enumerate(zip(ref_ids, got.token_ids, strict=False)) if a != b),
                      min(len(ref_ids), len(got.token_ids)))
        if shared == len(ref_ids) == len(got.token_ids):
            same += 1
        else:
            firsts.append(shared)
        deltas += [abs(a - b) for a, b in zip(ref_lps[:shared], got.logprobs[:shared], strict=False)]
    return Comparison(exact_match_share=same / max(1, len(candidate)), first_divergence=min(firsts, default=None),
                      mean_abs_logprob_delta=sum(deltas) / len(deltas) if deltas else None)


def _task_judgement(config: QualityConfig, task_accuracy: float, reference_task_accuracy: float,
                    lost: int | None, gained: int | None, items: int | None) -> str | None:
    """The task part of :func:`judge`: why the candidate's accuracy fails the margin, or ``None``."""
    if lost is not None and gained is not None and items:
        drop, (low, high), p = task_drop(lost, gained, items)
        if drop > config.task_margin and p < 0.05:
            return (f"task accuracy {task_accuracy:.0%} vs the baseline's {reference_task_accuracy:.0%}: a drop of "
                    f"{drop:.1%} (95 % CI {low:.1%} to {high:.1%}; {lost} answers lost, {gained} gained, sign test "
                    f"p = {p:.3f}) beyond the [quality] task_margin {config.task_margin:g}")
        return None
    if reference_task_accuracy - task_accuracy > config.task_margin:
        return (f"task accuracy {task_accuracy:.0%} vs the baseline's {reference_task_accuracy:.0%} (drop > [quality] "
                f"task_margin {config.task_margin:g})")
    return None


def judge(comparison: Comparison, config: QualityConfig, task_accuracy: float | None,
          reference_task_accuracy: float | None, *, lost: int | None = None, gained: int | None = None,
          items: int | None = None) -> str | None:
    """Why the gate fails (one line), or ``None`` when it passes.

    The task part: with the paired counts (``lost``, ``gained`` of ``items``), the drop must be
    beyond ``[quality] task_margin`` and real (:func:`task_drop`'s sign test, p < 0.05); without
    them (a probe stored before), the accuracies' difference against the margin."""
    if task_accuracy is not None and reference_task_accuracy is not None and (
            why := _task_judgement(config, task_accuracy, reference_task_accuracy, lost, gained, items)) is not None:
        return why
    c = comparison
    if c.exact_match_share < config.min_exact_match:
        return f"{c.exact_match_share:.0%} of answers match the baseline's (< [quality] min_exact_match {config.min_exact_match:g})"
    if c.first_divergence is not None and c.first_divergence < config.min_first_divergence:
        return (f"an answer diverges at token {c.first_divergence} (< [quality] min_first_divergence "
                f"{config.min_first_divergence})")
    if c.mean_abs_logprob_delta is None or c.mean_abs_logprob_delta > config.max_mean_abs_logprob_delta:
        moved = "no shared prefix" if c.mean_abs_logprob_delta is None else f"{c.mean_abs_logprob_delta:.3f} nats"
        return f"mean |Δ logprob| {moved} (> [quality] max_mean_abs_logprob_delta {config.max_mean_abs_logprob_delta:g})"
    return None


def quality_constraint(facts: QualityFacts, config: QualityConfig) -> float:
    """The ``quality`` constraint of a trial: -1.0 (holds) for the baseline's numerics, a passed
    gate, or a change left ungated by ``[quality] enabled = false`` (then ``tuner apply`` refuses
    it); 1.0 for a failed gate or a change that could not be judged."""
    if facts.status in ("reference", "same", "passed") or (facts.status == "unprobed" and not config.enabled):
        return -1.0
    return 1.0


def _figures(facts: QualityFacts, *, status: str, reason: str | None, probed_on: int | None) -> QualityFacts:
    return facts.model_copy(update={"status": status, "reason": reason, "probed_on_trial": probed_on})


def gate(number: int, numerics: dict[str, Any], changes: list[str], config: QualityConfig, *,
         reference: dict[str, Any] | None, probes: Sequence[dict[str, Any]],
         probe: Callable[[], ProbeAnswers], digest: str) -> QualityFacts:
    """The quality phase of trial ``number``: its :class:`~tuner.records.QualityFacts`.

    Args:
        number: The trial.
        numerics: Its numerics-relevant flags (``numerics_key`` as a mapping).
        changes: The flags on which they differ from the baseline's.
        config: ``[quality]``.
        reference: The study's reference (``trial``, ``digest``, ``token_ids``, ``logprobs``,
            ``task_accuracy``), or ``None``.
        probes: Earlier probes of this study (stored facts with ``probed_on_trial`` and ``digest``).
        probe: Runs the probe on the server now.
        digest: :func:`probe_digest` of this run's settings.

    Returns:
        ``same`` / ``reference`` for the baseline's numerics (the reference recorded when the study
        has none), else ``passed`` / ``failed`` / ``unprobed``. Never raises: a probe that cannot
        run is ``unprobed`` with the one-line reason.
    """
    facts = QualityFacts(numerics=numerics, changes=changes)
    ref = reference if reference is not None and reference.get("digest") == digest else None
    if not changes:
        if not config.enabled or ref is not None:
            return facts.model_copy(update={"status": "same",
                                            "reference_trial": ref.get("trial") if ref is not None else None})
        try:
            got = probe()
        except (QualityError, ServerError) as err:
            return facts.model_copy(update={"status": "same", "reason": f"no reference recorded: {err}"})
        if got.task_accuracy is not None and got.task_accuracy < config.min_reference_task_accuracy:
            return facts.model_copy(update={"status": "same", "task_accuracy": got.task_accuracy, "reason": (
                f"no reference recorded: the task probe carries no signal, the baseline scores {got.task_accuracy:.0%} "
                f"on [quality] tasks (< min_reference_task_accuracy {config.min_reference_task_accuracy:g}); check "
                f"task_scoring ({config.task_scoring!r}) against the answers' format, or give tasks the model answers")})
        return facts.model_copy(update={
            "status": "reference", "reference_trial": number, "probed_on_trial": number, "prompts": len(got.answers),
            "task_accuracy": got.task_accuracy, "probe_s": round(got.elapsed_s, 3), "digest": got.digest,
            "answers": {"digest": got.digest, "token_ids": [a.token_ids for a in got.answers],
                        "logprobs": [[round(x, 5) for x in a.logprobs] for a in got.answers],
                        "task_accuracy": got.task_accuracy, "task_correct": got.task_correct},
        })
    if not config.enabled:
        return facts.model_copy(update={"status": "unprobed", "reason": "[quality] enabled = false: not compared"})
    if ref is None:
        return facts.model_copy(update={"status": "unprobed", "reason": (
            "no reference answers of the baseline's numerics in this study with these [quality] settings")})
    for known in probes:
        if known.get("numerics") == numerics and known.get("digest") == digest:
            cached = QualityFacts.model_validate(known)
            why = judge(Comparison(cached.exact_match_share or 0.0, cached.first_divergence, cached.mean_abs_logprob_delta),
                        config, cached.task_accuracy, cached.reference_task_accuracy, lost=cached.task_lost,
                        gained=cached.task_gained, items=cached.task_items)
            return _figures(cached.model_copy(update={"changes": changes}), status="failed" if why else "passed",
                            reason=why, probed_on=cached.probed_on_trial)
    try:
        got = probe()
    except (QualityError, ServerError) as err:
        return facts.model_copy(update={"status": "unprobed", "reason": f"the probe could not run: {err}"})
    comparison = compare(list(zip(ref["token_ids"], ref["logprobs"], strict=True)), got.answers)
    lost = gained = None
    ref_correct = ref.get("task_correct")
    if got.task_correct is not None and ref_correct is not None and len(ref_correct) == len(got.task_correct):
        lost = sum(r and not c for r, c in zip(ref_correct, got.task_correct, strict=True))
        gained = sum(c and not r for r, c in zip(ref_correct, got.task_correct, strict=True))
    items = len(got.task_correct) if got.task_correct else None
    why = judge(comparison, config, got.task_accuracy, ref.get("task_accuracy"), lost=lost, gained=gained, items=items)
    if lost is not None and gained is not None and items:
        _drop, (low, high), _p = task_drop(lost, gained, items)
        facts = facts.model_copy(update={"task_lost": lost, "task_gained": gained, "task_items": items,
                                         "task_drop_ci": [round(low, 4), round(high, 4)]})
    facts = facts.model_copy(update={
        "reference_trial": ref.get("trial"), "prompts": len(got.answers), "digest": got.digest,
        "exact_match_share": round(comparison.exact_match_share, 4), "first_divergence": comparison.first_divergence,
        "mean_abs_logprob_delta": None if comparison.mean_abs_logprob_delta is None else round(comparison.mean_abs_logprob_delta, 5),
        "task_accuracy": got.task_accuracy, "reference_task_accuracy": ref.get("task_accuracy"),
        "probe_s": round(got.elapsed_s, 3),
    })
    return _figures(facts, status="failed" if why else "passed", reason=why, probed_on=number)
