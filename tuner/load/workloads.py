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
* ``trace`` — replay of a JSONL trace, one object per line: ``timestamp_s``, ``input_len``,
  ``output_len`` and optionally ``prefix_group`` (+ ``prefix_len``, tokens shared in the group) or
  ``session`` (requests of one session form a growing conversation, like ``multi_turn``).

:func:`capacity_probe` builds N requests of exactly L context tokens for the capacity phase.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
]

_FIRST_TOKEN_ID = 100
"""Lowest token id drawn; keeps clear of the special tokens at the bottom of most vocabularies."""


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RandomSpec(_Spec):
    """IID random token ids (bench_serving ``random-ids``, §6.1).

    Attributes:
        input_len: Prompt length in tokens (the maximum when ``range_ratio < 1``).
        output_len: ``max_new_tokens`` (sent with ``ignore_eos``, so it is the output length).
        range_ratio: Lengths are uniform in ``[max(int(L*range_ratio), 1), L]``; 1.0 = fixed.
        num_requests: Requests in one pass; ``None`` = an endless stream (stop by duration).
    """

    kind: Literal["random"] = "random"
    input_len: int = Field(1024, ge=1)
    output_len: int = Field(256, ge=1)
    range_ratio: float = Field(1.0, ge=0.0, le=1.0)
    num_requests: int | None = Field(None, ge=1)


class SharedPrefixSpec(_Spec):
    """Groups of prompts sharing a system prompt (bench_serving ``generated-shared-prefix``, §6.3)."""

    kind: Literal["shared_prefix"] = "shared_prefix"
    num_groups: int = Field(64, ge=1)
    prompts_per_group: int = Field(16, ge=1)
    system_prompt_len: int = Field(2048, ge=1)
    question_len: int = Field(128, ge=1)
    output_len: int = Field(256, ge=1)


class MultiTurnSpec(_Spec):
    """Conversations whose history grows and is re-sent each turn (prefix reuse across turns)."""

    kind: Literal["multi_turn"] = "multi_turn"
    num_sessions: int = Field(32, ge=1)
    turns: int = Field(4, ge=1)
    first_input_len: int = Field(1024, ge=1)
    turn_input_len: int = Field(128, ge=1)
    output_len: int = Field(256, ge=1)


class TraceSpec(_Spec):
    """Replay of a JSONL trace (``timestamp_s``, ``input_len``, ``output_len``, optional
    ``prefix_group`` / ``prefix_len`` / ``session``).

    Attributes:
        path: The JSONL file.
        time_scale: Multiplies the trace's time offsets: 0.5 replays twice as fast.
    """

    kind: Literal["trace"] = "trace"
    path: Path
    time_scale: float = Field(1.0, gt=0.0)


WorkloadSpec = Annotated[
    RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec, Field(discriminator="kind")
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
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    arrival_s: float | None = None
    group: str | None = None
    after: str | None = None

    @property
    def input_len(self) -> int:
        """Prompt length in tokens."""
        return len(self.input_ids)


def _make_request(**fields: Any) -> Request:
    # Built from trusted values; skipping validation keeps 1k-token prompts cheap.
    fields.setdefault("arrival_s", None)
    fields.setdefault("group", None)
    fields.setdefault("after", None)
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
                rid=f"random-{index}-{i}", input_ids=_tokens(rng, n_in, vocab_size), max_new_tokens=n_out
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
    def make_pass(index: int) -> Iterator[Request]:
        rng = _rng(seed, 4, index)
        histories = [_tokens(rng, spec.first_input_len, vocab_size) for _ in range(spec.num_sessions)]
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
    inputs = [spec.first_input_len + k * step for k in range(spec.turns)]
    # Turn k can hit turn k-1's prompt (the server's own answer differs from the synthetic one).
    reuse = sum(inputs[:-1]) / sum(inputs)
    return Workload(
        kind=spec.kind, spec=spec, seed=seed, make_pass=make_pass,
        context_tokens=inputs[-1] + spec.output_len, num_requests=spec.num_sessions * spec.turns,
        mean_request_tokens=round(sum(inputs) / len(inputs)) + spec.output_len,
        repeatable=True, has_dependencies=spec.turns > 1, designed_hit_rate=reuse,
    )


class _TraceRow(BaseModel):
    model_config = ConfigDict(extra="ignore")

    timestamp_s: float = Field(ge=0.0)
    input_len: int = Field(ge=1)
    output_len: int = Field(ge=1)
    prefix_group: str | int | None = None
    prefix_len: int | None = Field(None, ge=1)
    session: str | int | None = None

    @model_validator(mode="after")
    def _prefix_fits(self) -> _TraceRow:
        if self.prefix_len is not None and self.prefix_len > self.input_len:
            raise ValueError(f"prefix_len {self.prefix_len} exceeds input_len {self.input_len}")
        return self


def _read_trace(path: Path) -> list[_TraceRow]:
    try:
        lines = path.read_bytes().splitlines()
    except OSError as err:
        raise LoadError(
            f"trace file {path} cannot be read ({err.strerror})", hint="pass an existing JSONL file with --trace"
        ) from err
    rows: list[_TraceRow] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(_TraceRow.model_validate(orjson.loads(line)))
        except (orjson.JSONDecodeError, ValidationError) as err:
            if isinstance(err, ValidationError):
                problem = err.errors()[0]
                first = f"{'.'.join(map(str, problem['loc'])) or 'row'}: {problem['msg']}"
            else:
                first = f"not JSON ({err})"
            raise LoadError(
                f"trace {path} line {number} is invalid: {first}",
                hint="each line must be a JSON object with timestamp_s, input_len, output_len",
            ) from err
    if not rows:
        raise LoadError(f"trace {path} holds no request", hint="add JSONL lines with timestamp_s, input_len, output_len")
    return sorted(rows, key=lambda r: r.timestamp_s)


def _trace(spec: TraceSpec, seed: int, vocab_size: int) -> Workload:
    rows = _read_trace(spec.path)
    start = rows[0].timestamp_s
    group_prefix_len: dict[str, int] = {}
    for row in rows:
        if row.prefix_group is not None:
            key = str(row.prefix_group)
            wanted = row.prefix_len or row.input_len
            group_prefix_len[key] = min(group_prefix_len.get(key, wanted), wanted)

    def make_pass(index: int) -> Iterator[Request]:
        rng = _rng(seed, 5, index)
        prefixes = {g: _tokens(rng, n, vocab_size) for g, n in sorted(group_prefix_len.items())}
        sessions: dict[str, tuple[list[int], str]] = {}
        for i, row in enumerate(rows):
            rid = f"trace-{index}-{i}"
            after = None
            group = None
            if row.session is not None:
                group = f"session:{row.session}"
                previous = sessions.get(group)
                if previous is None:
                    ids = _tokens(rng, row.input_len, vocab_size)
                else:
                    history, after = previous
                    extra = row.input_len - len(history)
                    ids = history + _tokens(rng, extra, vocab_size) if extra > 0 else _tokens(rng, row.input_len, vocab_size)
                sessions[group] = (ids + _tokens(rng, row.output_len, vocab_size), rid)
            elif row.prefix_group is not None:
                group = f"group:{row.prefix_group}"
                prefix = prefixes[str(row.prefix_group)]
                ids = prefix + _tokens(rng, row.input_len - len(prefix), vocab_size)
            else:
                ids = _tokens(rng, row.input_len, vocab_size)
            yield _make_request(
                rid=rid, input_ids=ids, max_new_tokens=row.output_len,
                arrival_s=(row.timestamp_s - start) * spec.time_scale, group=group, after=after,
            )

    return Workload(
        kind=spec.kind, spec=spec, seed=seed, make_pass=make_pass,
        context_tokens=max(r.input_len + r.output_len for r in rows), num_requests=len(rows),
        mean_request_tokens=round(sum(r.input_len + r.output_len for r in rows) / len(rows)),
        repeatable=False, has_dependencies=any(r.session is not None for r in rows), has_arrivals=True,
    )


def build_workload(
    spec: RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec, *, seed: int, vocab_size: int = 32000
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
    builders: dict[str, Callable[..., Workload]] = {"random": _random, "shared_prefix": _shared_prefix, "multi_turn": _multi_turn, "trace": _trace}
    return builders[spec.kind](spec, seed, vocab_size)


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


WORKLOAD_KINDS: Mapping[str, type[RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec]] = MappingProxyType({
    "random": RandomSpec,
    "shared-prefix": SharedPrefixSpec,
    "multi-turn": MultiTurnSpec,
    "trace": TraceSpec,
})
"""``--workload`` names (CLI spelling) and their spec classes."""


def spec_from_options(
    kind: str, options: dict[str, object]
) -> RandomSpec | SharedPrefixSpec | MultiTurnSpec | TraceSpec:
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
