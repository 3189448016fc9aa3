"""The simulator's engine: SGLang's continuous-batching scheduler in outline, one step at a time.

Each :meth:`Engine.step` picks what SGLang's event loop would run next (``shared/sglang-
reference.md`` §2.4 and §4.4/§4.5): a prefill batch if the waiting queue can admit anything,
otherwise one decode step of the running batch, and returns how long that forward pass takes
(:mod:`tuner.sim.costmodel`) with the tokens it produced. The caller owns time: it passes
``now_s`` in and waits out ``duration_s`` on its clock (real behind the HTTP server, virtual in
:mod:`tuner.sim.evaluate`); the events become visible at ``now_s + duration_s``.

Rules modelled (§2.4 unless noted):

- Admission (``PrefillAdder``): at most ``max_running_requests`` requests run; one prefill batch
  takes at most ``max_prefill_tokens`` new tokens, but its first request always gets in; with
  chunking on, at most ``chunked_prefill_size`` tokens per batch, a longer input is split into
  chunks over several steps. A request needs ``available + evictable − reserved`` to exceed its
  new input plus ``min(max_new_tokens, 4096)``, where every running request reserves
  ``min(max_new_tokens − generated, 4096) × new_token_ratio``.
- ``new_token_ratio`` starts at ``min(0.7 × schedule_conservativeness, 1)``, decays linearly to
  ``0.14 ×`` that over 600 decode steps, is raised again by a retraction, and returns to its
  initial value whenever the scheduler goes idle (``Scheduler.self_check_during_idle``).
- Decode: every running request gains one token per step (``accept_length`` on average with
  speculative decoding). When the pool (free + evictable) cannot hold the step's new tokens, the
  requests with the fewest generated tokens (longest input on ties) are retracted, freed and
  queued again until the rest fit, and the ratio becomes ``min(1, (decoded + 20 × running) /
  Σ max_new_tokens)`` (``ScheduleBatch.retract_decode``, ``python/sglang/srt/managers/
  schedule_batch.py``); the §4.4 line is logged in the mimicked version's format.
- ``enable_mixed_chunk``: running requests decode one token inside each prefill step.
- The first prefill batch of a freshly started server longer than SGLang's start-up warm-up
  (:data:`WARMUP_PREFILL_TOKENS`) takes ``cold_prefill_s`` longer
  (:class:`tuner.sim.costmodel.CostFactors`: the first real batch's shapes; fitted on the first
  bursts of the fidelity points, ``docs/simulator-fidelity.md``).
- ``schedule_policy``: ``fcfs`` keeps arrival order; ``lpm`` orders the queue by longest cached
  prefix, falling back to fcfs when more than 128 requests wait. Other policies act as fcfs.
- The radix cache (:mod:`tuner.sim.cache`) matches each request's input minus its last token,
  takes over the computed prefix after every prefill chunk, and the whole sequence when the
  request finishes; the hierarchical cache loads host hits back over PCIe (§7), which costs step
  time.
- Log lines (§4.5): a ``Prefill batch`` line per prefill batch and a ``Decode batch`` line every
  ``decode_log_interval`` decode steps, 0.5.5 format up to 0.5.10, 0.5.23 format from 0.5.16.
- Runtime OOM (§1.6, §4.4): when a step's activation bytes
  (:func:`tuner.sim.costmodel.activation_bytes`) exceed ``activation_headroom_bytes``, the step
  raises :class:`SimRuntimeOOM` carrying torch's out-of-memory text.
- Input checks (§1.4): ``max_req_len = min(context_len − 1, max_total_num_tokens − 1)``; a longer
  input of ``max_req_len − 5`` tokens or more is rejected, and ``max_new_tokens`` is clipped so that input and
  output fit ``max_req_len``.
- Stalls: when requests wait, nothing runs and the queue's head still cannot be admitted, nothing
  can ever change, so the step aborts that request instead of idling (the one stall detector the
  HTTP server, :meth:`Engine.run_until_idle` and :mod:`tuner.sim.evaluate` all rely on): its
  ``finish_reason`` is ``{"type": "abort", "message": "Input length (N tokens) exceeds the maximum
  allowed length (M tokens).", "status_code": 400, ...}`` (§1.4, §5.3), ``M`` being the longest
  input the idle pool could admit with that request's output reservation (0 when no chunk holds a
  page). With the clipping above
  and SGLang's ``chunked_prefill_size % page_size == 0`` check (enforced by :mod:`tuner.sim.args`)
  no valid command line reaches it; it keeps a driver from waiting forever if one ever does.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from tuner.sim import costmodel
from tuner.sim.cache import PrefixCache
from tuner.sim.clock import Clock
from tuner.sim.costmodel import CostInputs, StepShape
from tuner.sim.gpus import MIB
from tuner.sim.models import GIB
from tuner.sim.speculative import SpecModel, classify_ids

__all__ = [
    "WARMUP_PREFILL_TOKENS",
    "EngineSpec",
    "Engine",
    "SimRequest",
    "TokenEvent",
    "FinishEvent",
    "StepResult",
    "SimRuntimeOOM",
    "RequestRejected",
    "torch_oom_text",
]

CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096
"""Cap on the per-request output reservation (§2.4, ``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``)."""
NEW_TOKEN_RATIO_DECAY_STEPS = 600
"""Decode steps over which ``new_token_ratio`` decays to its minimum (§2.4)."""
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
"""``min_new_token_ratio = init × 0.14`` (§2.4)."""
RETRACT_DECODE_STEPS = 20
"""Decode steps of headroom a retraction aims for per remaining request."""
RECV_WEIGHT_OTHER = 1000
"""``SchedulerRecvSkipper``'s weight of a non-decode step (``_DEFAULT_WEIGHT``, 0.5.5): it always
lets the scheduler take in requests before the next step."""
LPM_FALLBACK_QUEUE_LEN = 128
"""``lpm`` falls back to fcfs above this many waiting requests (§2.4)."""


ABORT_STATUS_CODE = 400
"""``status_code`` of a scheduler abort for a bad request (``HTTPStatus.BAD_REQUEST``, §5.3)."""


class SimRuntimeOOM(Exception):
    """A forward step's activations did not fit the free GPU memory (torch's CUDA OOM, §4.4).

    Attributes:
        message: torch's ``torch.OutOfMemoryError: CUDA out of memory. ...`` text.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def torch_oom_text(tried_bytes: float, rank: int, total_bytes: int, free_bytes: float, used_by_process: float) -> str:
    """torch's ``CUDA out of memory`` exception text (§4.4), as ``torch.OutOfMemoryError`` prints it.

    Used for every simulated OOM: a runtime step here, and weight load, KV pool and CUDA-graph
    capture at startup (:mod:`tuner.sim.startup`).

    Args:
        tried_bytes: The allocation that failed, bytes.
        rank: The GPU index.
        total_bytes: The GPU's capacity, bytes.
        free_bytes: What was free, bytes (negative reads as 0).
        used_by_process: What this process holds, bytes.
    """
    free_bytes = max(0.0, free_bytes)
    tried = f"{tried_bytes / GIB:.2f} GiB" if tried_bytes >= GIB else f"{tried_bytes / MIB:.2f} MiB"
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU {rank} has a total "
        f"capacity of {total_bytes / GIB:.2f} GiB of which {free_bytes / MIB:.2f} MiB is free. Including "
        f"non-PyTorch memory, this process has {used_by_process / GIB:.2f} GiB memory in use. Of the "
        f"allocated memory {max(used_by_process - 0.5 * GIB, 0) / GIB:.2f} GiB is allocated by PyTorch, and "
        "20.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
        "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


class RequestRejected(ValueError):
    """A request SGLang would reject before scheduling (too long, empty, duplicate rid).

    The message is SGLang's text where it has one (§1.4, §4.4).
    """


@dataclass
class _LogWindow:
    """The decode log line's window: tokens generated since ``since_s`` (the first decode step
    after the last line; ``None`` before any), for its ``gen throughput (token/s)``."""

    tokens: int = 0
    since_s: float | None = None


@dataclass(frozen=True)
class SimRequest:
    """One generation request as the engine sees it.

    Attributes:
        rid: Unique request id.
        input_ids: Prompt token ids.
        max_new_tokens: Output limit, tokens.
        ignore_eos: True: generate exactly ``max_new_tokens``; False: stop at a simulated EOS
            drawn deterministically from the rid (uniform in ``1..max_new_tokens``).
        arrival_s: When the request arrived, on the driver's clock (seconds).
        prompt_class: ``chat`` / ``code`` for a text prompt (:mod:`tuner.sim.speculative`); None:
            classified from the ids (``raw`` or ``chat``).
        text: The prompt came as text, so the server's tokenizer manager tokenizes it (token ids
            skip that, :meth:`Engine.add_request`).
    """

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = True
    arrival_s: float = 0.0
    prompt_class: str | None = None
    text: bool = False


@dataclass(frozen=True)
class TokenEvent:
    """New output tokens of one request in a step (counts are cumulative)."""

    rid: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class FinishEvent:
    """A request finished in this step (after its last :class:`TokenEvent`).

    ``finish_reason`` is SGLang's dict: ``{"type": "length", "length": N}``,
    ``{"type": "stop", "matched": eos_id}``, or for a request the scheduler gave up on
    ``{"type": "abort", "message": ..., "status_code": 400, "err_type": "BadRequestError"}``
    (§5.3). ``cached_tokens_details`` is ``{"device": n, "host": m}`` when the hierarchical cache
    is on, else None. ``spec_verify_ct``: verify steps the request ran (speculative decoding, else 0).
    """

    rid: str
    finish_reason: dict
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: dict | None
    spec_verify_ct: int = 0

    @property
    def abort_message(self) -> str | None:
        """The error text of an aborted request (``finish_reason["message"]``), else None."""
        return self.finish_reason.get("message", "") if self.finish_reason.get("type") == "abort" else None


Event = TokenEvent | FinishEvent


@dataclass(frozen=True)
class StepResult:
    """What one :meth:`Engine.step` did: its forward-pass time and the resulting events."""

    duration_s: float
    events: list[Event] = field(default_factory=list)


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine needs, resolved from the server flags (by the startup sizing).

    Attributes:
        max_total_num_tokens: KV pool size, tokens (§1.2-1.4).
        max_running_requests: Effective limit (§2.3).
        chunked_prefill_size: Tokens per prefill chunk, None when chunking is off (§2.1).
        max_prefill_tokens: Token budget of one prefill batch (§2.4).
        page_size: Tokens per KV page (§2.4).
        schedule_policy: ``fcfs``, ``lpm``, ... (§2.4).
        schedule_conservativeness: Scales ``new_token_ratio`` (§2.4).
        enable_mixed_chunk: Decode inside prefill batches (§3.1).
        cuda_graph_max_bs: Largest captured decode batch; 0 when CUDA graphs are disabled.
        capture_bs: The captured decode batch sizes, ascending (§2.1); empty: every batch up to
            ``cuda_graph_max_bs`` counts as captured (a spec built by hand).
        cuda_graph_padding: A batch between captured sizes replays the next captured size's graph
            (SGLang's default); ``False`` (``--disable-cuda-graph-padding``): it runs eagerly.
        disable_radix_cache: No prefix reuse (§3.1).
        context_len: Model context length, tokens.
        hicache_host_tokens: Host-tier size, tokens; None without the hierarchical cache (§7).
        hicache_write_policy: ``write_through`` / ``write_through_selective`` / ``write_back``.
        activation_headroom_bytes: Free GPU memory after CUDA graphs, bytes (§1.6).
        cost: Cost-model inputs.
        version: SGLang version mimicked (log formats), e.g. ``"0.5.5"``.
        decode_log_interval: Decode steps between ``Decode batch`` lines (§2.4: 40).
        eos_token_id: Token id reported when a request stops on EOS.
        seed: Seed of the generated output token ids.
        speculative: The draft shape and model (per-request acceptance and step cost,
            :mod:`tuner.sim.speculative`); None: ``cost``'s mean accept length and step cost.
        scheduler_recv_interval: ``--scheduler-recv-interval``: during decode the scheduler takes
            in new requests every this many steps (see :meth:`Engine.step`).
        overlap_schedule: SGLang's overlap scheduler (on unless ``--disable-overlap-schedule`` or
            speculative decoding, 0.5.5 ``server_args.py``): while the GPU runs one batch the CPU
            has already chosen the next, so a request taken in while the GPU is busy joins the
            batch after next (see :meth:`Engine.step`). ``False`` in a spec built by hand.
    """

    max_total_num_tokens: int
    max_running_requests: int
    chunked_prefill_size: int | None
    max_prefill_tokens: int
    page_size: int
    schedule_policy: str
    schedule_conservativeness: float
    enable_mixed_chunk: bool
    cuda_graph_max_bs: int
    disable_radix_cache: bool
    context_len: int
    hicache_host_tokens: int | None
    hicache_write_policy: str
    activation_headroom_bytes: int
    cost: CostInputs
    version: str = "0.5.5"
    capture_bs: tuple[int, ...] = ()
    cuda_graph_padding: bool = True
    decode_log_interval: int = 40
    eos_token_id: int = 2
    seed: int = 0
    speculative: SpecModel | None = None
    scheduler_recv_interval: int = 1
    overlap_schedule: bool = False


WARMUP_PREFILL_TOKENS = 8
"""New tokens of a prefill batch that leaves a fresh server cold: SGLang's start-up warm-up (a
one-line prompt, 0.5.5 ``entrypoints/http_server.py`` ``_execute_server_warmup``; the simulated
server sends 8 ids) and the 1-token health checks do not run a real batch's shapes."""


def graph_batch(spec: EngineSpec, bs: int) -> int | None:
    """The captured size a decode batch of ``bs`` replays, or ``None`` when it runs eagerly (§2.1,
    ``CudaGraphRunner.can_run`` / ``replay_prepare``): above the largest captured size it runs
    eagerly; below it, padded up to the next captured size, or eagerly when it is not a captured
    size and padding is off."""
    if spec.cuda_graph_max_bs <= 0 or bs > spec.cuda_graph_max_bs:
        return None
    if not spec.capture_bs:
        return bs
    i = bisect.bisect_left(spec.capture_bs, bs)
    if i >= len(spec.capture_bs):
        return None
    size = spec.capture_bs[i]
    return size if spec.cuda_graph_padding or size == bs else None


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class _Req:
    """Scheduler-side state of one request."""

    __slots__ = (
        "rid", "input_ids", "n_in", "max_new", "stop_len", "ignore_eos", "arrival_s", "rng",
        "n_out", "out_ids", "fill", "fill_done", "kv_len", "tree_len", "node", "private", "cached_device",
        "cached_host", "admitted_once", "credit", "new_tokens", "finish_reason", "retractions", "accept",
        "verify_ct",
    )

    def __init__(self, req: SimRequest, max_new: int, seed: int) -> None:
        self.rid = req.rid
        self.input_ids = tuple(req.input_ids)
        self.n_in = len(self.input_ids)
        self.max_new = max_new
        self.ignore_eos = req.ignore_eos
        self.arrival_s = req.arrival_s
        h = zlib.crc32(req.rid.encode()) ^ (seed * 0x9E3779B1)
        self.rng = h & 0xFFFFFFFF or 1
        self.stop_len = max_new if req.ignore_eos or max_new <= 1 else 1 + h % max_new
        self.n_out = 0  # tokens generated so far
        self.out_ids: list[int] = []  # their ids, generated lazily up to n_out
        self.fill: tuple[int, ...] = self.input_ids
        self.fill_done = 0
        self.kv_len = 0
        self.tree_len = 0
        self.node = None
        self.private = 0
        self.cached_device = 0
        self.cached_host = 0
        self.admitted_once = False
        self.credit = 0.0
        self.new_tokens = 0
        self.finish_reason: dict | None = None
        self.retractions = 0
        self.accept = 1.0
        self.verify_ct = 0


class Engine:
    """SGLang's scheduler, simulated: admission, chunked prefill, decode, retraction, prefix cache.

    Args:
        spec: Resolved engine settings.
        log: Receives whole SGLang-format log messages (no timestamp or rank prefix).

    Not thread-safe: drive it from one thread or one event loop.
    """

    def __init__(self, spec: EngineSpec, log: Callable[[str], None] = lambda _msg: None) -> None:
        self.spec = spec
        self._log = log
        self._new_fmt = _version_tuple(spec.version) >= (0, 5, 16)
        self._retract_v10 = _version_tuple(spec.version) >= (0, 5, 10)
        self._page = max(1, spec.page_size)
        self._total = spec.max_total_num_tokens
        self.cache = PrefixCache(
            self._page,
            disabled=spec.disable_radix_cache,
            host_capacity_tokens=spec.hicache_host_tokens,
            write_policy=spec.hicache_write_policy if spec.hicache_host_tokens is not None else "write_through",
        )
        self._max_req_len = min(spec.context_len - 1, spec.max_total_num_tokens - 1)
        self._max_req_input_len = self._max_req_len - 5
        self._vocab_span = max(16, spec.cost.vocab_size - 16)
        self.init_new_token_ratio = min(0.7 * spec.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self._ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        self._intake: list[tuple[float, int, _Req]] = []  # (ready_s, order, req): on the request path
        self._intake_order = 0
        self._received: list[_Req] = []  # taken in during a busy step (overlap): queued at the next one
        self._recv_counter = 0  # SchedulerRecvSkipper's counter
        self._tokenizer_free_s = 0.0  # when the tokenizer manager finishes its queue
        self._cold = True  # no prefill batch has run yet (CostFactors.cold_prefill_s)
        self.idle_wait = False  # the last step only waited for a request on the request path
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._chunked: _Req | None = None
        self._rids: set[str] = set()
        self._private_total = 0
        self._running_kv = 0  # Σ kv_len over the running batch
        self._decode_steps = 0
        self._decode_log = _LogWindow()
        self._last_input_throughput = 0.0
        self._usage_at_admission = 0
        self.gen_throughput = 0.0
        self.cache_hit_rate = 0.0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.cached_tokens_total = 0
        self.num_requests_total = 0
        self.num_retractions_total = 0
        self.num_aborted_requests_total = 0
        self.peak_activation_bytes = 0
        self.spec_accepted_total = 0  # Σ tokens per request-step of the logged decode windows
        self.spec_forward_total = 0  # Σ request-steps of the logged decode windows
        self._spec_window = [0, 0]

    # ------------------------------------------------------------------ public API

    def add_request(self, req: SimRequest) -> None:
        """Queue a request.

        The request reaches the scheduler's waiting queue after the request path, at the first
        step that takes requests in (``scheduler_recv_interval``, see :meth:`step`). A text prompt
        first waits for the tokenizer manager, one process that tokenizes one request at a time
        (``tokenizer_worker_num`` 1, ``managers/tokenizer_manager.py`` ``_tokenize_texts`` calls the
        tokenizer synchronously, 0.5.5): ``tokenize_s_per_token`` per prompt token, in arrival
        order. Then the fixed ``request_path_s`` (HTTP, the ZMQ hop, the first token's way back
        through the detokenizer: for TTFT and a closed loop only the sum matters, so all of it is
        charged before scheduling). Factors: :class:`tuner.sim.costmodel.CostFactors`.

        Raises:
            RequestRejected: Empty input, a duplicate rid, or an input longer than SGLang's
                ``max_req_input_len`` (§1.4), with SGLang's message.
        """
        n = len(req.input_ids)
        if n == 0:
            raise RequestRejected("The input_ids is empty. Please send at least one token.")
        if req.rid in self._rids:
            raise RequestRejected(f"Duplicate request id {req.rid!r}: every request needs a unique rid.")
        if n >= self._max_req_input_len:
            raise RequestRejected(
                f"Input length ({n} tokens) exceeds the maximum allowed length ({self._max_req_input_len} tokens)."
            )
        max_new = max(0, min(req.max_new_tokens, self._max_req_len - n - 1))
        r = _Req(req, max_new, self.spec.seed)
        r.accept = self.spec.cost.spec_accept_length
        if self.spec.speculative is not None:
            r.accept = self.spec.speculative.request_accept_length(
                req.prompt_class or classify_ids(req.input_ids), req.rid)
        self._rids.add(r.rid)
        f = self.spec.cost.factors
        if req.text:  # the tokenizer manager is one queue (arrival order = call order)
            self._tokenizer_free_s = max(req.arrival_s, self._tokenizer_free_s) + f.tokenize_s_per_token * n
            ready = self._tokenizer_free_s + f.request_path_s
        else:
            ready = req.arrival_s + f.request_path_s
        self._intake_order += 1
        bisect.insort(self._intake, (ready, self._intake_order, r))

    def abort(self, rid: str) -> bool:
        """Drop a request wherever it is, freeing its KV cells.

        Returns:
            True if the request was found.
        """
        for i, (_, _, r) in enumerate(self._intake):
            if r.rid == rid:
                del self._intake[i]
                self._rids.discard(rid)
                self.num_aborted_requests_total += 1
                return True
        for queue in (self._received, self._waiting, self._running):
            for i, r in enumerate(queue):
                if r.rid == rid:
                    del queue[i]
                    if queue is self._running:
                        self._running_kv -= r.kv_len
                    self._release(r)
                    self._rids.discard(rid)
                    self.num_aborted_requests_total += 1
                    return True
        if self._chunked is not None and self._chunked.rid == rid:
            self._release(self._chunked)
            self._chunked = None
            self._rids.discard(rid)
            self.num_aborted_requests_total += 1
            return True
        return False

    def flush_cache(self) -> bool:
        """Empty the prefix cache (both tiers), as ``/flush_cache`` does (§5.4).

        Returns:
            False, doing nothing, while requests are waiting or running.
        """
        if self.has_work():
            return False
        self.cache.reset()
        return True

    def has_work(self) -> bool:
        """Whether any request is waiting, prefilling or decoding."""
        return bool(self._intake or self._received or self._waiting or self._running or self._chunked is not None)

    def stats(self) -> dict:
        """Scheduler gauges and counters (E1 exposes them under the §5.5 names).

        Returns:
            ``num_running_reqs``, ``num_queue_reqs``, ``num_used_tokens``, ``token_usage``,
            ``gen_throughput``, ``cache_hit_rate``, ``new_token_ratio``, ``max_total_num_tokens``,
            ``hicache_host_used_tokens``, ``evictable_tokens`` (radix-cached, unreferenced KV tokens), ``hicache_host_total_tokens``,
            ``peak_activation_bytes`` (the largest step's activation bytes per GPU since start,
            :func:`tuner.sim.costmodel.activation_bytes`; CUDA-graph decode steps run inside the
            captured graphs' memory and add none) and the counters ``prompt_tokens_total``,
            ``generation_tokens_total``, ``cached_tokens_total``, ``num_requests_total``,
            ``num_retractions_total``, ``num_aborted_requests_total`` (aborted by the client or
            the scheduler), ``evicted_tokens_total``, ``load_back_tokens_total``.
        """
        used = self._used_tokens()
        return {
            "num_running_reqs": len(self._running) + (1 if self._chunked is not None else 0),
            "num_queue_reqs": len(self._waiting) + len(self._received),
            "num_used_tokens": used,
            "token_usage": used / self._total if self._total else 0.0,
            "gen_throughput": self.gen_throughput,
            "cache_hit_rate": self.cache_hit_rate,
            "new_token_ratio": self.new_token_ratio,
            "max_total_num_tokens": self._total,
            "hicache_host_used_tokens": self.cache.host_used_tokens,
            "evictable_tokens": self.cache.evictable_tokens,
            "hicache_host_total_tokens": self.spec.hicache_host_tokens or 0,
            "peak_activation_bytes": self.peak_activation_bytes,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "num_requests_total": self.num_requests_total,
            "num_retractions_total": self.num_retractions_total,
            "num_aborted_requests_total": self.num_aborted_requests_total,
            "evicted_tokens_total": self.cache.evicted_tokens_total,
            "load_back_tokens_total": self.cache.load_back_tokens_total,
        }

    def step(self, now_s: float) -> StepResult:
        """Run the next forward step (a prefill batch, else a decode step), if there is one.

        Args:
            now_s: When the step starts, seconds on the driver's clock.

        Returns:
            The step's duration (0 when idle or when it only aborted a request that can never
            be admitted) and its events, which happen at ``now_s + duration_s``: a
            :class:`TokenEvent` per request that got tokens, then a :class:`FinishEvent` per
            finished or aborted request. While :meth:`has_work` is true, every step has a
            duration or an event; when the only work is requests still on the request path, the
            step is a wait until the first of them reaches the scheduler (no events,
            :attr:`idle_wait` true).

        Intake follows SGLang's ``SchedulerRecvSkipper`` (``managers/scheduler_recv_skipper.py``,
        0.5.5): with ``--scheduler-recv-interval N > 1`` a decode step adds 1 to a counter, any
        other step 1000, and the scheduler takes in new requests only when the counter reaches
        ``N`` (then resets it); an idle scheduler loops in microseconds, so it takes them in at once.
        With the overlap scheduler (``event_loop_overlap``: each loop takes requests in, launches the
        next batch, then waits for the previous one), a request taken in while a batch runs is
        scheduled one batch later: it waits for the running step and the next one.

        Raises:
            SimRuntimeOOM: The step's activations exceed the free memory; the engine is then dead.
        """
        duration_s, token_reqs, finished = self._step(now_s)
        events: list[Event] = []
        for r in token_reqs:
            k = r.new_tokens
            ids = self._materialize(r)[r.n_out - k : r.n_out] if k else []
            events.append(TokenEvent(r.rid, ids, r.n_in, r.n_out, r.cached_device + r.cached_host))
        for r in finished:
            events.append(self._finish_event(r))
        return StepResult(duration_s, events)

    def run_until_idle(self, clock: Clock, *, timeout_s: float) -> list[tuple[float, Event]]:
        """Step until no request is left, waiting out each step on ``clock``.

        Args:
            clock: :class:`~tuner.sim.clock.RealClock` (really waits) or
                :class:`~tuner.sim.clock.VirtualClock` (jumps).
            timeout_s: Give up when this much clock time has passed.

        Returns:
            Every event with the clock time it became visible, seconds.

        Raises:
            TimeoutError: Work is left after ``timeout_s``.
            SimRuntimeOOM: A step ran out of activation memory.

        A request that can never be admitted comes back as an aborted :class:`FinishEvent`
        (the engine's stall rule), so the loop ends on a virtual clock too.
        """
        start = clock.now_s()
        out: list[tuple[float, Event]] = []
        while self.has_work():
            now = clock.now_s()
            if now - start > timeout_s:
                raise TimeoutError(f"engine still busy after {timeout_s} s of clock time")
            result = self.step(now)
            clock.sleep(result.duration_s)
            t = clock.now_s()
            out.extend((t, ev) for ev in result.events)
        return out

    # ------------------------------------------------------------------ accounting

    def _free(self) -> int:
        return self._total - self.cache.device_tokens - self._private_total

    def _used_tokens(self) -> int:
        return self._total - self._free() - self.cache.evictable_tokens

    def _pages(self, n: int) -> int:
        p = self._page
        return -(-n // p) * p

    def _alloc(self, n: int) -> bool:
        """Make ``n`` device cells free (evicting the cache if needed) and take them."""
        free = self._free()
        if free < n:
            self.cache.evict(n - free)
            if self._free() < n:
                return False
        self._private_total += n
        return True

    def _release(self, r: _Req) -> None:
        """Free a request's private cells and unlock its cached prefix (no insertion)."""
        self._private_total -= r.private
        r.private = 0
        if r.node is not None:
            self.cache.unlock(r.node)
            r.node = None
        r.tree_len = 0

    def _cache_prefix(self, r: _Req, tokens: tuple[int, ...], chunked: bool = False) -> None:
        """Hand the page-aligned computed prefix ``tokens`` of ``r`` to the radix tree."""
        if self.cache.disabled:
            return
        aligned = len(tokens) - len(tokens) % self._page
        if aligned <= r.tree_len:
            return
        _, node = self.cache.insert(tokens[:aligned], chunked=chunked)
        self.cache.lock(node)
        if r.node is not None:
            self.cache.unlock(r.node)
        r.node = node
        moved = aligned - r.tree_len
        r.private -= moved
        self._private_total -= moved
        r.tree_len = aligned

    def _materialize(self, r: _Req) -> list[int]:
        """Generate the ids of ``r``'s output tokens up to ``n_out`` (deterministic per rid and seed).

        A request that stops early (``ignore_eos`` False) ends with ``eos_token_id``.
        """
        out = r.out_ids
        if len(out) < r.n_out:
            rng = r.rng
            span = self._vocab_span
            eos_at = r.stop_len - 1 if r.stop_len < r.max_new else -1
            for i in range(len(out), r.n_out):
                rng = (rng * 1103515245 + 12345) & 0x7FFFFFFF
                out.append(self.spec.eos_token_id if i == eos_at else 16 + (rng >> 4) % span)
            r.rng = rng
        return out

    def _emit(self, r: _Req, n: int) -> None:
        """Count ``n`` generated tokens for ``r`` and mark it finished when it reaches its end."""
        n = min(n, r.stop_len - r.n_out)
        r.n_out += n
        r.new_tokens = n
        self.generation_tokens_total += n
        if r.n_out >= r.stop_len:
            self._set_finish_reason(r)

    def _set_finish_reason(self, r: _Req) -> None:
        if r.n_out >= r.max_new:
            r.finish_reason = {"type": "length", "length": r.max_new}
        else:
            r.finish_reason = {"type": "stop", "matched": self.spec.eos_token_id}

    def _finish(self, r: _Req) -> None:
        """Cache the finished sequence's KV, free the rest, count the request."""
        if r.kv_len > r.n_in:
            kv_tokens = r.input_ids + tuple(self._materialize(r)[: r.kv_len - r.n_in])
        else:
            kv_tokens = r.input_ids[: r.kv_len]
        self._cache_prefix(r, kv_tokens)
        self._release(r)
        self._rids.discard(r.rid)
        self.prompt_tokens_total += r.n_in
        self.cached_tokens_total += r.cached_device + r.cached_host
        self.num_requests_total += 1

    def _finish_event(self, r: _Req) -> FinishEvent:
        details = {"device": r.cached_device, "host": r.cached_host} if self.cache.hierarchical else None
        return FinishEvent(
            r.rid, r.finish_reason or {"type": "length", "length": r.max_new}, r.n_in, r.n_out,
            r.cached_device + r.cached_host, details, r.verify_ct,
        )

    # ------------------------------------------------------------------ scheduling

    def _step(self, now_s: float) -> tuple[float, list[_Req], list[_Req]]:
        """:meth:`step` without event objects (for :mod:`tuner.sim.evaluate`'s hot loop).

        Returns:
            ``(duration_s, requests that got tokens (``new_tokens`` each), finished requests)``.
        """
        self.idle_wait = False
        self._receive(now_s)
        batch = self._get_new_prefill_batch()
        if batch is not None:
            result = self._run_prefill(now_s, *batch)
            self._recv_counter += RECV_WEIGHT_OTHER
        elif self._running:
            result = self._run_decode(now_s)
            self._recv_counter += 1
        elif self._waiting or self._chunked is not None:  # stalled: nothing runs, nothing fits
            result = (0.0, [], [self._abort_stalled()])
        elif self._intake:  # idle until the next request reaches the scheduler
            self.idle_wait = True
            result = (max(0.0, self._intake[0][0] - now_s), [], [])
        else:
            result = (0.0, [], [])
        if not self._running and self._chunked is None and not self._waiting:
            self.new_token_ratio = self.init_new_token_ratio  # the scheduler's idle self-check
        return result

    def _receive(self, now_s: float) -> None:
        """Move the requests whose request path has ended into the waiting queue, when the
        scheduler takes in requests this step (``SchedulerRecvSkipper.handle``); with the overlap
        scheduler and a busy GPU, into the queue of the next step."""
        if self._received:
            self._waiting.extend(self._received)
            self._received = []
        if self.spec.scheduler_recv_interval > 1:
            if self._recv_counter < self.spec.scheduler_recv_interval and self._running:
                return  # an idle scheduler loops in microseconds: it takes requests in at once
            self._recv_counter = 0
        if not self._intake or self._intake[0][0] > now_s:
            return
        i = bisect.bisect_right(self._intake, (now_s, float("inf")))
        busy = self._running or self._chunked is not None
        (self._received if self.spec.overlap_schedule and busy else self._waiting).extend(r for _, _, r in self._intake[:i])
        del self._intake[:i]

    def _abort_stalled(self) -> _Req:
        """Abort the request that blocks an idle scheduler (see the module docstring, §1.4).

        Called when requests wait, none runs and admission took none: the cache holds no locked
        node and the pool is as free as it will ever be, so the head of the queue (or the
        request mid-chunk) can never run and would block everything behind it.
        """
        if self._chunked is not None:
            r, self._chunked = self._chunked, None
        else:
            r = self._queue_order()[0]
            self._waiting = [w for w in self._waiting if w is not r]
        self._release(r)
        self._rids.discard(r.rid)
        self.num_aborted_requests_total += 1
        # An idle pool admits an input when input + reservation < pool (§2.4); none when no chunk
        # holds a whole page.
        fits = self._total - min(r.max_new - r.n_out, CLIP_MAX_NEW_TOKENS_ESTIMATION)
        chunk = self.spec.chunked_prefill_size
        if chunk is not None and chunk < self._page:
            fits = 0
        limit = max(0, min(self._max_req_input_len, fits))
        r.finish_reason = {
            "type": "abort",
            "message": f"Input length ({r.n_in} tokens) exceeds the maximum allowed length ({limit} tokens).",
            "status_code": ABORT_STATUS_CODE,
            "err_type": "BadRequestError",
        }
        return r

    def _queue_order(self) -> list[_Req]:
        if self.spec.schedule_policy == "lpm" and len(self._waiting) <= LPM_FALLBACK_QUEUE_LEN and not self.cache.disabled:
            scored = [(self.cache.match_prefix(r.fill[:-1]).device_tokens, i, r) for i, r in enumerate(self._waiting)]
            scored.sort(key=lambda t: (-t[0], t[1]))
            return [r for _, _, r in scored]
        return list(self._waiting)

    def _get_new_prefill_batch(self) -> tuple[list[tuple[_Req, int, int]], int, int] | None:  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
        """Admit requests as SGLang's ``PrefillAdder`` does; returns (batch, cached, load_back)."""
        if not self._waiting and self._chunked is None:
            return None
        spec = self.spec
        n_running = len(self._running)
        if n_running >= spec.max_running_requests and self._chunked is None:
            return None
        mixed = spec.enable_mixed_chunk and n_running > 0
        ratio = self.new_token_ratio
        clip = CLIP_MAX_NEW_TOKENS_ESTIMATION
        offset = 0.0
        if self._waiting:
            offset = sum(min(r.max_new - r.n_out, clip) for r in self._running) * ratio
        rem_input = spec.max_prefill_tokens - (n_running if mixed else 0)
        rem_chunk = spec.chunked_prefill_size
        if rem_chunk is not None and mixed:
            rem_chunk -= n_running
        batch: list[tuple[_Req, int, int]] = []  # (req, prefix_before, extend tokens)
        self._usage_at_admission = self._used_tokens()
        cached = 0
        load_back = 0
        page = self._page

        chunked = self._chunked
        if chunked is not None:
            ext = len(chunked.fill) - chunked.fill_done
            take = ext
            if rem_chunk is not None and ext > rem_chunk:
                take = max(page, rem_chunk // page * page)
            if not self._alloc(self._pages(chunked.fill_done + take) - self._pages(chunked.fill_done)):
                return None
            chunked.private += self._pages(chunked.fill_done + take) - self._pages(chunked.fill_done)
            batch.append((chunked, chunked.fill_done, take))
            rem_input -= take
            if rem_chunk is not None:
                rem_chunk -= take
            if take < ext:
                return batch, cached, load_back
            self._chunked = None
            offset += min(chunked.max_new - chunked.n_out, clip)

        admitted: list[_Req] = []
        for r in self._queue_order():
            if n_running + len(batch) >= spec.max_running_requests:
                break
            if rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
                break
            if self._free() + self.cache.evictable_tokens - offset <= 0:
                break
            m = self.cache.match_prefix(r.fill[:-1])
            use_host = self.cache.hierarchical and m.host_tokens >= self.cache.load_back_threshold
            prefix = m.device_tokens + (m.host_tokens if use_host else 0)
            ext = len(r.fill) - prefix
            reserve = min(r.max_new - r.n_out, clip)
            lock_node = m.last_node if use_host else m.device_node
            self.cache.lock(lock_node)
            rem_total = self._free() + self.cache.evictable_tokens - offset
            if ext + reserve + (m.host_tokens if use_host else 0) >= rem_total:
                self.cache.unlock(lock_node)
                break
            if self._pages(ext) >= rem_input and batch:
                self.cache.unlock(lock_node)
                break
            if rem_chunk is None or self._pages(ext) <= rem_chunk:
                take = ext
            else:
                take = rem_chunk // page * page
                if take <= 0:
                    self.cache.unlock(lock_node)
                    break
            host_loaded = 0
            if use_host:
                if not self._alloc(m.host_tokens):
                    self.cache.unlock(lock_node)
                    break
                self._private_total -= m.host_tokens  # the cells now belong to the tree
                host_loaded = self.cache.load_back(m)
            need = self._pages(prefix + take) - prefix
            if not self._alloc(need):
                self.cache.unlock(lock_node)
                break
            r.node = lock_node
            r.tree_len = prefix
            r.private = need
            r.fill_done = prefix
            r.kv_len = prefix
            if not r.admitted_once:
                r.admitted_once = True
                r.cached_device = m.device_tokens
                r.cached_host = host_loaded
            cached += prefix
            load_back += host_loaded
            batch.append((r, prefix, take))
            admitted.append(r)
            rem_input -= take
            if rem_chunk is not None:
                rem_chunk -= take
            if take < ext:
                self._chunked = r
                break
            offset += reserve
        if admitted:
            gone = set(map(id, admitted))
            self._waiting = [r for r in self._waiting if id(r) not in gone]
        if not batch:
            return None
        return batch, cached, load_back

    def _check_activations(self, num_tokens: int, num_seqs: int) -> None:
        """Record the step's activation bytes; raise torch's OOM when they exceed the headroom."""
        act = costmodel.activation_bytes(self.spec.cost, num_tokens, num_seqs)
        headroom = self.spec.activation_headroom_bytes
        if act > headroom:
            total = self.spec.cost.gpu_memory_bytes
            raise SimRuntimeOOM(torch_oom_text(act, 0, total, headroom, max(0, total - max(0, headroom))))
        if act > self.peak_activation_bytes:
            self.peak_activation_bytes = act

    def _run_prefill(
        self, now_s: float, batch: list[tuple[_Req, int, int]], cached: int, load_back: int
    ) -> tuple[float, list[_Req], list[_Req]]:
        spec = self.spec
        n_running = len(self._running)
        new_tokens = sum(take for _, _, take in batch)
        used = self._usage_at_admission  # SGLang logs before the batch's cells are allocated
        parts = [
            f"Prefill batch, #new-seq: {len(batch)}, #new-token: {new_tokens}, #cached-token: {cached}, "
            f"token usage: {used / self._total:.2f}, #running-req: {n_running}, #queue-req: {len(self._waiting)}, "
        ]
        if self._new_fmt:
            pending = (len(self._chunked.fill) - self._chunked.fill_done - batch[-1][2]) if self._chunked is not None else 0
            parts.append(
                f"#pending-token: {max(0, pending)}, cuda graph: False, "
                f"input throughput (token/s): {self._last_input_throughput:.2f}"
            )
        self._log("".join(parts))
        self.cache_hit_rate = cached / (cached + new_tokens) if cached + new_tokens else 0.0

        pairs = 0.0
        kv_read = 0
        for _, prefix, take in batch:
            pairs += take * prefix + take * (take + 1) / 2
            kv_read += prefix + take
        tokens = new_tokens
        seqs = len(batch)
        mixed_reqs: list[_Req] = []
        if spec.enable_mixed_chunk and self._running and self._decode_alloc(self._running):
            mixed_reqs = self._running
            tokens += n_running
            seqs += n_running
            pairs += self._running_kv
            kv_read += self._running_kv
        self._check_activations(tokens, seqs)
        duration = costmodel.step_time_s(spec.cost, StepShape(tokens, seqs, pairs, kv_read, True, extend=True))
        if self._cold and new_tokens > WARMUP_PREFILL_TOKENS:  # the server's first real batch (module docstring)
            duration += spec.cost.factors.cold_prefill_s
            self._cold = False
        if load_back:
            duration = max(duration, costmodel.load_back_s(spec.cost, load_back))
        self._last_input_throughput = new_tokens / duration if duration > 0 else 0.0

        token_reqs: list[_Req] = []
        finished: list[_Req] = []
        if mixed_reqs:
            token_reqs, finished = self._advance_decode(mixed_reqs)
        for r, _prefix, take in batch:
            r.fill_done += take
            r.kv_len = r.fill_done
            self._cache_prefix(r, r.fill[: r.fill_done], chunked=r.fill_done < len(r.fill))
            if r.fill_done < len(r.fill):
                r.new_tokens = 0
                continue
            if r.max_new <= 0:
                r.new_tokens = 0
                r.finish_reason = {"type": "length", "length": 0}
                self._finish(r)
                finished.append(r)
                continue
            self._emit(r, 1)
            token_reqs.append(r)
            if r.finish_reason is not None:
                self._finish(r)
                finished.append(r)
            else:
                self._running.append(r)
                self._running_kv += r.kv_len
        return duration, token_reqs, finished

    def _decode_alloc(self, reqs: list[_Req]) -> bool:
        """Allocate the KV cells of one decode step for ``reqs`` (False if they do not fit)."""
        page = self._page
        if page == 1 and not self.spec.cost.speculative:
            need = len(reqs)
            if not self._alloc(need):
                return False
            for r in reqs:
                r.private += 1
            return True
        grow = []
        need = 0
        for r in reqs:
            k = self._tokens_this_step(r)
            extra = self._pages(r.kv_len + k) - self._pages(r.kv_len)
            grow.append(extra)
            need += extra
        if not self._alloc(need):
            return False
        for r, extra in zip(reqs, grow, strict=True):
            r.private += extra
        return True

    def _tokens_this_step(self, r: _Req) -> int:
        c = self.spec.cost
        if not c.speculative:
            return 1
        return max(1, min(int(r.credit + r.accept), c.spec_num_draft_tokens))

    def _advance_decode(self, reqs: list[_Req]) -> tuple[list[_Req], list[_Req]]:
        """Each request in ``reqs`` (cells already allocated) gains its step's tokens."""
        c = self.spec.cost
        finished: list[_Req] = []
        added = 0
        if c.speculative:
            for r in reqs:
                k = self._tokens_this_step(r)  # as _decode_alloc allocated it
                r.credit += r.accept - k
                r.verify_ct += 1
                self._spec_window[0] += k
                r.kv_len += k
                added += k
                self._emit(r, k)
                if r.finish_reason is not None:
                    finished.append(r)
        else:  # the hot loop of every decode step: one token each
            for r in reqs:
                r.kv_len += 1
                r.n_out += 1
                r.new_tokens = 1
                if r.n_out >= r.stop_len:
                    self._set_finish_reason(r)
                    finished.append(r)
            added = len(reqs)
            self.generation_tokens_total += added
        if c.speculative:
            self._spec_window[1] += len(reqs)
        self._running_kv += added
        self._decode_log.tokens += added
        if finished:
            done = set(map(id, finished))
            self._running = [r for r in self._running if id(r) not in done]
            for r in finished:
                self._running_kv -= r.kv_len
                self._finish(r)
        return list(reqs), finished

    def _retract(self) -> None:
        """Retract running requests until one decode step fits (§4.4)."""
        if self.spec.cost.speculative:  # SGLang keeps the batch order and retracts from the back
            order = list(self._running)
        else:
            order = sorted(self._running, key=lambda r: (r.n_out, -r.n_in), reverse=True)
        retracted: list[_Req] = []
        freed_before = self._free() + self.cache.evictable_tokens
        while True:
            need = sum(self._pages(r.kv_len + 1) - self._pages(r.kv_len) for r in order) if self._page > 1 else len(order)
            if retracted and (self._free() + self.cache.evictable_tokens >= need or len(order) <= 1):
                break
            if len(order) <= 1:
                break
            r = order.pop()
            self._release(r)
            self._running_kv -= r.kv_len
            r.fill = r.input_ids + tuple(self._materialize(r))
            r.fill_done = r.kv_len = 0
            r.retractions += 1
            retracted.append(r)
        if not retracted:
            return
        gained = self._free() + self.cache.evictable_tokens - freed_before
        gone = set(map(id, retracted))
        self._running = [r for r in self._running if id(r) not in gone]
        self._waiting.extend(retracted)
        self.num_retractions_total += len(retracted)
        want = len(self._running) * RETRACT_DECODE_STEPS
        if self._free() < want:
            self.cache.evict(want - self._free())
        decoded = sum(r.n_out for r in self._running)
        max_new = sum(r.max_new for r in self._running) or 1
        old = self.new_token_ratio
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self._running)) / max_new)
        if self._retract_v10:
            self._log(
                f"KV cache pool is full. Retract requests. #retracted_reqs: {len(retracted)}, "
                f"#new_tokens_gained: {gained}, #new_token_ratio: {old:.4f} -> {self.new_token_ratio:.4f}"
            )
        else:
            self._log(
                f"KV cache pool is full. Retract requests. #retracted_reqs: {len(retracted)}, "
                f"#new_token_ratio: {old:.4f} -> {self.new_token_ratio:.4f}"
            )

    def _run_decode(self, now_s: float) -> tuple[float, list[_Req], list[_Req]]:
        spec = self.spec
        if not self._decode_alloc(self._running):
            self._retract()
            if not self._decode_alloc(self._running):
                raise RuntimeError(
                    "Decode out of memory. Try to lower your batch size.\n"
                    f"Try to allocate {len(self._running)} tokens.\nAvailable tokens: {self._free()}"
                )
        bs = len(self._running)
        # DP attention: each rank replays the graph of the busiest rank's batch, ceil(bs / dp)
        # (0.5.5 cuda_graph_runner.py can_run: max(global_num_tokens_cpu) under the MLP gather);
        # the gathered MoE/linear rows are dp × that size
        dp = max(1, spec.cost.dp_size)
        rank_graph = graph_batch(spec, -(-bs // dp))
        graph = None if rank_graph is None else rank_graph * dp
        eager = graph is None
        if eager:
            self._check_activations(bs * (spec.cost.spec_num_draft_tokens if spec.cost.speculative else 1), bs)
        if spec.speculative is not None and spec.cost.speculative:
            duration = spec.speculative.decode_step_s(spec.cost, bs, self._running_kv, eager=eager, padded_bs=graph)
        else:
            duration = costmodel.decode_step_s(spec.cost, bs, self._running_kv, eager=eager, padded_bs=graph)
        running_before = self._running
        log = self._decode_log
        log.since_s = now_s if log.since_s is None else log.since_s
        token_reqs, finished = self._advance_decode(running_before)
        self._decode_steps += 1
        self.new_token_ratio = max(self.min_new_token_ratio, self.new_token_ratio - self._ratio_decay)
        if self._decode_steps % max(1, spec.decode_log_interval) == 0:
            end_s = now_s + duration
            elapsed = end_s - log.since_s
            self.gen_throughput = log.tokens / elapsed if elapsed > 0 else 0.0
            log.tokens, log.since_s = 0, end_s
            self._log_decode(bs, not eager)
        return duration, token_reqs, finished

    def _log_decode(self, bs: int, cuda_graph: bool) -> None:
        used = self._used_tokens()
        spec_part = ""
        c = self.spec.cost
        if c.speculative:
            tokens, steps = self._spec_window
            self._spec_window = [0, 0]
            self.spec_accepted_total += tokens
            self.spec_forward_total += steps
            length = tokens / steps if steps else c.spec_accept_length
            spec_part = f"accept len: {length:.2f}, accept rate: {length / c.spec_num_draft_tokens:.2f}, "
        msg = (
            f"Decode batch, #running-req: {bs}, #token: {used}, token usage: {used / self._total:.2f}, "
            f"{spec_part}cuda graph: {cuda_graph}, gen throughput (token/s): {self.gen_throughput:.2f}, "
            f"#queue-req: {len(self._waiting)}, "
        )
        self._log(msg[:-2] if self._new_fmt else msg)
