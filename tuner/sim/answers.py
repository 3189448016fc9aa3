"""The simulated model's greedy answers: a deterministic function of the prompt and the server's
numerics (what ``/generate`` with ``return_logprob`` and temperature 0 returns).

The simulated model has a "true" greedy continuation per prompt: a hash chain over the prompt's
token ids, one token per step, each with the chosen token's logprob and its logit *margin* over
the runner-up. A launch whose numerics differ from SGLang's defaults perturbs every step by a
deterministic noise (seeded by the numerics, the prompt and the prefix so far) of scale
``sigma``: the chosen logprob moves by it, and where it exceeds the margin the runner-up wins and
the rest of the answer follows another prefix (a divergence). How the sources drift:

- an fp8 KV cache (``kv_cache_dtype`` ``fp8_e4m3``/``fp8_e5m2``): a small error that grows with
  the context the KV cache holds (prompt + tokens so far), so a few answers diverge, late, and
  logprobs move by about 0.01 nats (the shape of sglang#1286's fp8 KV accuracy tables: small
  average drift, a few changed answers); fp4 KV four times more;
- another attention backend, decode context parallelism, DP attention, another weight dtype or
  MoE runner: a small position-independent error (other accumulation orders);
- speculative decoding (``speculative_*``): none, the target model verifies every token, so
  greedy answers are identical;
- a planted fault (``--sim-numerics-fault NAME=VALUE[,NAME=VALUE][:NATS][@TOKEN]``): when the
  launch sets every named flag to its value, answers degrade from token ``TOKEN`` on (default 0).
  Without a size the noise is large and ignores the margins: answers break from the first tokens,
  as with ROCm/ATOM#1772's fp8 KV dtype bug. With a size (``:0.05``: nats per token), a noise of
  that scale is added to the launch's own drift and a token flips where it exceeds the logit
  margin, as a healthy drift does: a graded degradation (issue 38's detection benchmark).

Arithmetic prompts (``What is 17 + 25? Answer with the number only.``) are answered with the
correct number first (a large margin), so a task probe scores the healthy model at 100 %. A word
problem (a prompt holding a sum, difference or product, ``a + b``, without "number only", as a
GSM8K-style item does once its arithmetic is written out) is answered the way a chain-of-thought
model answers GSM8K: reasoning words, then ``The answer is N`` (the number at token 12, or the last
token of a shorter answer), then more words. Its number's logit margin is the question's own (a
hash: some are near ties), and one question in ten the model gets wrong (it answers ``N + 1``):
the healthy model scores about 90 % with an extractor that reads the last number, 0 % with one
that reads the first word, and a graded fault lowers the score with its size.

This module reads only its inputs: flags by SGLang field name, the prompt's token ids.
"""

from __future__ import annotations

import math
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Answer", "NumericsFault", "answer", "numerics_drift"]

_ALWAYS_NEUTRAL = (None, "auto", False, "", "none")

_DRIFT: dict[str, tuple[float, float]] = {
    # flag -> (sigma at an empty context in nats, growth per 1024 tokens of context)
    "attention_backend": (0.003, 0.0),
    "prefill_attention_backend": (0.002, 0.0),
    "decode_attention_backend": (0.002, 0.0),
    "dcp_size": (0.002, 0.0),
    "enable_dp_attention": (0.001, 0.0),
    "quantization": (0.012, 0.0),
    "dtype": (0.006, 0.0),
    "moe_runner_backend": (0.002, 0.0),
    "enable_fp32_lm_head": (0.001, 0.0),
    "triton_attention_reduce_in_fp32": (0.001, 0.0),
}
"""Drift of each numerics source other than the KV cache's dtype (speculative flags: none)."""

_KV_DRIFT = {"fp8_e4m3": (0.004, 2.5), "fp8_e5m2": (0.006, 2.5), "fp4_e2m1": (0.016, 2.5)}
"""KV dtype -> (sigma at an empty context, growth per 1024 tokens of context)."""

_NEAR_TIES = 0.008
"""Share of near ties (a margin of a few thousandths of a nat) among the tokens after the first 32;
fewer before (the opening of an answer is confident). Only they flip under a healthy drift."""

_FAULT_SIGMA = 2.0
"""The noise of a planted numerics fault (nats): answers break from the first tokens."""

_MASK = 2**64 - 1

_ARITH = re.compile(r"(-?\d+)\s*([-+*x×])\s*(-?\d+)")

_NUMBER_ONLY = re.compile(r"number only", re.IGNORECASE)

_ANSWER_AT = 12
"""The token position of a word problem's number (``The answer is N`` just before it)."""

_WRONG_SHARE = 0.1
"""Share of word problems the healthy simulated model answers wrongly (``N + 1``)."""


@dataclass(frozen=True)
class Answer:
    """One greedy answer.

    Attributes:
        token_ids: The output token ids.
        logprobs: The chosen tokens' logprobs (nats, ≤ 0), one per token.
        text: The output text (one word per token, each with a leading space).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str


@dataclass(frozen=True)
class NumericsFault:
    """A planted numerics fault: ``flags`` (field name → value as text) that together degrade answers.

    Args:
        spec: ``NAME=VALUE[,NAME=VALUE...][:NATS][@TOKEN]`` by SGLang field name or flag
            (``kv_cache_dtype=fp8_e4m3``, ``--kv-cache-dtype=fp8_e4m3:0.05@8``); ``NATS``: the
            fault's noise per token (nats; absent: answers break, the first spelling's fault);
            ``TOKEN``: the answer position it starts at (tokens, default 0). Empty: no fault.

    Raises:
        ValueError: A part without ``=``, a size that is not a number above 0, a token that is
            not an integer ≥ 0.
    """

    spec: str = ""

    def __post_init__(self) -> None:
        self.flags  # noqa: B018 - validates the spec (raises ValueError)

    def _parts(self) -> tuple[str, float | None, int]:
        """``(flags text, size in nats or None, first token)`` of :attr:`spec`."""
        text, at, token = self.spec.partition("@")
        text, colon, size = text.partition(":")
        try:
            nats = float(size) if colon else None
            start = int(token) if at else 0
        except ValueError:
            nats, start = -1.0, -1
        if (nats is not None and not (nats > 0 and math.isfinite(nats))) or start < 0:
            raise ValueError(f"--sim-numerics-fault {self.spec!r}: the size after ':' must be nats per token above 0 "
                             "and the token after '@' an integer >= 0 (e.g. kv_cache_dtype=fp8_e4m3:0.05@8)")
        return text, nats, start

    @property
    def size(self) -> float | None:
        """The fault's noise per token (nats), ``None``: answers break (margins ignored)."""
        return self._parts()[1]

    @property
    def start(self) -> int:
        """The answer position (tokens) from which the fault acts."""
        return self._parts()[2]

    @property
    def flags(self) -> dict[str, str]:
        """Field name → value (lowercased text)."""
        out: dict[str, str] = {}
        for part in (p.strip() for p in self._parts()[0].split(",") if p.strip()):
            name, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"--sim-numerics-fault {self.spec!r} must be NAME=VALUE[,NAME=VALUE][:NATS][@TOKEN] "
                             f"({part!r} has no '='; e.g. kv_cache_dtype=fp8_e4m3:0.05@8)")
            out[name.strip().lstrip("-").replace("-", "_")] = value.strip().lower()
        return out

    def hits(self, server_args: Mapping[str, Any]) -> bool:
        """Whether a launch with ``server_args`` sets every flag of the fault to its value."""
        flags = self.flags
        return bool(flags) and all(str(server_args.get(k)).strip().lower() == v for k, v in flags.items())


def _neutral(name: str, value: Any) -> bool:
    return value in _ALWAYS_NEUTRAL or (name == "dcp_size" and value in (1, "1"))


def numerics_drift(server_args: Mapping[str, Any], fault: NumericsFault | None = None) -> tuple[str, float, float, bool]:
    """The launch's numerics as the simulated model sees them.

    Returns:
        ``(key, sigma0, growth, faulty)``: a text naming the drifting settings (the noise's seed;
        empty for the exact model), the noise at an empty context (nats), its growth per 1024
        tokens of context, and whether a planted fault hits.
    """
    parts: list[str] = []
    sigma2, growth = 0.0, 0.0
    kv = str(server_args.get("kv_cache_dtype") or "auto").lower()
    if kv in _KV_DRIFT:
        s, g = _KV_DRIFT[kv]
        sigma2, growth = sigma2 + s * s, g
        parts.append(f"kv_cache_dtype={kv}")
    for name, (s, _g) in _DRIFT.items():
        value = server_args.get(name)
        if not _neutral(name, value):
            sigma2 += s * s
            parts.append(f"{name}={value}")
    faulty = fault is not None and fault.hits(server_args)
    if faulty:
        parts.append("fault")
    return ",".join(parts), math.sqrt(sigma2), growth, faulty


def _unit(*parts: int) -> float:
    """A deterministic uniform in (0, 1) from integers."""
    h = 0x9E3779B97F4A7C15
    for part in parts:  # splitmix64 over the parts
        h = (h ^ (part & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return ((h >> 11) + 0.5) / 2**53


def _normal(*parts: int) -> float:
    """A deterministic standard normal from integers (Box-Muller)."""
    u1, u2 = _unit(*parts, 1), _unit(*parts, 2)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def _arith_answer(prompt: str) -> int | None:
    """The correct number of an arithmetic prompt (``17 + 25``, ``6 * 7``, ``9 - 4``), else ``None``."""
    found = _ARITH.search(prompt)
    if found is None:
        return None
    a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


def answer(prompt: str, prompt_ids: list[int], max_new_tokens: int, server_args: Mapping[str, Any], *,
           vocab_size: int, words: tuple[str, ...], fault: NumericsFault | None = None) -> Answer:
    """The simulated model's greedy answer to one prompt under a launch's numerics.

    Args:
        prompt: The prompt text (empty when sent as ids).
        prompt_ids: The prompt's token ids.
        max_new_tokens: Tokens to generate (≥ 0).
        server_args: The launch's SGLang fields (``kv_cache_dtype``, ``attention_backend``, ...).
        vocab_size: The model's vocabulary size.
        words: The words the simulator shows generated ids as (id → ``words[id % len]``).
        fault: A planted numerics fault, or ``None``.

    Returns:
        The answer: token ids, the chosen tokens' logprobs (nats) and the text.
    """
    key, sigma0, growth, faulty = numerics_drift(server_args, fault)
    seed = zlib.crc32(key.encode())
    state = zlib.crc32(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids)) if prompt_ids else 7
    number = _arith_answer(prompt)
    reasons = number is not None and not _NUMBER_ONLY.search(prompt)  # a word problem: reasoning first
    answer_at = min(_ANSWER_AT, max(0, max_new_tokens - 1))
    ids: list[int] = []
    lps: list[float] = []
    texts: list[str] = []
    for i in range(max_new_tokens):
        true_id = state % vocab_size
        true_word = words[true_id % len(words)]
        runner_word = words[(true_id + 1) % len(words)]
        margin = 0.1 - 2.0 * math.log(_unit(state, 11))  # logit gap to the runner-up, nats
        if _unit(state, 17) < _NEAR_TIES * min(1.0, (i / 32.0) ** 2):  # a near tie: the opening is confident
            margin = -0.005 * math.log(_unit(state, 19))
        logprob = -3.0 * _unit(state, 13) ** 3
        if number is not None and not reasons and i == 0:
            true_word, runner_word, margin, logprob = str(number), str(number + 1), 8.0, -0.01
        elif number is not None and reasons and answer_at - 3 <= i < answer_at:
            true_word, margin, logprob = ("The", "answer", "is")[i - answer_at + 3], 8.0, -0.01
        elif number is not None and reasons and i == answer_at:
            asked = zlib.crc32(prompt.encode())
            said = number + (_unit(asked, 23) < _WRONG_SHARE)
            true_word, runner_word = str(said), str(said + 1)
            margin, logprob = 0.05 - 1.5 * math.log(_unit(asked, 29)), -0.05
        chosen_word, noise = true_word, 0.0
        if key:
            sigma = sigma0 * (1.0 + growth * (len(prompt_ids) + i) / 1024.0)
            breaks = False
            if faulty and fault is not None and i >= fault.start:
                size = fault.size
                sigma, breaks = (_FAULT_SIGMA, True) if size is None else (math.hypot(sigma, size), False)
            noise = sigma * _normal(seed, state, i)
            flip = sigma * _normal(seed, state, i, 5)
            if (breaks and abs(flip) > 0.5) or abs(flip) > margin:
                chosen_word = runner_word
                logprob -= min(margin, 1.0)
        chosen_id = zlib.crc32(chosen_word.encode()) % vocab_size if chosen_word.lstrip("-").isdigit() else (
            (true_id + (chosen_word != true_word)) % vocab_size)
        ids.append(chosen_id)
        lps.append(round(min(0.0, logprob + noise), 6))
        texts.append(chosen_word)
        state = int(_unit(state, chosen_id, i) * 2**53)
    return Answer(token_ids=ids, logprobs=lps, text="".join(" " + w for w in texts))
