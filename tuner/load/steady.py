"""The steady window: SLO-safe capacity as the operator's traffic lives it (issue 36).

One definition, used by ``tuner load --sessions`` and by the trial's capacity phase:

* **sessions** — ``N`` closed-loop sessions: each sends its next request when its previous one
  ended (GuideLLM's *concurrent* profile, ``bench_serving --max-concurrency N``);
* **ramp** — the sessions start staggered over ``ramp_s`` (session ``i`` at ``i × ramp_s / N``),
  as users arrive one after another, never all at the same instant (that is the *burst*, the
  stress phase's OOM check: :func:`tuner.load.workloads.capacity_probe`);
* **traffic** — the workload's own length distribution, with a share ``longest_share`` of the
  requests at the longest context (``[objective] context_tokens``; :func:`session_workload`); a
  multi-turn workload's sessions keep their growing prefix (each turn re-sends the history, so
  the radix cache holds it as an agent's context grows);
* **warm-up excluded** — the ramp and ``settle_s`` after it are warm-up (bench_serving's
  definition, §6.1): the window starts once every session runs;
* **steady to the end** — the sessions keep sending (unmeasured, as cool-down) until the last
  measured request has ended (:meth:`SteadyWindow.cooldown_s`): every measured request decodes
  beside the prefills of arriving requests, as in the steady state it stands for. A window whose
  sends stop at its end lets its last requests finish on an emptying server: on the reference
  twin (32k contexts, requests longer than the window) a 10 s window read 6 sessions SLO-safe
  where 60 s of steady load at 6 broke p99 ITL (5.7 s against 4 s);
* **window** — ``duration_s`` of measured load; its p99 TTFT / ITL / TPOT carry 95 % order-statistic
  intervals and the SLO attainment (the share of requests meeting every limit: DistServe's
  goodput, :func:`tuner.load.metrics.summarize`) a Wilson interval
  (:func:`tuner.load.search.judge_contexts`, the one judge of a window against the SLO).

The SLO-safe capacity is the largest ``N`` whose window meets the p99 limits: the trial brackets
it downwards from the OOM-safe capacity (:func:`tuner.load.search.bracket_level`), ``tuner load
--max-under-slo --sessions`` searches it upwards (:func:`tuner.load.search.find_max_under_slo`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from tuner.errors import LoadError
from tuner.load.workloads import Request, Workload

__all__ = ["SteadyWindow", "DEFAULT_RAMP_S", "sessions_reach", "session_workload"]

DEFAULT_RAMP_S = 10.0
"""The longest ramp a window gets by default (seconds): at most half the window."""

_VOCAB = 32000
_FIRST_TOKEN_ID = 100


@dataclass(frozen=True)
class SteadyWindow:
    """The timing of one steady load of closed-loop sessions (seconds).

    Attributes:
        duration_s: The measured window (> 0).
        ramp_s: The sessions' staggered start (``None``: ``min(DEFAULT_RAMP_S, duration_s / 2)``).
        settle_s: Warm-up after the ramp, before the window.

    Raises:
        LoadError: :meth:`check` — a ramp longer than the window (its sessions would still be
            arriving while it is measured, or the window would hold too few of their requests).
    """

    duration_s: float
    ramp_s: float | None = None
    settle_s: float = 0.0

    @property
    def ramp(self) -> float:
        """The ramp in seconds (the default resolved)."""
        return min(DEFAULT_RAMP_S, self.duration_s / 2) if self.ramp_s is None else self.ramp_s

    @property
    def warmup_s(self) -> float:
        """What precedes the window and is excluded from it: the ramp plus ``settle_s``."""
        return self.ramp + self.settle_s

    @staticmethod
    def cooldown_s(request_timeout_s: float) -> float:
        """How long the sessions keep sending after the window (seconds): until the last measured
        request ends, which is at most a request's timeout ``request_timeout_s`` (the load ends as
        soon as it has: :func:`tuner.load.run_load`'s cool-down)."""
        return request_timeout_s

    def check(self, *, ramp_flag: str = "--ramp", window_flag: str = "--duration") -> SteadyWindow:
        """This window, validated (before anything is sent).

        Raises:
            LoadError: A negative time, a window ≤ 0, or a ramp longer than the window; the hint
                names ``ramp_flag`` / ``window_flag`` (the CLI's or the config's names).
        """
        if not self.duration_s > 0 or not self.ramp >= 0 or not self.settle_s >= 0:
            raise LoadError(f"{window_flag} {self.duration_s:g} s, {ramp_flag} {self.ramp:g} s are out of range",
                            hint=f"use {window_flag} > 0 and {ramp_flag} >= 0 seconds")
        if self.ramp > self.duration_s:
            raise LoadError(
                f"the ramp ({ramp_flag} {self.ramp:g} s) is longer than the measured window "
                f"({window_flag} {self.duration_s:g} s): its sessions would still be arriving when it is judged",
                hint=f"set {ramp_flag} to at most {self.duration_s:g} s, or lengthen {window_flag}",
            )
        return self


def sessions_reach(workload: Workload, context_tokens: int, *, where: str = "[objective] context_tokens") -> Workload:
    """``workload`` when its sessions (a multi-turn workload's) reach ``context_tokens`` at their
    last turn; any other workload as it is (:func:`session_workload` mixes longest prompts in).

    Raises:
        LoadError: The sessions' last turn holds fewer than ``context_tokens`` tokens: the steady
            window would never load the longest context the capacity counts.
    """
    if workload.has_dependencies and workload.context_tokens < context_tokens:
        raise LoadError(
            f"the {workload.kind} workload's sessions reach {workload.context_tokens} tokens at their last "
            f"turn, never the longest context of {context_tokens} tokens ({where})",
            hint=f"raise [workload] turns or turn_input_len until a session reaches {context_tokens} tokens, "
                 f"or set {where} = {workload.context_tokens}",
        )
    return workload


def session_workload(workload: Workload, context_tokens: int, longest_share: float, *,
                     where: str = "[objective] context_tokens", sessions: int | None = None) -> Workload:
    """The requests the steady sessions send: ``workload`` with a share of its requests at the
    longest context.

    A multi-turn workload keeps its sessions: their histories grow turn by turn and the last turn
    is its longest context, which must reach ``context_tokens``; its requests are sent ``sessions``
    conversations at a time (every turn of a block of ``sessions`` conversations before the next
    block), so that ``sessions`` closed-loop streams each carry one growing conversation, as an
    agent's context grows, rather than every conversation's first turn before any second one. Any other workload's requests
    are replaced, with probability ``longest_share`` each (seeded by the workload's seed), by a
    prompt of ``context_tokens − output`` fresh random token ids with the request's own output
    length; the others keep the workload's own lengths. The result is endless when ``workload``
    repeats, and carries no arrival times (sessions pace themselves).

    Args:
        workload: The configured workload (:func:`tuner.load.workloads.build_workload`).
        context_tokens: The longest context, input + output tokens.
        longest_share: Share of requests at the longest context, in [0, 1] (ignored for multi-turn).
        where: Where ``context_tokens`` was set, for the error's hint.
        sessions: Closed-loop sessions that will send it (multi-turn: the conversations in flight
            together); ``None``: the workload's own order.

    Returns:
        The sessions' :class:`~tuner.load.workloads.Workload`; its ``context_tokens`` is
        ``context_tokens`` (when any request reaches it).

    Raises:
        LoadError: The workload's sessions never reach ``context_tokens`` (multi-turn), or
            ``longest_share`` is outside [0, 1].
    """
    if not 0.0 <= longest_share <= 1.0:
        raise LoadError(f"longest_share {longest_share:g} is not a share",
                        hint="set [objective] longest_share between 0 and 1 (or --longest-share)")
    if workload.has_dependencies:
        return _in_blocks(sessions_reach(workload, context_tokens, where=where), sessions)
    if longest_share == 0.0:
        return replace(workload, has_arrivals=False)

    def make_pass(index: int) -> Iterator[Request]:
        rng = np.random.default_rng([workload.seed, 36, index])
        source = workload.make_pass(index)
        for i in itertools.count():
            try:
                request = next(source)
            except StopIteration:
                return
            if rng.random() < longest_share:
                out = max(1, min(request.max_new_tokens, context_tokens // 4))
                ids = rng.integers(_FIRST_TOKEN_ID, _VOCAB, size=context_tokens - out).tolist()
                request = Request.model_construct(
                    rid=f"longest-{index}-{i}", input_ids=ids, max_new_tokens=out, arrival_s=None,
                    group=request.group, after=None, text=None, prompt_class="raw")
            elif request.arrival_s is not None:
                request = request.model_copy(update={"arrival_s": None})
            yield request

    mean = round(longest_share * context_tokens + (1 - longest_share) * workload.mean_request_tokens)
    return replace(workload, kind=f"{workload.kind}+longest", make_pass=make_pass,
                   context_tokens=max(context_tokens, workload.context_tokens), mean_request_tokens=mean,
                   has_arrivals=False, num_requests=None if workload.repeatable else workload.num_requests)


def _in_blocks(workload: Workload, sessions: int | None) -> Workload:
    """A multi-turn ``workload`` reordered to ``sessions`` conversations at a time: turn-major
    within each block of conversations (its requests' ``group``), block after block."""
    if not sessions:
        return workload

    def make_pass(index: int) -> Iterator[Request]:
        by_session: dict[str | None, list[Request]] = {}
        for request in workload.make_pass(index):
            by_session.setdefault(request.group, []).append(request)
        conversations = list(by_session.values())
        for start in range(0, len(conversations), sessions):
            block = conversations[start:start + sessions]
            for turn in range(max(len(c) for c in block)):
                yield from (c[turn] for c in block if turn < len(c))

    return replace(workload, make_pass=make_pass)
