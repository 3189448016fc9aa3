"""The simulator's HTTP server (aiohttp) and the real-time driver of the engine.

It speaks SGLang's HTTP API (``shared/sglang-reference.md`` §5): health, server and model info,
``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` with SSE streaming, ``/metrics``
(§5.5 names, only with ``--enable-metrics``), ``/flush_cache``; plus ``GET /sim/device_memory``,
the per-GPU ledger that stands in for NVML, and ``GET /sim/step_times``. One asyncio task drives :class:`tuner.sim.engine.Engine`: it runs a step,
waits its ``duration_s`` of real time, then hands the step's events to the waiting requests; it
sleeps on an event while idle. A request the engine can never admit comes back at once as an
abort (the engine's stall rule) and is answered with SGLang's 400 error (§1.4, §5.3), so the
driver never waits on work that cannot run. A runtime OOM raised by a step prints torch's text and
``Scheduler hit an exception`` and kills the process (§4.4).

Text prompts are tokenized by a trivial deterministic tokenizer: one token per
whitespace-separated word (``crc32(word) % vocab_size``); outputs are generated token ids shown
as made-up words.
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psutil
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tuner.sim.answers import NumericsFault, answer
from tuner.sim.args import VERSIONS
from tuner.sim.engine import (
    ABORT_STATUS_CODE,
    Engine,
    FinishEvent,
    RequestRejected,
    SimRequest,
    SimRuntimeOOM,
    TokenEvent,
)
from tuner.sim.gpus import MIB
from tuner.sim.memory import MemoryPlan
from tuner.sim.models import GIB
from tuner.sim.speculative import TextIds, classify_text
from tuner.sim.startup import SimLogger, engine_spec, kill_process_tree

__all__ = ["SimServer", "tokenize", "detokenize"]

_WORDS = ("the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
          "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
          "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has",
          "there", "been", "if", "more", "when", "will", "would", "who", "so", "no")

MAX_CATCH_UP_S = 0.05
"""How far behind its timeline the driver may start a step (seconds) to absorb a late wake-up."""

IDLE_POLL_S = 0.002
"""How long the driver waits if a step with work left did nothing (seconds); the engine's stall rule
makes that impossible, so this only bounds the damage of a bug."""

HEALTH_CHECK_TIMEOUT_S = 20.0
"""``SGLANG_HEALTH_CHECK_TIMEOUT`` (§5.1)."""

FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
              "waiting requests, the operation will not be performed.)")
"""``/flush_cache``'s body (§5.4)."""


def tokenize(text: str, vocab_size: int) -> list[int]:
    """The simulator's tokenizer: one id per whitespace-separated word, ``crc32(word) % vocab``."""
    return [zlib.crc32(w.encode()) % vocab_size for w in text.split()]


def detokenize(token_ids: list[int]) -> str:
    """Made-up text for generated ids: one word per id, each with a leading space."""
    return "".join(" " + _WORDS[t % len(_WORDS)] for t in token_ids)


class _Update(NamedTuple):
    """What a step produced for one request: new ids, cumulative counts, finish reason if done."""

    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish: FinishEvent | None


@dataclass
class _Pending:
    """One request in flight: its events queue and timing."""

    rid: str
    prompt_tokens: int
    start_s: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_token_s: float | None = None
    last_token_s: float | None = None
    text: str = ""
    out_ids: list[int] = field(default_factory=list)
    direct: tuple[asyncio.Transport, Callable[[_Update], bytes]] | None = None
    done: asyncio.Future | None = None


class SimServer:
    """The HTTP server and engine driver of one simulated SGLang instance.

    Args:
        plan: The startup ledger (a successful one).
        log: The logger (stderr, SGLang format).
        seed: Seed of generated tokens.
        skip_warmup: Mimic ``--skip-server-warmup``.
        numerics_fault: A planted numerics fault (``--sim-numerics-fault``): greedy answers break
            when the launch matches it (:mod:`tuner.sim.answers`).
        no_logprobs: ``--sim-no-logprobs``: answers carry no ``output_token_logprobs``.
        scheduler: Scheduler generation (``--sim-scheduler``): its CPU cost per step.
    """

    def __init__(self, plan: MemoryPlan, log: SimLogger, *, seed: int = 0, skip_warmup: bool = False,
                 numerics_fault: NumericsFault | None = None, no_logprobs: bool = False,
                 scheduler: str = "0.5") -> None:
        self.plan = plan
        self.answering = (numerics_fault, no_logprobs)  # how /generate answers: the fault, logprobs left out
        self.cfg = plan.config
        self.log = log
        self.skip_warmup = skip_warmup
        self.engine = Engine(engine_spec(plan, seed, scheduler), log=lambda msg: log.line(msg, 0))
        self.version = self.cfg.version
        self.ready = False
        self.startup_s = 0.0
        self._pending: dict[str, _Pending] = {}
        self._wake: asyncio.Event | None = None
        self._t0 = time.monotonic()
        self._events_seen = 0
        self._progress: asyncio.Event | None = None
        self._step_log: list[tuple[float, float]] = []
        # SGLang's multiprocess collector emits no ``*_created`` series (§5.5); neither does the simulator.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self._hist = self._make_histograms() if self.cfg.enable_metrics else None
        if self.cfg.enable_metrics:
            self.registry.register(_SchedulerCollector(self))
        self.app = self._make_app()

    # ------------------------------------------------------------------ app

    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._access_log], client_max_size=64 * 1024 * 1024)
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for old, new, handler in (("/get_server_info", "/server_info", self.server_info),
                                  ("/get_model_info", "/model_info", self.model_info)):
            r.add_get(old, self._deprecated(old, new, handler) if self.version == "0.5.23" else handler)
            if self.version != "0.5.5":
                r.add_get(new, handler)
        r.add_get("/v1/models", self.models)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/get_load", self.get_load)
        r.add_get("/sim/device_memory", self.device_memory)
        r.add_get("/sim/host_memory", self.host_memory)
        r.add_get("/sim/step_times", self.step_times)
        if self.cfg.enable_metrics:
            r.add_get("/metrics", self.metrics)
        if self.version == "0.5.23":
            r.add_get("/ready", self.ready_probe)
        return app

    def _deprecated(self, old: str, new: str, handler: Any) -> Any:
        """``handler`` behind SGLang 0.5.23's deprecation warning, logged on every call of the old
        path (``sglang/srt/entrypoints/http_server.py`` 0.5.23, ``get_model_info`` and
        ``get_server_info``; §5.1-5.2)."""

        async def warned(request: web.Request) -> web.StreamResponse:
            self.log.line(f"Endpoint '{old}' is deprecated and will be removed in a future version. "
                          f"Please use '{new}' instead.", None)
            return await handler(request)

        return warned

    @web.middleware
    async def _access_log(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        host = f"{peer[0]}:{peer[1]}" if peer else "-"
        reason = resp.reason or ""
        self.log.raw(f'INFO:     {host} - "{request.method} {request.path_qs} HTTP/1.1" {resp.status} {reason}')
        return resp

    def now_s(self) -> float:
        """Seconds since the server object was made (the engine's clock)."""
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------ driver

    async def drive(self) -> None:
        """Run engine steps in real time forever (cancel to stop).

        Steps follow one another on a continuous timeline, as on the GPU: each starts when the
        previous one ends (``end = start + duration_s``), not when the event loop happens to wake
        up, so a late wake-up is absorbed by the next step's wait (at most
        :data:`MAX_CATCH_UP_S`; beyond that the server is overloaded and real time wins).
        """
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        loop = asyncio.get_running_loop()
        t0 = loop.time() - self.now_s()
        end: float | None = None  # where the timeline's last step ends
        last_real: float | None = None  # when the last step really ended
        while True:
            if not self.engine.has_work():
                end = last_real = None
                self._wake.clear()
                await self._wake.wait()
                continue
            now = loop.time()
            if end is None or now - end > MAX_CATCH_UP_S:
                end, last_real = None, now
            start = now if end is None else end
            try:
                result = self.engine.step(start - t0)
            except SimRuntimeOOM as err:
                self._die(err.message)
                return
            except Exception:  # any scheduler crash ends the server, as in SGLang (§4.3)
                self._die(traceback.format_exc().split("\n", 1)[1].rstrip())
                return
            if result.duration_s > 0:
                end = start + result.duration_s
                await asyncio.sleep(max(0.0, end - loop.time()))
                real_end = loop.time()
                self._step_log.append((result.duration_s, real_end - (last_real or start)))
                last_real = real_end
                if len(self._step_log) > 4096:
                    del self._step_log[:2048]
            else:
                end = last_real = None
            self._dispatch(result.events)
            if result.duration_s <= 0:  # an abort, or (never) nothing: let the handlers run
                await asyncio.sleep(0 if result.events else IDLE_POLL_S)

    def _dispatch(self, events: list[TokenEvent | FinishEvent]) -> None:
        if not events:
            return
        finishes = {e.rid: e for e in events if isinstance(e, FinishEvent)}
        now = self.now_s()
        for e in events:
            if isinstance(e, TokenEvent):
                p = self._pending.get(e.rid)
                if p is None:
                    continue
                fin = finishes.pop(e.rid, None)
                if e.token_ids:
                    self._observe_token(p, now, len(e.token_ids))
                self._deliver(p, _Update(e.token_ids, e.prompt_tokens, e.completion_tokens, e.cached_tokens, fin))
        for rid, fin in finishes.items():
            p = self._pending.get(rid)
            if p is not None:
                self._deliver(p, _Update([], fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens, fin))
        self._events_seen += len(events)
        assert self._progress is not None
        self._progress.set()
        self._progress = asyncio.Event()

    @staticmethod
    def _deliver(p: _Pending, upd: _Update) -> None:
        """Hand an update to its request: straight onto a direct stream's socket, else its queue."""
        if p.direct is None:
            p.queue.put_nowait(upd)
            return
        transport, encode = p.direct
        assert p.done is not None
        if p.done.done():
            return
        if transport.is_closing():
            p.done.set_exception(ConnectionResetError("client closed the stream"))
            return
        try:
            data = encode(upd)
        except Exception as err:  # a bad chunk fails its own request, never the driver
            p.done.set_exception(err)
            return
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))  # HTTP/1.1 chunked framing
        if upd.finish is not None:
            p.done.set_result(upd)

    async def _stream(self, request: web.Request, p: _Pending, encode: Callable[[_Update], bytes],
                      tail: Callable[[_Update], bytes]) -> web.StreamResponse:
        """Serve one SSE stream of ``p``'s updates, ``encode`` each, then ``tail(last update)``.

        The first chunk goes through aiohttp (which sends the headers); after that, when the
        response is chunked, the driver writes each step's chunk straight to the transport in
        HTTP/1.1 chunked framing (no task wake-up per token: 256 streams fit one core); the tail
        and the terminating chunk go through aiohttp again.
        """
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        if request.version >= (1, 1):
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        finished = False
        try:
            upd = await p.queue.get()
            await resp.write(encode(upd))
            finished = upd.finish is not None
            while not finished and not p.queue.empty():
                upd = p.queue.get_nowait()
                await resp.write(encode(upd))
                finished = upd.finish is not None
            transport = request.transport
            if not finished and resp.chunked and transport is not None:
                p.done = asyncio.get_running_loop().create_future()
                p.direct = (transport, encode)
                upd = await p.done
                finished = True
            while not finished:
                upd = await p.queue.get()
                await resp.write(encode(upd))
                finished = upd.finish is not None
            await resp.write(tail(upd))
        except ConnectionResetError:
            pass  # the client went away: its request is aborted below, as SGLang aborts it
        finally:
            self._forget(p, finished)
        return resp

    def _observe_token(self, p: _Pending, now: float, n: int) -> None:
        if self._hist is not None:
            if p.first_token_s is None:
                self._hist["ttft"].labels(self.cfg.served_model_name).observe(now - p.start_s)
            elif p.last_token_s is not None:
                self._hist["itl"].labels(self.cfg.served_model_name).observe((now - p.last_token_s) / n)
        if p.first_token_s is None:
            p.first_token_s = now
        p.last_token_s = now

    def _die(self, error: str) -> None:
        """A scheduler crash (§4.3, §4.4): its exception, the tokenizer manager's SIGQUIT line, kill.

        Args:
            error: The exception text (torch's OOM text for a runtime OOM).
        """
        self.log.line(
            "Scheduler hit an exception: Traceback (most recent call last):\n"
            '  File "/usr/local/lib/python3.12/dist-packages/sglang/srt/managers/scheduler.py", in event_loop_overlap\n'
            "    result = self.run_batch(batch)\n" + error,
            0,
        )
        self.log.line("SIGQUIT received. signum=None, frame=None. It usually means one child failed.", None)
        kill_process_tree()

    def _submit(self, input_ids: list[int], max_new_tokens: int, ignore_eos: bool, rid: str | None = None
                ) -> _Pending:
        """Queue a request in the engine (raises RequestRejected)."""
        rid = rid or uuid.uuid4().hex
        now = self.now_s()
        pending = _Pending(rid, len(input_ids), now)
        self.engine.add_request(SimRequest(rid, list(input_ids), int(max_new_tokens), bool(ignore_eos), now,
                                           getattr(input_ids, "prompt_class", None), isinstance(input_ids, TextIds)))
        self._pending[rid] = pending
        if self._wake is not None:
            self._wake.set()
        return pending

    def _forget(self, p: _Pending, finished: bool) -> None:
        self._pending.pop(p.rid, None)
        if not finished:
            self.engine.abort(p.rid)

    async def warmup(self) -> None:
        """SGLang's warm-up request (``max_new_tokens=8``), then the ready line (§4.2 line 10)."""
        if not self.skip_warmup:
            await self._collect(self._submit([0] * 8, 8, True))
        self.ready = True
        # Engine startup time: from the process's start to ready (sglang:engine_startup_time).
        self.startup_s = max(0.0, time.time() - psutil.Process().create_time())
        self.log.line("The server is fired up and ready to roll!", None)

    # ------------------------------------------------------------------ handlers

    async def health(self, request: web.Request) -> web.Response:
        """``/health``, ``/health_generate`` (§5.1): 503 while starting, else a 1-token generate."""
        if not self.ready:
            return web.Response(status=503)
        assert self._progress is not None
        seen = self._events_seen
        progress = self._progress
        p = self._submit([0], 1, True, rid=f"HEALTH_CHECK_{uuid.uuid4().hex[:8]}")
        try:
            getter = asyncio.ensure_future(p.queue.get())
            other = asyncio.ensure_future(progress.wait())
            done, _ = await asyncio.wait({getter, other}, timeout=HEALTH_CHECK_TIMEOUT_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            for fut in (getter, other):
                if fut not in done:
                    fut.cancel()
            if not done and self._events_seen == seen:
                self.log.line(f"Health check failed. Server couldn't get a response from detokenizer for last "
                              f"{HEALTH_CHECK_TIMEOUT_S:.0f} seconds.", None)
                return web.Response(status=503)
            return web.Response(status=200)
        finally:
            self._forget(p, False)

    async def ready_probe(self, request: web.Request) -> web.Response:
        """``/ready`` (0.5.23): 200 or 503, no generation."""
        return web.Response(status=200 if self.ready else 503)

    def memory_usage(self) -> dict[str, Any]:
        """``internal_states[i].memory_usage`` in the version's shape (§5.2), GiB."""
        plan = self.plan
        graph = (plan.graph_bytes + plan.draft_graph_bytes) / GIB
        usage: dict[str, Any] = {
            "weight": round(plan.weight_bytes / GIB, 2),
            "kvcache": round((plan.kv_bytes + plan.draft_kv_bytes) / GIB, 2),
            "token_capacity": plan.reported_tokens,
            "graph": round(graph, 2),
        }
        if self.version == "0.5.23":
            usage["graph"] = {"decode": round(graph, 2)}
            usage["startup_available"] = round(plan.available_bytes / GIB, 2)
            usage["token_capacity_swa"] = 0
        return usage

    async def server_info(self, request: web.Request) -> web.Response:
        """``/get_server_info`` (and ``/server_info`` from 0.5.10): flat server args + state (§5.2)."""
        args = _jsonable(self.cfg.server_args)
        state: dict[str, Any] = {**args, "last_gen_throughput": self.engine.stats()["gen_throughput"],
                                 "memory_usage": self.memory_usage()}
        if self.version != "0.5.5":
            state["effective_max_running_requests_per_dp"] = self.plan.max_running_requests
        if self.engine.spec.cost.speculative and self.engine.spec_forward_total > 0:
            state["avg_spec_accept_length"] = self.engine.spec_accepted_total / self.engine.spec_forward_total
        if self.version == "0.5.23":
            state["world_size"] = self.cfg.tp_size
        max_req_len = min(self.cfg.context_len - 1, self.plan.request_pool_tokens - 1)
        body = {
            **args,
            "status": "ready" if self.ready else "starting",
            "max_total_num_tokens": self.plan.reported_tokens,
            "max_req_input_len": max_req_len - 5,
            "internal_states": [state],
            "version": VERSIONS[self.version],
        }
        return web.json_response(body)

    async def model_info(self, request: web.Request) -> web.Response:
        """``/get_model_info`` (§5.1)."""
        body: dict[str, Any] = {
            "model_path": self.cfg.server_args.get("model_path"),
            "tokenizer_path": self.cfg.server_args.get("tokenizer_path") or self.cfg.server_args.get("model_path"),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
        if self.version == "0.5.23":
            body.update(served_model_name=self.cfg.served_model_name, load_format="auto",
                        model_type=None, architectures=list(self.cfg.model.architectures))
        return web.json_response(body)

    async def models(self, request: web.Request) -> web.Response:
        """``/v1/models``: ``data[0].id`` is the served model name (§5.3)."""
        name = self.cfg.served_model_name
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
            "max_model_len": self.cfg.context_len}]})

    async def get_load(self, request: web.Request) -> web.Response:
        """``/get_load``: one entry per DP rank."""
        s = self.engine.stats()
        return web.json_response([{"dp_rank": 0, "num_reqs": s["num_running_reqs"] + s["num_queue_reqs"],
                                   "num_waiting_reqs": s["num_queue_reqs"], "num_tokens": s["num_used_tokens"]}])

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache`` (§5.4): 200, or 400 while requests are pending."""
        if self.engine.flush_cache():
            self.log.line("Cache flushed successfully!", 0)
            return web.Response(status=200, text=FLUSH_TEXT)
        s = self.engine.stats()
        self.log.line(f"Cache not flushed because there are pending requests. #queue-req: {s['num_queue_reqs']}, "
                      f"#running-req: {s['num_running_reqs']}", 0)
        return web.Response(status=400, text=FLUSH_TEXT)

    async def device_memory(self, request: web.Request) -> web.Response:
        """``/sim/device_memory``: per GPU what NVML would report (MiB).

        ``used_mib`` is the startup ledger (weights, KV pool, req_to_token, CUDA graphs, draft,
        foreign memory); ``peak_used_mib`` adds the largest step's activations since start
        (:meth:`~tuner.sim.engine.Engine.stats` ``peak_activation_bytes``).
        """
        gpus = []
        activations = self.engine.stats()["peak_activation_bytes"]  # every tp rank runs the same steps
        for r in range(self.cfg.tp_size):
            total = self.plan.ranks[r].total
            used = self.plan.used_bytes(r)
            total_mib, used_mib = total // MIB, -(-used // MIB)
            peak_mib = min(total_mib, -(-(used + activations) // MIB))
            gpus.append({"index": r, "total_mib": total_mib, "used_mib": used_mib, "peak_used_mib": peak_mib,
                         "free_mib": total_mib - used_mib})
        return web.json_response(gpus)

    async def host_memory(self, request: web.Request) -> web.Response:
        """``/sim/host_memory``: the simulated host's RAM and the HiCache pools pinned in it (bytes).

        One host for every rank (``--sim-host-memory-gib``): ``pinned_per_rank_bytes`` (the host
        pool of one rank, §7) times ``ranks`` is ``pinned_bytes``; ``available_bytes`` is what
        ``psutil`` would call available on that host with this server up (total minus pinned);
        ``cgroup_max_bytes`` is the server's real cgroup ``memory.max`` (a unit's ``MemoryMax=``),
        null when unlimited; ``hicache_host_tokens`` is one rank's host pool in tokens.
        """
        plan = self.plan
        per_rank = plan.hicache_host_bytes if self.cfg.enable_hierarchical_cache else 0
        pinned = per_rank * self.cfg.tp_size
        return web.json_response({
            "total_bytes": plan.host_memory_bytes, "available_bytes": max(plan.host_memory_bytes - pinned, 0),
            "pinned_per_rank_bytes": per_rank, "ranks": self.cfg.tp_size, "pinned_bytes": pinned,
            "hicache_host_tokens": plan.hicache_host_tokens if per_rank else 0,
            "cgroup_max_bytes": plan.cgroup_max_bytes,
        })

    async def step_times(self, request: web.Request) -> web.Response:
        """``/sim/step_times``: recent steps as [cost-model duration, realised duration] in seconds.

        A step's realised duration runs from the real end of the step before it (or its own real
        start after idling) to its own real end.
        """
        return web.json_response([[a, b] for a, b in self._step_log])

    async def metrics(self, request: web.Request) -> web.Response:
        """``/metrics`` (§5.5), Prometheus text format."""
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ------------------------------------------------------------------ generation

    def _reject(self, message: str, status: int = 400) -> web.Response:
        return web.json_response({"error": {"message": message}, "object": "error", "message": message,
                                  "type": "BadRequestError", "code": status}, status=status)

    def _input_ids(self, text: Any, ids: Any) -> list[int]:
        if ids is not None:
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise RequestRejected("input_ids must be a list of token ids.")
            return ids
        if not isinstance(text, str):
            raise RequestRejected("Either text or input_ids should be provided.")
        return TextIds(tokenize(text, self.cfg.model.vocab_size), classify_text(text))

    async def generate(self, request: web.Request) -> web.StreamResponse:  # noqa: C901 - over the complexity ceiling when it was set (15); it only goes down
        """``/generate`` (§5.3): text or input_ids, optional SSE streaming, SGLang's ``meta_info``."""
        try:
            body = await _json_object(request)
        except RequestRejected as err:
            return self._reject(str(err))
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            return self._reject("sampling_params must be a JSON object.")
        if self.version == "0.5.23" and (unknown := sorted(set(sp) - SAMPLING_PARAMS_0_5_23)):
            # 0.5.23's /generate contract gate (entrypoints/api_contract.py) refuses unknown fields.
            return self._reject(f"unknown field `sampling_params.{unknown[0]}`")
        text, ids = body.get("text"), body.get("input_ids")
        batch = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
        try:
            max_new = _max_new_tokens(sp.get("max_new_tokens"), 128)
        except RequestRejected as err:
            return self._reject(str(err))
        logprob = bool(body.get("return_logprob"))  # the model's own answers: every token, no early EOS
        ignore_eos = bool(sp.get("ignore_eos", False)) or logprob
        if batch:
            items = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [None] * len(text)
            texts = text if isinstance(text, list) else [None] * len(items)
            pendings: list[_Pending] = []
            try:
                prompts = [self._input_ids(t, i) for t, i in zip(texts, items, strict=False)]
                for prompt in prompts:
                    pendings.append(self._submit(prompt, max_new, ignore_eos))
            except RequestRejected as err:
                for p in pendings:
                    self._forget(p, False)
                return self._reject(str(err))
            results = await asyncio.gather(*(self._collect(p) for p in pendings))
            for upd, _ids in results:
                if (error := _abort_error(upd)) is not None:
                    return self._reject(*error)
            bodies = [self._generate_body(p, u, ids_) for p, (u, ids_) in zip(pendings, results, strict=True)]
            if logprob:
                bodies = [self._answer_body(b, t or "", prompt) for b, t, prompt in zip(bodies, texts, prompts, strict=True)]
            return web.json_response(bodies)
        try:
            prompt = self._input_ids(text, ids)
            p = self._submit(prompt, max_new, ignore_eos, rid=body.get("rid"))
        except RequestRejected as err:
            return self._reject(str(err))
        if not body.get("stream"):
            upd, out_ids = await self._collect(p)
            if (error := _abort_error(upd)) is not None:
                return self._reject(*error)
            out = self._generate_body(p, upd, out_ids)
            return web.json_response(self._answer_body(out, text if isinstance(text, str) else "", prompt)
                                     if logprob else out)
        args = self.cfg.server_args  # 0.5.5 spells it --stream-output
        incremental = bool(args.get("incremental_streaming_output") or args.get("stream_output"))
        # Streamed output_ids (managers/tokenizer_manager.py): 0.5.5 always sends the new ids;
        # 0.5.10+ send the new ids only with --incremental-streaming-output, else all ids so far.
        cumulative_ids = self.version != "0.5.5" and not incremental

        retractions = "num_retractions" if self.version == "0.5.23" else "total_retractions"
        meta_head = f'"meta_info": {{"id": {json.dumps(p.rid)}, "finish_reason": null, "prompt_tokens": '

        def encode(upd: _Update) -> bytes:
            if upd.finish is not None:
                chunk = self._generate_body(p, upd, [], new_ids=upd.token_ids, incremental=incremental)
                if cumulative_ids:
                    p.out_ids.extend(upd.token_ids)
                    chunk["output_ids"] = list(p.out_ids)
                return b"data: " + json.dumps(chunk).encode() + b"\n\n"
            # The hot path (every token of every stream): the same JSON as _generate_body, formatted directly.
            new_text = detokenize(upd.token_ids)
            p.text += new_text
            text = json.dumps(new_text if incremental else p.text)
            if cumulative_ids:
                p.out_ids.extend(upd.token_ids)
            ids = p.out_ids if cumulative_ids else upd.token_ids
            return (f'data: {{"text": {text}, "output_ids": {ids}, {meta_head}{upd.prompt_tokens}, '
                    f'"weight_version": "default", "completion_tokens": {upd.completion_tokens}, '
                    f'"cached_tokens": {upd.cached_tokens}, "{retractions}": 0}}}}\n\n').encode()

        return await self._stream(request, p, encode, lambda _upd: b"data: [DONE]\n\n")

    async def _collect(self, p: _Pending) -> tuple[_Update, list[int]]:
        out: list[int] = []
        finished = False
        try:
            while True:
                upd = await p.queue.get()
                out.extend(upd.token_ids)
                if upd.finish is not None:
                    finished = True
                    return upd, out
        finally:
            self._forget(p, finished)

    def _finish_observe(self, p: _Pending, upd: _Update) -> float:
        e2e = self.now_s() - p.start_s
        if self._hist is not None and upd.finish is not None:
            self._hist["e2e"].labels(self.cfg.served_model_name).observe(e2e)
        return e2e

    def _generate_body(self, p: _Pending, upd: _Update, out_ids: list[int], *, new_ids: list[int] | None = None,
                       incremental: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": p.rid,
            "finish_reason": upd.finish.finish_reason if upd.finish else None,
            "prompt_tokens": upd.prompt_tokens,
            "weight_version": "default",
            "completion_tokens": upd.completion_tokens,
            "cached_tokens": upd.cached_tokens,
        }
        meta["num_retractions" if self.version == "0.5.23" else "total_retractions"] = 0
        if upd.finish is not None:
            meta["e2e_latency"] = self._finish_observe(p, upd)
            if upd.finish.cached_tokens_details is not None and self.version != "0.5.5":
                meta["cached_tokens_details"] = upd.finish.cached_tokens_details
            meta.update(self._spec_meta(upd.completion_tokens, upd.finish.spec_verify_ct))
        if new_ids is None:  # one whole answer
            return {"text": detokenize(out_ids), "output_ids": list(out_ids), "meta_info": meta}
        new_text = detokenize(new_ids)
        p.text += new_text
        return {"text": new_text if incremental else p.text, "output_ids": new_ids, "meta_info": meta}

    def _answer_body(self, out: dict[str, Any], text: str, prompt_ids: list[int]) -> dict[str, Any]:
        """``out`` (a finished ``/generate`` body) with the model's greedy answer under this
        launch's numerics (:func:`tuner.sim.answers.answer`) and ``meta_info.output_token_logprobs``
        as SGLang writes it: ``[logprob, token_id, null]`` per output token
        (``TokenizerManager.detokenize_logprob_tokens``, ``return_text_in_logprobs`` false)."""
        n = int(out["meta_info"].get("completion_tokens") or len(out.get("output_ids") or []))
        got = answer(text, prompt_ids, n, self.cfg.server_args, vocab_size=self.cfg.model.vocab_size, words=_WORDS,
                     fault=self.answering[0])
        meta = dict(out["meta_info"], output_token_logprobs=[[lp, t, None] for lp, t in zip(got.logprobs, got.token_ids, strict=True)])
        if self.answering[1]:
            meta.pop("output_token_logprobs")
        return {**out, "text": got.text, "output_ids": got.token_ids, "meta_info": meta}

    def _spec_meta(self, completion_tokens: int, verify_ct: int) -> dict[str, Any]:
        """``meta_info``'s speculative-decoding fields (§5.3, :func:`tuner.sim.speculative.meta_fields`)."""
        model = self.engine.spec.speculative
        if model is None or not self.engine.spec.cost.speculative:
            return {}
        return model.meta(completion_tokens, verify_ct)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions`` (§5.3): prompt as text or ids, ``max_tokens``, ``ignore_eos``, streaming."""
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/chat/completions`` (§5.3): ``messages`` become one prompt (role and content words)."""
        return await self._openai(request, chat=True)

    def _openai_prompt(self, body: dict[str, Any], chat: bool) -> list[int]:
        """The prompt's token ids of an OpenAI-style body (raises RequestRejected)."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestRejected("The request needs a non-empty 'messages' list.")
            words = []
            for m in messages:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list):  # content parts
                    content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
                words.append(f"{m.get('role', 'user') if isinstance(m, dict) else 'user'} {content or ''}")
            return self._input_ids(" ".join(words), None)
        if "prompt" not in body:
            raise RequestRejected("The request needs a 'prompt'.")
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            if len(prompt) != 1:
                raise RequestRejected("Only one prompt per request is simulated; send one request per prompt.")
            prompt = prompt[0]
        return self._input_ids(prompt if isinstance(prompt, str) else None, prompt if isinstance(prompt, list) else None)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """The OpenAI-compatible completions of §5.3, plain or chat, streaming or not."""
        try:
            body = await _json_object(request)
            ids = self._openai_prompt(body, chat)
            max_tokens = body.get("max_completion_tokens") if chat else None
            max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
            # OpenAI's default for completions; an unset chat max_tokens runs to EOS in SGLang, and the
            # simulated EOS falls within max_new_tokens, so chat gets /generate's default of 128.
            default = 128 if chat else 16
            p = self._submit(ids, _max_new_tokens(max_tokens, default),
                             bool(body.get("ignore_eos", False)))
        except RequestRejected as err:
            return self._reject(str(err))
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{p.rid}"
        created = int(time.time())
        model = body.get("model") or self.cfg.served_model_name
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            upd, out_ids = await self._collect(p)
            if (error := _abort_error(upd)) is not None:
                return self._reject(*error)
            self._finish_observe(p, upd)
            text = detokenize(out_ids)
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": _oai_reason(upd.finish),
                                      "matched_stop": None}
            choice.update({"message": {"role": "assistant", "content": text, "reasoning_content": None,
                                       "tool_calls": None}} if chat else {"text": text})
            return web.json_response({"id": cid, "object": obj, "created": created, "model": model,
                                      "choices": [choice], "usage": self._usage(upd)})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        continuous = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
        head = {"id": cid, "object": f"{obj}.chunk" if chat else obj, "created": created, "model": model}
        first = [chat]

        def encode(upd: _Update) -> bytes:
            text = detokenize(upd.token_ids)
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": _oai_reason(upd.finish),
                                      "matched_stop": None}
            if chat:
                choice["delta"] = {"role": "assistant", "content": text} if first[0] else {"content": text}
                first[0] = False
            else:
                choice["text"] = text
            chunk = {**head, "choices": [choice], "usage": self._usage(upd) if continuous else None}
            if upd.finish is not None:
                self._finish_observe(p, upd)
            return b"data: " + json.dumps(chunk).encode() + b"\n\n"

        def tail(upd: _Update) -> bytes:
            final = {**head, "choices": [], "usage": self._usage(upd)}
            usage = b"data: " + json.dumps(final).encode() + b"\n\n" if include_usage else b""
            return usage + b"data: [DONE]\n\n"

        return await self._stream(request, p, encode, tail)

    def _usage(self, upd: _Update) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": upd.prompt_tokens, "completion_tokens": upd.completion_tokens,
                                 "total_tokens": upd.prompt_tokens + upd.completion_tokens}
        if self.cfg.enable_cache_report and upd.cached_tokens > 0:
            usage["prompt_tokens_details"] = {"cached_tokens": upd.cached_tokens}
        return usage

    # ------------------------------------------------------------------ metrics

    def _make_histograms(self) -> dict[str, Histogram]:
        labels = ["model_name"]
        return {
            "ttft": Histogram("sglang:time_to_first_token_seconds", "Time to first token (s).", labels,
                              registry=self.registry,
                              buckets=(0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160)),
            "itl": Histogram("sglang:inter_token_latency_seconds", "Inter-token latency (s).", labels,
                             registry=self.registry,
                             buckets=(0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04,
                                      0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)),
            "e2e": Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency (s).", labels,
                             registry=self.registry,
                             buckets=(0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 150, 200,
                                      250, 300, 350, 500, 1000)),
        }


SAMPLING_PARAMS_0_5_23 = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width", "json_schema", "regex", "ebnf",
    "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval",
    "logit_bias", "sampling_seed", "custom_params", "watermark",
})
"""The fields of ``SamplingParams`` in SGLang 0.5.23 (``srt/sampling/sampling_params.py``)."""


def _max_new_tokens(value: Any, default: int) -> int:
    """A request's output limit: ``default`` when unset; SGLang's error for a bad value."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(f"max_new_tokens must be an integer, got {value!r}.")
    if value < 0:
        raise RequestRejected(f"max_new_tokens must be at least 0, got {value}.")
    return value


async def _json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object (raises RequestRejected with SGLang-style text)."""
    try:
        body = await request.json()
    except ValueError:
        raise RequestRejected("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise RequestRejected("The request body must be a JSON object.")
    return body


def _oai_reason(finish: FinishEvent | None) -> str | None:
    """An OpenAI ``finish_reason``: SGLang's finish type (``length``, ``stop`` or ``abort``)."""
    if finish is None:
        return None
    kind = finish.finish_reason.get("type")
    return kind if kind in ("length", "abort") else "stop"


def _abort_error(upd: _Update) -> tuple[str, int] | None:
    """``(message, status)`` of a request the scheduler aborted, else None.

    A non-streaming request that ends in a 400 abort is answered with an error, as SGLang's
    tokenizer manager raises on it (§5.3); a stream gets the abort as its last chunk instead.
    """
    message = upd.finish.abort_message if upd.finish is not None else None
    if message is None:
        return None
    return message, int(upd.finish.finish_reason.get("status_code", ABORT_STATUS_CODE))


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        try:
            json.dumps(v)
            out[k] = v
        except TypeError:
            out[k] = str(v)
    return out


class _SchedulerCollector:
    """Scheduler gauges and tokenizer counters under §5.5's names, read live from the engine."""

    def __init__(self, server: SimServer) -> None:
        self.server = server

    def collect(self) -> Any:
        srv = self.server
        s = srv.engine.stats()
        plan = srv.plan
        version = srv.version
        name = srv.cfg.served_model_name
        sched = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        sv = [name, "unified", "0", "0"]

        def gauge(metric: str, doc: str, value: float, labels: list[str] = sched, values: list[str] = sv
                  ) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], float(value))
            return c

        yield gauge("sglang:num_running_reqs", "The number of running requests.", s["num_running_reqs"])
        yield gauge("sglang:num_used_tokens", "The number of used tokens.", s["num_used_tokens"])
        yield gauge("sglang:token_usage", "The token usage.", s["token_usage"])
        yield gauge("sglang:gen_throughput", "The generation throughput (token/s).", s["gen_throughput"])
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", s["num_queue_reqs"])
        yield gauge("sglang:num_grammar_queue_reqs", "The number of requests in the grammar queue.", 0)
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", s["cache_hit_rate"])
        yield gauge("sglang:new_token_ratio", "The new token ratio.", s["new_token_ratio"])
        yield gauge("sglang:num_retracted_reqs", "The number of retracted requests.", 0)
        yield gauge("sglang:is_cuda_graph", "Whether the last batch used CUDA graphs.",
                    1.0 if srv.cfg.cuda_graph_max_bs and s["num_running_reqs"] <= srv.cfg.cuda_graph_max_bs else 0.0)
        yield counter("sglang:prompt_tokens", "Number of prefill tokens processed.", s["prompt_tokens_total"])
        yield counter("sglang:generation_tokens", "Number of generation tokens processed.",
                      s["generation_tokens_total"])
        yield counter("sglang:cached_tokens", "Number of cached prompt tokens.", s["cached_tokens_total"])
        yield counter("sglang:num_requests", "Number of requests processed.", s["num_requests_total"])
        yield counter("sglang:num_aborted_requests", "Number of requests aborted.", s["num_aborted_requests_total"])
        yield counter("sglang:evicted_tokens", "Number of tokens evicted from the radix cache.",
                      s["evicted_tokens_total"])
        yield counter("sglang:load_back_tokens", "Number of tokens loaded back from host memory.",
                      s["load_back_tokens_total"])
        # Families SGLang has for what the simulator models (metrics/collector.py 0.5.5,
        # observability/metrics_collector.py 0.5.23): speculative acceptance, startup time,
        # evictable KV tokens (0.5.23), the per-request retraction histogram's gauge twin (0.5.5).
        cost = srv.engine.spec.cost
        if cost.spec_num_draft_tokens:
            yield gauge("sglang:spec_accept_length", "The average acceptance length of speculative decoding.", cost.spec_accept_length)
            yield gauge("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding.",
                        cost.spec_accept_length / cost.spec_num_draft_tokens)
        if version == "0.5.23":
            yield gauge("sglang:kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool.",
                        s["evictable_tokens"])
            yield gauge("sglang:startup_time_seconds", "Engine startup duration by phase in seconds.", srv.startup_s,
                        labels=sched + ["phase"], values=sv + ["total"])
        else:
            yield gauge("sglang:engine_startup_time", "The time taken for the engine to start up.", srv.startup_s)
        if version != "0.5.5":
            yield gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV pool.",
                        plan.reported_tokens)
            yield gauge("sglang:hicache_host_used_tokens", "HiCache host tokens in use.", s["hicache_host_used_tokens"])
            yield gauge("sglang:hicache_host_total_tokens", "HiCache host pool size.", s["hicache_host_total_tokens"])
            yield gauge("sglang:full_token_usage", "The full-attention token usage.", s["token_usage"])
            yield counter("sglang:num_retracted_requests", "Number of retracted requests.", s["num_retractions_total"])
        if version == "0.5.23":
            yield gauge("sglang:weight_memory_usage_gb", "Weight memory (GiB).", plan.weight_bytes / GIB)
            yield gauge("sglang:kv_cache_memory_usage_gb", "KV-cache memory (GiB).", plan.kv_bytes / GIB)
            g = GaugeMetricFamily("sglang:graph_memory_usage_gb", "CUDA-graph memory (GiB).",
                                  labels=sched + ["phase"])
            g.add_metric(sv + ["decode"], (plan.graph_bytes + plan.draft_graph_bytes) / GIB)
            yield g
            yield gauge("sglang:page_size", "KV page size.", srv.cfg.page_size)
            yield gauge("sglang:num_pages", "KV pages.", plan.reported_tokens // srv.cfg.page_size)
            yield gauge("sglang:context_len", "Context length.", srv.cfg.context_len)
            yield gauge("sglang:startup_available_gpu_memory_gb", "Free GPU memory after startup (GiB).",
                        plan.available_bytes / GIB)
            yield gauge("sglang:kv_used_tokens", "KV tokens used by running requests.", s["num_used_tokens"])
            yield gauge("sglang:kv_available_tokens", "KV tokens free.",
                        plan.reported_tokens - s["num_used_tokens"])
