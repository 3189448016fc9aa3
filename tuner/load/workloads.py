"""Workloads: the seeded, reproducible request streams the load generator sends.

A workload spec (a pydantic model, discriminated by ``kind``, usable as the ``[workload]`` table of
a study config) is turned by :func:`build_workload` into a :class:`Workload`: an iterable of
:class:`Request` whose prompts are token ids, so lengths are exact and no tokenizer is needed
(SGLang's ``/generate`` takes ``input_ids`` and ``/v1/completions`` takes a token-id ``prompt``,
``shared/sglang-reference.md`` §5.3; bench_serving needs ``--tokenize-prompt`` for the same, §6.3).

Kinds:

* ``random`` — bench_serving's ``random-ids``: lengths uniform in ``[max(int(L*r), 1), L]`` (§6.1
  ``--random-range-ratio``; the default here is 1.0, fixed lengths). IID traffic: ~0 % prefix reuse.
* ``shared_prefix`` — bench_serving's ``generated-shared-prefix`` (§6.3): ``num_groups`` system
  prompts of ``system_prompt_len`` tokens, ``prompts_per_group`` questions each, shuffled. Once a
  group's first request has run, the radix cache can serve its system prompt (§7), so the designed
  hit rate is ``(ppg-1)/ppg * system_prompt_len / (system_prompt_len + question_len)``.
* ``multi_turn`` — conversations whose history grows: turn ``k`` sends turn ``k-1``'s prompt, a
  synthetic assistant answer of ``output_len`` tokens and a new user turn. Turn ``k`` waits for turn
  ``k-1`` (:attr:`Request.after`). The server's real answer differs from the synthetic one, so the
  reusable prefix is the previous turn's prompt (what HiCache keeps warm, §7).
* ``text`` — text prompts like an operator's users send (chat and code; a JSONL file or the
  shipped set), sent as text: the load for a speculative deployment (:class:`TextSpec`).
* ``trace`` — replay of the traces operators have (``trace_format``, ``auto`` by default):

  - ``jsonl``: one object per line, ``timestamp_s``, ``input_len``, ``output_len`` and optionally
    ``prefix_group`` (+ ``prefix_len``, tokens shared in the group) or ``session`` (requests of one
    session form a growing conversation, like ``multi_turn``);
  - ``sharegpt``: bench_serving's ShareGPT conversation JSON (§6.3; a list of
    ``{"conversations": [{"from": "human"|"gpt"|"system", "value": text}, ...]}``): every user turn
    that has an answer is a request whose prompt is the conversation so far and whose output length
    is the answer's; turn ``k`` waits for turn ``k-1``; no timestamps (closed loop or ``rate``);
  - ``openai``: request logs, JSONL of OpenAI chat requests with a timestamp (``timestamp``,
    ``created``, ``time`` or ``ts``; epoch s/ms/µs or ISO 8601) and ``messages`` at the top or under
    ``request`` / ``body``; the output length is ``usage.completion_tokens``, else the response's
    text, else ``max_tokens``. A request whose messages are an earlier request's messages plus an
    assistant message (its answer) and more is that request's next turn and waits for it.

  Unless ``send_text`` (a speculative deployment: :func:`for_speculation`) text is not sent,
  and no tokenizer is used either way: each message becomes a block of
  ``4 + ceil(UTF-8 bytes / bytes_per_token)`` token ids (:data:`MESSAGE_OVERHEAD_TOKENS`, default
  :data:`BYTES_PER_TOKEN` 4.0) drawn from a seed and the hash of the message with everything before
  it, so two requests share exactly the token ids of their common leading messages, and the prefix
  cache sees the same reuse the real traffic has. Answers are estimated the same way.

:func:`estimate_reuse` walks one pass and measures the prefix reuse and the reused working set
(the study uses it to decide whether the hierarchical cache can pay, §7).

:func:`capacity_probe` builds N requests of exactly L context tokens for the capacity phase.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from tuner.errors import ConfigError, LoadError

__all__ = [
    "RandomSpec",
    "SharedPrefixSpec",
    "MultiTurnSpec",
    "TraceSpec",
    "WorkloadSpec",
    "Request",
    "Workload",
    "build_workload",
    "capacity_probe",
    "designed_hit_rate",
    "WORKLOAD_KINDS",
    "spec_from_options",
    "TRACE_FORMATS",
    "ReuseEstimate",
    "estimate_reuse",
    "estimate_tokens",
    "TextSpec",
    "read_prompts",
    "SHIPPED_PROMPTS",
    "for_speculation",
]

_FIRST_TOKEN_ID = 100
"""Lowest token id drawn; keeps clear of the special tokens at the bottom of most vocabularies."""


BYTES_PER_TOKEN = 4.0
"""Default UTF-8 bytes per token when a trace holds text and no token counts (~4 for English BPE
vocabularies; CJK text, 3 bytes a character, comes out near 0.75 tokens a character)."""


MAX_TOKENS = 2**21
"""The longest prompt or output a workload may ask for, in tokens (2,097,152: past every served
context; larger values overflowed numpy's sampler or exhausted memory before the first request)."""

MAX_COUNT = 2**20
"""The most groups, prompts per group, sessions or turns a workload may ask for (1,048,576): each is
built up front, so ``num_sessions = 1e30`` hung the dry run (a new user's sweep)."""


class _Spec(BaseModel):
    """A workload spec: a ``[workload]`` table or the ``tuner load`` options. Strict types (as the
    config's tables, :class:`tuner.config._Section`): ``input_len = "2016"`` is refused, not read as
    a number; a file's path is the one key a string converts (to a :class:`~pathlib.Path`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)


class RandomSpec(_Spec):
    """IID random token ids (bench_serving ``random-ids``, §6.1).

    Attributes:
        input_len: Prompt length in tokens (the maximum when ``range_ratio < 1``).
        output_len: ``max_new_tokens`` (sent with ``ignore_eos``, so it is the output length).
        range_ratio: Lengths are uniform in ``[max(int(L*range_ratio), 1), L]``; 1.0 = fixed.
        num_requests: Requests in one pass; ``None`` = an endless stream (stop by duration).
    """

    kind: Literal["random"] = "random"
    input_len: int = Field(1024, ge=1, le=MAX_TOKENS)
    output_len: int = Field(256, ge=1, le=MAX_TOKENS)
    range_ratio: float = Field(1.0, ge=0.0, le=1.0)
    num_requests: int | None = Field(None, ge=1)


class SharedPrefixSpec(_Spec):
    """Groups of prompts sharing a system prompt (bench_serving ``generated-shared-prefix``, §6.3)."""

    kind: Literal["shared_prefix"] = "shared_prefix"
    num_groups: int = Field(64, ge=1, le=MAX_COUNT)
    prompts_per_group: int = Field(16, ge=1, le=MAX_COUNT)
    system_prompt_len: int = Field(2048, ge=1, le=MAX_TOKENS)
    question_len: int = Field(128, ge=1, le=MAX_TOKENS)
    output_len: int = Field(256, ge=1, le=MAX_TOKENS)


class MultiTurnSpec(_Spec):
    """Conversations whose history grows and is re-sent each turn (prefix reuse across turns).

    ``system_prompt_len`` > 0 puts one system prompt of that many tokens, shared by every
    session, before each session's first ``first_input_len`` tokens (a chat deployment's long
    system prompt); the first turn's input is then ``system_prompt_len + first_input_len``.
    """

    kind: Literal["multi_turn"] = "multi_turn"
    num_sessions: int = Field(32, ge=1, le=MAX_COUNT)
    turns: int = Field(4, ge=1, le=MAX_COUNT)
    first_input_len: int = Field(1024, ge=1, le=MAX_TOKENS)
    turn_input_len: int = Field(128, ge=1, le=MAX_TOKENS)
    output_len: int = Field(256, ge=1, le=MAX_TOKENS)
    system_prompt_len: int = Field(0, ge=0, le=MAX_TOKENS)


class TraceSpec(_Spec):
    """Replay of a recorded trace: the tuner's JSONL, bench_serving's ShareGPT JSON or an
    OpenAI-format request log (see the module docstring).

    Attributes:
        path: The trace file.
        time_scale: Multiplies the trace's time offsets: 0.5 replays twice as fast.
        trace_format: ``auto`` (from the file's first object), ``jsonl``, ``sharegpt`` or ``openai``.
        bytes_per_token: UTF-8 bytes per token for text traces (lengths are estimated, no tokenizer).
        max_requests: Keep the first N requests (ShareGPT: whole conversations up to N requests).
        send_text: Send each prompt as text (``/generate`` ``text``) instead of token ids: the
            ShareGPT / OpenAI trace's own messages, one ``role: content`` line each; a JSONL trace,
            which holds no text, gets the shipped chat prompts cut to each block's length (equal
            blocks, equal text, so the prefix reuse stays). How a speculative deployment is
            loaded (:func:`for_speculation`): acceptance depends on the text.
    """

    kind: Literal["trace"] = "trace"
    path: Annotated[Path, Field(strict=False)]
    time_scale: float = Field(1.0, gt=0.0)
    trace_format: Literal["auto", "jsonl", "sharegpt", "openai"] = "auto"
    bytes_per_token: float = Field(BYTES_PER_TOKEN, gt=0.0)
    max_requests: int | None = Field(None, ge=1)
    send_text: StrictBool = False


class TextSpec(_Spec):
    """Text prompts that read like an operator's users: chat questions and code tasks, sent as text.

    A speculative deployment's throughput depends on how often the draft is right, and that
    depends on what users send: random token ids overstate it (lightseekorg/tokenspeed#1305:
    74.6 % accepted on raw completions vs 48.5 % on chat), so a speculative deployment is loaded
    with text. Each line of ``prompts`` is ``{"prompt": text, "class": "chat"|"code"}`` (``class``
    optional, default ``chat``); without a file the shipped set ``tuner/data/prompts-chat.jsonl``
    (24 chat, 12 code prompts) is used. Each request starts with its own id, so repeats of a prompt
    do not hit the prefix cache.

    Attributes:
        prompts: The JSONL file, or None for the shipped set.
        prompt_tokens: Grow each prompt with the next prompts of the set until it reaches about
            this many tokens (estimated at :data:`BYTES_PER_TOKEN`); None: each prompt as it is.
        output_len: ``max_new_tokens`` (sent with ``ignore_eos``).
        num_requests: Requests in one pass; ``None`` = an endless stream.
    """

    kind: Literal["text"] = "text"
    prompts: Annotated[Path, Field(strict=False)] | None = None
    prompt_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    output_len: int = Field(256, ge=1, le=MAX_TOKENS)
    num_requests: int | None = Field(None, ge=1)


WorkloadSpec = Annotated[
    RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec | TextSpec, Field(discriminator="kind")
]
"""Any workload spec; pydantic picks the class from ``kind``."""


class Request(BaseModel):
    """One request to send.

    Attributes:
        rid: Unique id within a run (``<kind>-<pass>-<index>``).
        input_ids: Prompt token ids (exact input length, no tokenizer).
        max_new_tokens: Output length (sent with ``ignore_eos``).
        arrival_s: Send offset from the run's start for trace replay; ``None`` otherwise.
        group: Prefix group or session the request belongs to (for reporting), if any.
        after: ``rid`` of a request that must finish before this one is sent (the previous turn).
        text: The prompt as text (sent instead of ``input_ids``, which then stand for it: its
            estimated length, in ids equal where the leading text is), or None.
        prompt_class: What the prompt is (``raw`` random ids, ``chat``, ``code``, ``trace`` a
            trace's own text), for acceptance by class; None when unknown.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    arrival_s: float | None = None
    group: str | None = None
    after: str | None = None
    text: str | None = None
    prompt_class: str | None = None

    @property
    def input_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.input_ids)


def _make_request(**fields: Any) -> Request:
    # Built from trusted values; skipping validation keeps 1k-token prompts cheap.
    fields.setdefault("arrival_s", None)
    fields.setdefault("group", None)
    fields.setdefault("after", None)
    fields.setdefault("text", None)
    fields.setdefault("prompt_class", None)
    return Request.model_construct(**fields)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A reproducible stream of :class:`Request` built from a spec and a seed.

    Iterating yields one pass (endless for ``random`` without ``num_requests``). :meth:`passes`
    yields pass after pass with fresh prompts (same system prompts for ``shared_prefix``) for runs
    that last longer than one pass; ``trace`` and capacity probes have one pass only.

    Attributes:
        kind: The spec's ``kind`` (``capacity_probe`` for probes).
        spec: The spec it was built from (``None`` for a capacity probe).
        seed: The seed.
        context_tokens: The longest ``input + output`` of any request (tokens).
        mean_request_tokens: The mean ``input + output`` of a request (tokens): what a request
            holds of the KV pool on average, so how many run at once (the longest is
            :attr:`context_tokens`).
        num_requests: Requests in one pass, ``None`` when endless.
        repeatable: Whether :meth:`passes` may go beyond the first pass.
        has_dependencies: Whether some request waits for another (``after``).
        has_arrivals: Whether requests carry ``arrival_s`` (trace replay).
        designed_hit_rate: The prefix-cache hit rate the workload is built for, when known.
        trace_format: The format a trace was read as (``jsonl``, ``sharegpt``, ``openai``), else None.
    """

    kind: str
    spec: BaseModel | None
    seed: int
    make_pass: Callable[[int], Iterator[Request]] = field(repr=False)
    context_tokens: int
    num_requests: int | None
    repeatable: bool
    mean_request_tokens: int = 0
    has_dependencies: bool = False
    has_arrivals: bool = False
    designed_hit_rate: float | None = None
    trace_format: str | None = None

    def __post_init__(self) -> None:
        if not self.mean_request_tokens:
            object.__setattr__(self, "mean_request_tokens", self.context_tokens)

    def __iter__(self) -> Iterator[Request]:
        return self.make_pass(0)

    def passes(self) -> Iterator[Request]:
        """Yield pass 0, then (if :attr:`repeatable`) pass 1, 2, ... without end."""
        if not self.repeatable:
            yield from self.make_pass(0)
            return
        for index in itertools.count():
            yield from self.make_pass(index)

    def describe(self) -> str:
        """One line naming the kind, its parameters and the context length."""
        params = "" if self.spec is None else ", ".join(
            f"{k}={v}" for k, v in self.spec.model_dump(exclude={"kind"}).items()
        )
        count = "endless" if self.num_requests is None else f"{self.num_requests} requests/pass"
        return f"{self.kind}({params}) — {count}, context {self.context_tokens} tokens, seed {self.seed}"


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, *stream])


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(_FIRST_TOKEN_ID, vocab_size, size=n).tolist()


def designed_hit_rate(spec: SharedPrefixSpec) -> float:
    """Prefix-cache hit rate a shared-prefix workload is designed for (§7), as a 0-1 share.

    Every group's first request misses; the others hit the system prompt:
    ``(ppg-1)/ppg * system_prompt_len / (system_prompt_len + question_len)``.
    """
    ppg = spec.prompts_per_group
    return (ppg - 1) / ppg * spec.system_prompt_len / (spec.system_prompt_len + spec.question_len)


def _random(spec: RandomSpec, seed: int, vocab_size: int) -> Workload:
    def make_pass(index: int) -> Iterator[Request]:
        rng = _rng(seed, 1, index)
        low_in = max(int(spec.input_len * spec.range_ratio), 1)
        low_out = max(int(spec.output_len * spec.range_ratio), 1)
        counter = range(spec.num_requests) if spec.num_requests else itertools.count()
        for i in counter:
            n_in = int(rng.integers(low_in, spec.input_len + 1))
            n_out = int(rng.integers(low_out, spec.output_len + 1))
            yield _make_request(
                rid=f"random-{index}-{i}", input_ids=_tokens(rng, n_in, vocab_size), max_new_tokens=n_out,
                prompt_class="raw",
            )

    return Workload(
        kind=spec.kind, spec=spec, seed=seed, make_pass=make_pass,
        context_tokens=spec.input_len + spec.output_len, num_requests=spec.num_requests,
        mean_request_tokens=round(
            (max(int(spec.input_len * spec.range_ratio), 1) + spec.input_len) / 2
            + (max(int(spec.output_len * spec.range_ratio), 1) + spec.output_len) / 2
        ),
        repeatable=True, designed_hit_rate=0.0,
    )


def _shared_prefix(spec: SharedPrefixSpec, seed: int, vocab_size: int) -> Workload:
    prefix_rng = _rng(seed, 2)
    systems = [_tokens(prefix_rng, spec.system_prompt_len, vocab_size) for _ in range(spec.num_groups)]
    total = spec.num_groups * spec.prompts_per_group

    def make_pass(index: int) -> Iterator[Request]:
        rng = _rng(seed, 3, index)
        order = rng.permutation(total)
        questions = rng.integers(_FIRST_TOKEN_ID, vocab_size, size=(total, spec.question_len))
        for i, slot in enumerate(order.tolist()):
            group = slot // spec.prompts_per_group
            yield _make_request(
                rid=f"shared_prefix-{index}-{i}",
                input_ids=systems[group] + questions[slot].tolist(),
                max_new_tokens=spec.output_len,
                group=f"g{group}",
            )

    return Workload(
        kind=spec.kind, spec=spec, seed=seed, make_pass=make_pass,
        context_tokens=spec.system_prompt_len + spec.question_len + spec.output_len,
        num_requests=total, repeatable=True, designed_hit_rate=designed_hit_rate(spec),
    )


def _multi_turn(spec: MultiTurnSpec, seed: int, vocab_size: int) -> Workload:
    system = _tokens(_rng(seed, 7), spec.system_prompt_len, vocab_size) if spec.system_prompt_len else []

    def make_pass(index: int) -> Iterator[Request]:
        rng = _rng(seed, 4, index)
        histories = [system + _tokens(rng, spec.first_input_len, vocab_size) for _ in range(spec.num_sessions)]
        # Turn-major order: every session's turn k before any turn k+1, so the previous turn
        # was sent long before (its wait is short under any concurrency).
        for turn in range(spec.turns):
            for s in range(spec.num_sessions):
                if turn > 0:
                    answer = _tokens(rng, spec.output_len, vocab_size)
                    histories[s] = histories[s] + answer + _tokens(rng, spec.turn_input_len, vocab_size)
                yield _make_request(
                    rid=f"multi_turn-{index}-s{s}-t{turn}",
                    input_ids=histories[s],
                    max_new_tokens=spec.output_len,
                    group=f"s{s}",
                    after=f"multi_turn-{index}-s{s}-t{turn - 1}" if turn > 0 else None,
                )

    step = spec.output_len + spec.turn_input_len
    first = spec.system_prompt_len + spec.first_input_len
    inputs = [first + k * step for k in range(spec.turns)]
    # Turn k can hit turn k-1's prompt (the server's own answer differs from the synthetic one);
    # every session's first turn but the first can hit the shared system prompt.
    shared = spec.system_prompt_len * (spec.num_sessions - 1) / spec.num_sessions
    reuse = (sum(inputs[:-1]) + shared) / sum(inputs)
    return Workload(
        kind=spec.kind, spec=spec, seed=seed, make_pass=make_pass,
        context_tokens=inputs[-1] + spec.output_len, num_requests=spec.num_sessions * spec.turns,
        mean_request_tokens=round(sum(inputs) / len(inputs)) + spec.output_len,
        repeatable=True, has_dependencies=spec.turns > 1, designed_hit_rate=reuse,
    )


# ---- traces ------------------------------------------------------------------------------------

TRACE_FORMATS = ("auto", "jsonl", "sharegpt", "openai")
"""``[workload] trace_format`` choices; ``auto`` looks at the file's first object."""

MESSAGE_OVERHEAD_TOKENS = 4
"""Tokens a chat template adds per message (role header and separators), added to each message's
estimate."""

_ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing", "model"})
_USER_ROLES = frozenset({"human", "user"})


def estimate_tokens(text: str, *, bytes_per_token: float = BYTES_PER_TOKEN) -> int:
    """Deterministic token count of ``text`` without a tokenizer: ``ceil(UTF-8 bytes / bytes_per_token)``.

    Args:
        text: Any text (message content).
        bytes_per_token: UTF-8 bytes per token (> 0).

    Returns:
        Tokens, at least 1.
    """
    return max(1, math.ceil(len(text.encode("utf-8", "surrogatepass")) / bytes_per_token))


@dataclass(frozen=True)
class _Block:
    """A run of prompt tokens with a stable identity: equal keys get equal token ids in a pass
    (and equal text: the message's own, or None where the trace holds none)."""

    key: str
    tokens: int
    text: str | None = None


@dataclass(frozen=True)
class _TraceItem:
    blocks: tuple[_Block, ...]
    output_len: int
    arrival_s: float | None
    group: str | None
    parent: int | None  # index of the item this one waits for (the previous turn)


class _TraceRow(BaseModel):
    model_config = ConfigDict(extra="ignore")

    timestamp_s: float = Field(ge=0.0)
    input_len: int = Field(ge=1, le=MAX_TOKENS)
    output_len: int = Field(ge=1, le=MAX_TOKENS)
    prefix_group: str | int | None = None
    prefix_len: int | None = Field(None, ge=1, le=MAX_TOKENS)
    session: str | int | None = None

    @model_validator(mode="after")
    def _prefix_fits(self) -> _TraceRow:
        if self.prefix_len is not None and self.prefix_len > self.input_len:
            raise ValueError(f"prefix_len {self.prefix_len} exceeds input_len {self.input_len}")
        return self


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=12)
    for p in parts:
        h.update(p.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


def _bad(path: Path, where: str, problem: str, hint: str) -> LoadError:
    return LoadError(f"trace {path} {where} is invalid: {problem}", hint=hint)


_JSONL_HINT = "each line must be a JSON object with timestamp_s, input_len, output_len"
_OPENAI_HINT = ("each line must be a JSON object with messages (or request.messages), a timestamp, and "
                "usage.completion_tokens, the response text or max_tokens")
_SHAREGPT_HINT = 'ShareGPT files are a JSON list of {"conversations": [{"from": ..., "value": ...}, ...]}'


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise LoadError(
            f"trace file {path} cannot be read ({err.strerror})",
            hint="pass an existing trace file (tuner load --trace FILE, or [workload] path in the config)"
        ) from err


def _json_lines(path: Path, data: bytes, hint: str) -> list[tuple[int, dict]]:
    out: list[tuple[int, dict]] = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as err:
            raise _bad(path, f"line {number}", f"not JSON ({err})", hint) from err
        if not isinstance(obj, dict):
            raise _bad(path, f"line {number}", "not a JSON object", hint)
        out.append((number, obj))
    return out


def _detect_format(data: bytes) -> str:
    head = data.lstrip()[:1]
    if head == b"[":
        return "sharegpt"
    for line in data.splitlines():
        if line.strip():
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                return "jsonl"  # reported with its line number by the JSONL reader
            if isinstance(obj, dict) and "conversations" in obj:
                return "sharegpt"
            if isinstance(obj, dict) and ("messages" in obj or isinstance(obj.get("request"), dict)
                                          or isinstance(obj.get("body"), dict)):
                return "openai"
            return "jsonl"
    return "jsonl"


def _jsonl_items(path: Path, data: bytes) -> list[_TraceItem]:
    rows: list[_TraceRow] = []
    for number, obj in _json_lines(path, data, _JSONL_HINT):
        try:
            rows.append(_TraceRow.model_validate(obj))
        except ValidationError as err:
            problem = err.errors()[0]
            raise _bad(path, f"line {number}", f"{'.'.join(map(str, problem['loc'])) or 'row'}: {problem['msg']}",
                       _JSONL_HINT) from err
    rows.sort(key=lambda r: r.timestamp_s)
    group_prefix_len: dict[str, int] = {}
    for row in rows:
        if row.prefix_group is not None:
            key = str(row.prefix_group)
            wanted = row.prefix_len or row.input_len
            group_prefix_len[key] = min(group_prefix_len.get(key, wanted), wanted)
    items: list[_TraceItem] = []
    sessions: dict[str, int] = {}
    for i, row in enumerate(rows):
        own = _Block(f"r:{i}", row.input_len)
        parent = None
        group = None
        blocks: tuple[_Block, ...] = (own,)
        if row.session is not None:
            group = f"session:{row.session}"
            parent = sessions.get(group)
            if parent is not None:
                prev = items[parent]
                history = (*prev.blocks, _Block(f"a:{parent}", prev.output_len))
                extra = row.input_len - sum(b.tokens for b in history)
                if extra > 0:
                    blocks = (*history, _Block(f"r:{i}", extra))
            sessions[group] = i
        elif row.prefix_group is not None:
            group = f"group:{row.prefix_group}"
            n = group_prefix_len[str(row.prefix_group)]
            rest = row.input_len - n
            blocks = (_Block(f"g:{row.prefix_group}", n),) + ((_Block(f"r:{i}", rest),) if rest > 0 else ())
        items.append(_TraceItem(blocks, row.output_len, row.timestamp_s, group, parent))
    return items


def _content_text(content: object) -> str:
    """Message content as text: a string, or the text parts of an OpenAI content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def _message_blocks(messages: list[tuple[str, str]], bytes_per_token: float) -> tuple[list[_Block], list[str]]:
    """One block per message; a block's key chains every message before it (same history, same ids)."""
    blocks: list[_Block] = []
    chain: list[str] = []
    key = ""
    for role, text in messages:
        key = _digest(key, role, text)
        chain.append(key)
        blocks.append(_Block(f"m:{key}", MESSAGE_OVERHEAD_TOKENS + estimate_tokens(text, bytes_per_token=bytes_per_token),
                             f"{role}: {text}\n"))
    return blocks, chain


def _role(raw: object) -> str:
    role = str(raw or "").lower()
    if role in _ASSISTANT_ROLES:
        return "assistant"
    if role in _USER_ROLES:
        return "user"
    return role or "user"


def _sharegpt_items(path: Path, data: bytes, spec: TraceSpec) -> list[_TraceItem]:
    if data.lstrip()[:1] == b"[":
        try:
            entries = orjson.loads(data)
        except orjson.JSONDecodeError as err:
            raise _bad(path, "", f"not JSON ({err})", _SHAREGPT_HINT) from err
        numbered = list(enumerate(entries, start=1))
        where = "entry"
    else:
        numbered = _json_lines(path, data, _SHAREGPT_HINT)
        where = "line"
    per_conv: list[list[_TraceItem]] = []
    total = 0
    for number, entry in numbered:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise _bad(path, f"{where} {number}", "no conversations list", _SHAREGPT_HINT)
        messages = [(_role(t.get("from", t.get("role"))), _content_text(t.get("value", t.get("content"))))
                    for t in turns]
        blocks, _ = _message_blocks(messages, spec.bytes_per_token)
        name = f"conversation:{entry.get('id', number)}"
        conv: list[_TraceItem] = []
        for j, (role, _text) in enumerate(messages[:-1]):
            if role != "user" or messages[j + 1][0] != "assistant":
                continue
            out = estimate_tokens(messages[j + 1][1], bytes_per_token=spec.bytes_per_token)
            conv.append(_TraceItem(tuple(blocks[: j + 1]), out, None, name, len(conv) - 1 if conv else None))
        if not conv:
            continue
        if spec.max_requests is not None and total + len(conv) > spec.max_requests and per_conv:
            break
        per_conv.append(conv)
        total += len(conv)
    # Turn-major order (every conversation's turn k before any turn k+1), so the previous turn was
    # sent long before its successor, as in ``multi_turn``.
    order = sorted(((k, c) for c, conv in enumerate(per_conv) for k in range(len(conv))))
    index = {pos: i for i, pos in enumerate(order)}
    items = []
    for k, c in order:
        item = per_conv[c][k]
        parent = index[(k - 1, c)] if item.parent is not None else None
        items.append(_TraceItem(item.blocks, item.output_len, None, item.group, parent))
    return items


def _timestamp_s(value: object) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        v = float(value)
        return v / 1e6 if v > 1e14 else v / 1e3 if v > 1e11 else v
    if isinstance(value, str):
        try:
            return _dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            try:
                return _timestamp_s(float(value))
            except ValueError:
                return None
    return None


def _openai_items(path: Path, data: bytes, spec: TraceSpec) -> list[_TraceItem]:
    parsed: list[tuple[float, int, list[tuple[str, str]], int]] = []
    for number, obj in _json_lines(path, data, _OPENAI_HINT):
        request, inner = obj.get("request"), obj.get("body")
        body: dict[str, Any] = request if isinstance(request, dict) else inner if isinstance(inner, dict) else obj
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
            raise _bad(path, f"line {number}", "no messages list", _OPENAI_HINT)
        messages = [(_role(m.get("role")), _content_text(m.get("content"))) for m in raw]
        reply = obj.get("response")
        response: dict[str, Any] = reply if isinstance(reply, dict) else {}
        stamp = None
        for holder, name in ((obj, "timestamp_s"), (obj, "timestamp"), (obj, "created"), (obj, "time"),
                             (obj, "ts"), (body, "created"), (response, "created")):
            stamp = _timestamp_s(holder.get(name))
            if stamp is not None:
                break
        if stamp is None:
            raise _bad(path, f"line {number}", "no timestamp (timestamp, created, time or ts)", _OPENAI_HINT)
        usage = response.get("usage") or obj.get("usage") or {}
        out = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(out, int) or out < 1:
            choices = response.get("choices") or obj.get("choices") or []
            text = None
            if choices and isinstance(choices[0], dict):
                text = (choices[0].get("message") or {}).get("content") or choices[0].get("text")
            if text:
                out = estimate_tokens(_content_text(text), bytes_per_token=spec.bytes_per_token)
            else:
                out = body.get("max_completion_tokens") or body.get("max_tokens")
        if not isinstance(out, int) or out < 1:
            raise _bad(path, f"line {number}", "no output length (usage.completion_tokens, response text, "
                       "max_tokens)", _OPENAI_HINT)
        parsed.append((stamp, number, messages, out))
    parsed.sort(key=lambda p: (p[0], p[1]))
    if spec.max_requests is not None:
        parsed = parsed[: spec.max_requests]
    items: list[_TraceItem] = []
    by_prompt: dict[str, int] = {}  # chain key of a request's whole prompt -> its latest index
    for i, (stamp, _number, messages, out) in enumerate(parsed):
        blocks, chain = _message_blocks(messages, spec.bytes_per_token)
        parent = None
        # The previous turn: a request whose whole prompt is this one's history up to an assistant
        # message (that request's answer).
        for j in range(len(messages) - 1, 0, -1):
            if messages[j][0] == "assistant" and chain[j - 1] in by_prompt:
                parent = by_prompt[chain[j - 1]]
                break
        group = items[parent].group if parent is not None else None
        if parent is not None and group is None:
            group = f"session:{parent}"
            items[parent] = replace(items[parent], group=group)
        items.append(_TraceItem(tuple(blocks), out, stamp, group, parent))
        by_prompt[chain[-1]] = i
    return items


def _trace_items(spec: TraceSpec) -> tuple[str, list[_TraceItem]]:
    data = _read_bytes(spec.path)
    fmt = _detect_format(data) if spec.trace_format == "auto" else spec.trace_format
    if fmt == "jsonl":
        items = _jsonl_items(spec.path, data)
        if spec.max_requests is not None:
            items = items[: spec.max_requests]
    elif fmt == "sharegpt":
        items = _sharegpt_items(spec.path, data, spec)
    else:
        items = _openai_items(spec.path, data, spec)
    if not items:
        hints = {"jsonl": "add JSONL lines with timestamp_s, input_len, output_len", "sharegpt": _SHAREGPT_HINT,
                 "openai": _OPENAI_HINT}
        raise LoadError(f"trace {spec.path} holds no request ({fmt} format)", hint=hints[fmt])
    return fmt, items


def _block_ids(seed: int, index: int, key: str, n: int, vocab_size: int) -> list[int]:
    digest = int(_digest(key)[:16], 16)
    return _tokens(_rng(seed, 5, index, digest >> 32, digest & 0xFFFFFFFF), n, vocab_size)


def _trace(spec: TraceSpec, seed: int, vocab_size: int) -> Workload:
    fmt, items = _trace_items(spec)
    timed = [it.arrival_s for it in items if it.arrival_s is not None]
    start = min(timed) if timed else 0.0

    filler = read_prompts(SHIPPED_PROMPTS) if spec.send_text else []

    def make_pass(index: int) -> Iterator[Request]:
        cache: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            ids: list[int] = []
            for b in item.blocks:
                part = cache.get(b.key)
                if part is None or len(part) != b.tokens:
                    part = cache[b.key] = _block_ids(seed, index, b.key, b.tokens, vocab_size)
                ids.extend(part)
            text = "".join(b.text if b.text is not None else _filler_text(filler, b) for b in item.blocks) \
                if spec.send_text else None
            yield _make_request(
                rid=f"trace-{index}-{i}", input_ids=ids, max_new_tokens=item.output_len,
                arrival_s=None if item.arrival_s is None else (item.arrival_s - start) * spec.time_scale,
                group=item.group, after=None if item.parent is None else f"trace-{index}-{item.parent}",
                text=text, prompt_class=None if text is None else "trace",
            )

    return Workload(
        kind=spec.kind, spec=spec, seed=seed, make_pass=make_pass,
        context_tokens=max(sum(b.tokens for b in it.blocks) + it.output_len for it in items),
        mean_request_tokens=round(sum(sum(b.tokens for b in it.blocks) + it.output_len for it in items) / len(items)),
        num_requests=len(items), repeatable=False, has_dependencies=any(it.parent is not None for it in items),
        has_arrivals=bool(timed), trace_format=fmt,
    )


def _filler_text(prompts: list[tuple[str, str]], block: _Block) -> str:
    """Text for a block the trace holds no text for: its key in brackets (two blocks never share
    text by chance), then the shipped chat prompts from one picked by the key, cut to about its
    tokens (:data:`BYTES_PER_TOKEN`), ending in a newline; the same for the same key."""
    start = int(_digest(block.key)[:8], 16) % len(prompts)
    budget = max(1, int(block.tokens * BYTES_PER_TOKEN) - 1)
    parts: list[str] = [f"[{block.key}] "]
    size = len(parts[0].encode("utf-8"))
    j = start
    while size < budget:
        part = prompts[j % len(prompts)][1] + "\n"
        parts.append(part)
        size += len(part.encode("utf-8"))
        j += 1
    return "".join(parts).encode("utf-8")[:budget].decode("utf-8", "ignore") + "\n"


# ---- reuse estimate ----------------------------------------------------------------------------


class ReuseEstimate(BaseModel):
    """How much of a workload's prompt tokens repeat an earlier request's prefix.

    Found by walking one pass's prompts in send order in blocks of :attr:`block_tokens` tokens and
    chaining a hash over the blocks (a radix tree at page granularity, like SGLang's prefix cache,
    ``shared/sglang-reference.md`` §7): a block whose whole prefix was seen before is reusable.

    Attributes:
        requests: Requests looked at (the first ones of a pass, up to the sample limit).
        prompt_tokens: Their prompt tokens.
        reused_tokens: Prompt tokens whose prefix an earlier request already sent (what an unbounded
            prefix cache would serve).
        working_set_tokens: Distinct tokens of the prefixes that are reused at least once (what a
            cache must hold to serve every hit).
        distinct_tokens: Distinct prefix tokens of all prompts.
        sessions: Groups whose requests wait for one another (multi-turn conversations).
        prefix_groups: Groups that share a prefix without waiting (shared system prompts).
        block_tokens: Block size of the walk, tokens.
        sampled: Whether the pass was longer than the sample (endless or cut).
    """

    model_config = ConfigDict(frozen=True)

    requests: int
    prompt_tokens: int
    reused_tokens: int
    working_set_tokens: int
    distinct_tokens: int
    sessions: int = 0
    prefix_groups: int = 0
    block_tokens: int = 64
    sampled: bool = False

    @property
    def reuse_share(self) -> float:
        """``reused_tokens / prompt_tokens`` (0-1)."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def describe(self) -> str:
        """One sentence: the share reused, over how many requests, and the reused working set."""
        scope = f"{self.requests} requests" + (" (a sample)" if self.sampled else "")
        kinds = []
        if self.sessions:
            kinds.append(f"{self.sessions} multi-turn sessions")
        if self.prefix_groups:
            kinds.append(f"{self.prefix_groups} shared-prefix groups")
        found = f"; {', '.join(kinds)}" if kinds else ""
        return (f"{self.reuse_share:.0%} of prompt tokens repeat an earlier request's prefix "
                f"({self.reused_tokens:,} of {self.prompt_tokens:,} over {scope}{found}); "
                f"reused prefixes hold {self.working_set_tokens:,} distinct tokens")


def estimate_reuse(workload: Workload, *, max_requests: int = 2000, max_tokens: int = 4_000_000,
                   block_tokens: int = 64) -> ReuseEstimate:
    """Estimate the prefix reuse and the reused working set of one pass of ``workload``.

    Args:
        workload: Any workload (its first pass is walked; nothing is sent).
        max_requests: Stop after this many requests.
        max_tokens: Stop after this many prompt tokens.
        block_tokens: Granularity of the prefix match, tokens (a partial last block never matches).

    Returns:
        The :class:`ReuseEstimate`.
    """
    counts: dict[int, int] = {}
    prompt = reused = 0
    n = 0
    sampled = False
    groups_dep: set[str] = set()
    groups_shared: set[str] = set()
    stream = iter(workload)
    for request in stream:
        if n >= max_requests or prompt >= max_tokens:
            sampled = True
            break
        n += 1
        ids = request.input_ids
        prompt += len(ids)
        if request.group is not None:
            (groups_dep if request.after is not None else groups_shared).add(request.group)
        raw = np.asarray(ids, dtype=np.int64).tobytes()
        step = block_tokens * 8
        h = 0
        for start in range(0, len(raw) - step + 1, step):
            h = hash((h, raw[start:start + step]))
            seen = counts.get(h, 0)
            if seen:
                reused += block_tokens
            counts[h] = seen + 1
    working = sum(block_tokens for c in counts.values() if c > 1)
    return ReuseEstimate(
        requests=n, prompt_tokens=prompt, reused_tokens=reused, working_set_tokens=working,
        distinct_tokens=len(counts) * block_tokens, sessions=len(groups_dep),
        prefix_groups=len(groups_shared - groups_dep), block_tokens=block_tokens, sampled=sampled,
    )


def build_workload(
    spec: RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec | TextSpec, *, seed: int, vocab_size: int = 32000
) -> Workload:
    """Build the reproducible request stream of ``spec``.

    Args:
        spec: A workload spec (any :data:`WorkloadSpec` member).
        seed: Seed of every random draw; the same seed gives the same requests.
        vocab_size: Token ids are drawn from ``[100, vocab_size)``.

    Returns:
        The :class:`Workload`.

    Raises:
        LoadError: ``vocab_size`` too small, or a trace file that is missing or malformed.
    """
    if vocab_size <= _FIRST_TOKEN_ID:
        raise LoadError(f"vocab_size {vocab_size} is too small", hint=f"use a vocab_size above {_FIRST_TOKEN_ID}")
    builders: dict[str, Callable[..., Workload]] = {"random": _random, "shared_prefix": _shared_prefix,
                                                    "multi_turn": _multi_turn, "trace": _trace, "text": _text}
    return builders[spec.kind](spec, seed, vocab_size)


def for_speculation(spec: WorkloadSpec) -> WorkloadSpec:
    """The workload to load a speculative deployment with: ``random`` ids become the shipped text
    prompts at the same lengths (grown to ``input_len`` tokens, the same ``output_len`` and count);
    a trace sends its text (:attr:`TraceSpec.send_text`); text and the rest are kept. Random ids overstate how often the draft is accepted
    (:class:`TextSpec`), so a speculative deployment is never measured on them."""
    if isinstance(spec, RandomSpec):
        return TextSpec(prompt_tokens=spec.input_len, output_len=spec.output_len, num_requests=spec.num_requests)
    if isinstance(spec, TraceSpec) and not spec.send_text:
        return spec.model_copy(update={"send_text": True})
    return spec


SHIPPED_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts-chat.jsonl"
"""The shipped chat-like prompt set (:class:`TextSpec`)."""


def read_prompts(path: Path) -> list[tuple[str, str]]:
    """``(class, text)`` of every line of a prompts JSONL file (see :class:`TextSpec`).

    Raises:
        LoadError: A missing or unreadable file, one that is not UTF-8 text, a line that is not JSON
            or has no ``prompt``.
    """
    hint = "point --prompts (or [workload] prompts) at a JSONL file of {\"prompt\": text}"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise LoadError(f"prompts file {path} cannot be read: {err.strerror}", hint=hint) from None
    except UnicodeDecodeError as err:
        raise LoadError(f"prompts file {path} is not UTF-8 text (byte {err.start})", hint=hint) from None
    out: list[tuple[str, str]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise LoadError(f"{path}:{n} is not JSON", hint="write one {\"prompt\": text} object per line") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise LoadError(f"{path}:{n} has no \"prompt\" text", hint="write one {\"prompt\": text} object per line")
        out.append((str(obj.get("class") or "chat"), obj["prompt"]))
    if not out:
        raise LoadError(f"prompts file {path} holds no prompt", hint="write one {\"prompt\": text} object per line")
    return out


def _text(spec: TextSpec, seed: int, vocab_size: int) -> Workload:
    prompts = read_prompts(spec.prompts or SHIPPED_PROMPTS)
    order = _rng(seed, 5).permutation(len(prompts)).tolist()

    def build(i: int) -> tuple[str, str]:
        cls, text = prompts[order[i % len(order)]]
        j = i + 1
        while spec.prompt_tokens is not None and estimate_tokens(text) < spec.prompt_tokens:
            text += "\n\n" + prompts[order[j % len(order)]][1]
            j += 1
        return cls, text

    def make_pass(index: int) -> Iterator[Request]:
        counter = range(spec.num_requests) if spec.num_requests else itertools.count()
        for i in counter:
            rid = f"text-{index}-{i}"
            cls, text = build(i)
            text = f"[{rid}] {text}"
            yield _make_request(rid=rid, input_ids=[_FIRST_TOKEN_ID] * estimate_tokens(text),
                                max_new_tokens=spec.output_len, text=text, prompt_class=cls)

    lengths = [estimate_tokens(build(i)[1]) + 4 for i in range(len(prompts))]
    return Workload(
        kind=spec.kind, spec=spec, seed=seed, make_pass=make_pass,
        context_tokens=max(lengths) + spec.output_len, num_requests=spec.num_requests,
        mean_request_tokens=round(sum(lengths) / len(lengths)) + spec.output_len,
        repeatable=True, designed_hit_rate=0.0,
    )


def capacity_probe(n: int, context_len: int, *, output_len: int = 16, seed: int = 0, vocab_size: int = 32000) -> Workload:
    """``n`` requests of exactly ``context_len`` tokens (input ``context_len - output_len``).

    Sent with ``concurrency=n`` they hold ``n * context_len`` tokens of KV cache at once: the
    context-capacity probe.

    Args:
        n: Number of requests.
        context_len: Input + output tokens of each request.
        output_len: Output tokens of each request (``ignore_eos``).
        seed: Seed of the token ids (distinct prompts, so no prefix sharing).
        vocab_size: Token ids are drawn from ``[100, vocab_size)``.

    Returns:
        A one-pass :class:`Workload` of ``n`` requests.

    Raises:
        LoadError: ``n < 1`` or ``context_len <= output_len``.
    """
    if n < 1 or output_len < 1 or context_len <= output_len:
        raise LoadError(
            f"capacity probe n={n}, context_len={context_len}, output_len={output_len} is empty",
            hint="use n >= 1 and context_len > output_len >= 1",
        )

    def make_pass(index: int) -> Iterator[Request]:
        rng = _rng(seed, 6, index)
        for i in range(n):
            yield _make_request(
                rid=f"capacity-{index}-{i}", input_ids=_tokens(rng, context_len - output_len, vocab_size),
                max_new_tokens=output_len,
            )

    return Workload(
        kind="capacity_probe", spec=None, seed=seed, make_pass=make_pass, context_tokens=context_len,
        num_requests=n, repeatable=False, designed_hit_rate=0.0,
    )


WORKLOAD_KINDS: Mapping[str, type[RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec | TextSpec]] = MappingProxyType({
    "random": RandomSpec,
    "shared-prefix": SharedPrefixSpec,
    "multi-turn": MultiTurnSpec,
    "trace": TraceSpec,
    "text": TextSpec,
})
"""``--workload`` names (CLI spelling) and their spec classes."""


def spec_from_options(
    kind: str, options: dict[str, object]
) -> RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec | TextSpec:
    """Build a spec from CLI options (field name → value, ``None`` = not given).

    Args:
        kind: A :data:`WORKLOAD_KINDS` name, e.g. ``shared-prefix``.
        options: Spec fields by name (``input_len``, ``num_groups``, ``path``, ...).

    Returns:
        The spec, with the spec's defaults for options not given.

    Raises:
        ConfigError: An unknown kind, an option that does not apply to ``kind``, or a bad value.
    """
    cls = WORKLOAD_KINDS.get(kind)
    if cls is None:
        raise ConfigError(f"--workload {kind!r} is unknown", hint=f"use one of {', '.join(WORKLOAD_KINDS)}")
    given: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    for name in given:
        if name not in cls.model_fields:
            flag = "--trace" if name == "path" else "--" + name.replace("_", "-")
            users = [k for k, c in WORKLOAD_KINDS.items() if name in c.model_fields]
            raise ConfigError(
                f"{flag} does not apply to --workload {kind}", hint=f"drop it, or use --workload {' / '.join(users)}"
            )
    try:
        return cls(**given)
    except ValidationError as err:
        problem = err.errors()[0]
        name = str(problem["loc"][0]) if problem["loc"] else kind
        flag = "--trace" if name == "path" else "--" + name.replace("_", "-")
        raise ConfigError(
            f"{flag} {given.get(name, '')!s} is invalid: {problem['msg']}".replace("  ", " "),
            hint=f"fix {flag} (see `tuner load --help`)",
        ) from err
