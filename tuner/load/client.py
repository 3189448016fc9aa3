"""Streaming client: sends one :class:`~tuner.load.workloads.Request` over SSE and records its timeline.

Two APIs (``shared/sglang-reference.md`` §5.3):

* ``generate`` — ``POST /generate`` with ``input_ids``, ``sampling_params.max_new_tokens``,
  ``ignore_eos``, ``stream: true``; each ``data: {json}`` line carries the cumulative
  ``meta_info.completion_tokens`` (new tokens per chunk = its change, as bench_serving computes
  ITL), and ``prompt_tokens``, ``cached_tokens``, ``finish_reason``; the stream ends with
  ``data: [DONE]``.
* ``completions`` — ``POST /v1/completions`` with a token-id ``prompt``, ``max_tokens``,
  ``ignore_eos``, ``stream_options: {include_usage, continuous_usage_stats}`` so every chunk
  carries ``usage.completion_tokens``; the final usage chunk has ``prompt_tokens_details.cached_tokens``
  (only with ``--enable-cache-report`` and a hit). Without usage per chunk, a chunk with text
  counts one token (bench_serving's OpenAI client does the same).

Two transports behind one :class:`StreamClient`: ``raw`` (default for ``http://``) keeps its own
HTTP/1.1 keep-alive connections (asyncio protocols) and parses SSE in the protocol callback as
bytes arrive, so nothing but the SSE line parse runs per token; ``aiohttp`` uses one
``aiohttp.ClientSession`` with a connector sized to the concurrency (and is used for
``https://``). The raw one costs ~1.7x less CPU per streamed token (aiohttp's stream reader wakes
a task and re-arms reading for every chunk), which is what lets one core drive 1,000 streams.

Token counts always come from the server. Times use the monotonic clock, taken once per network
read, so events that arrived together share a timestamp. Transport errors are mapped to
``RequestRecord.error_kind`` here (``connect``, ``disconnect``, ``timeout``, ``http``, ``server``,
``cancelled``), and to :class:`tuner.errors.LoadError` in :meth:`StreamClient.check`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import orjson

from tuner.errors import LoadError
from tuner.load.metrics import RequestRecord
from tuner.load.workloads import Request
from tuner.sglang.client import url_problem

__all__ = ["Api", "Transport", "API_PATHS", "TokenCounter", "StreamClient", "normalize_url"]

Api = Literal["generate", "completions"]
Transport = Literal["raw", "aiohttp"]
API_PATHS: Mapping[str, str] = MappingProxyType({"generate": "/generate", "completions": "/v1/completions"})
logger = logging.getLogger(__name__)
_ERROR_BODY_BYTES = 4096


class TokenCounter:
    """Running count of streamed output tokens, read by the live statistics."""

    __slots__ = ("tokens",)

    def __init__(self) -> None:
        self.tokens = 0


def _raise_fd_limit(connections: int) -> None:
    """Raise the soft open-files limit toward the hard one so ``connections`` sockets fit.

    1,000 streams need 1,000 sockets; many systems start with a soft limit of 1,024.
    """
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            logger.warning("open-files limit %d is below the %d connections asked for", soft, connections)


def normalize_url(url: str) -> str:
    """The server's base URL: scheme and host, no trailing slash or API path.

    Raises:
        LoadError: Not an ``http://`` or ``https://`` URL with a host, or its port is out of range.
    """
    problem = url_problem(url)
    if problem is not None:
        raise LoadError(f"--url {url!r}: {problem}", hint="pass the server's base URL, e.g. http://127.0.0.1:30000")
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    for suffix in API_PATHS.values():
        path = path.removesuffix(suffix)
    return f"{parts.scheme}://{parts.netloc}{path}"


class _Stream:
    """Per-request parse state; one ``feed`` call per SSE ``data:`` payload."""

    __slots__ = (
        "times", "tokens", "last_ct", "prompt_tokens", "completion_tokens", "cached_tokens",
        "cached_tiers", "finish_reason", "error", "done", "counter", "server_rid", "spec_verify_ct",
    )

    def __init__(self, counter: TokenCounter | None) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.last_ct = 0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.cached_tiers: dict[str, int] | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.done = False
        self.counter = counter
        self.server_rid: str | None = None
        self.spec_verify_ct: int | None = None

    def feed_generate(self, obj: dict[str, Any], now: float) -> None:
        if "error" in obj:
            self.error = _error_text(obj["error"])
            return
        meta = obj.get("meta_info") or {}
        if self.server_rid is None:
            self.server_rid = meta.get("id")
        ct = meta.get("completion_tokens")
        if isinstance(ct, int):
            new = ct - self.last_ct
            self.last_ct = self.completion_tokens = ct
        else:
            new = 1 if obj.get("text") or obj.get("output_ids") else 0
        if new > 0:
            self.times.append(now)
            self.tokens.append(new)
            if self.counter is not None:
                self.counter.tokens += new
        if "prompt_tokens" in meta:
            self.prompt_tokens = meta["prompt_tokens"]
        if "cached_tokens" in meta:
            self.cached_tokens = meta["cached_tokens"]
        if isinstance(meta.get("spec_verify_ct"), int):  # speculative decoding, at the end (§5.3)
            self.spec_verify_ct = meta["spec_verify_ct"]
        tiers = meta.get("cached_tokens_details")
        if isinstance(tiers, dict):  # 0.5.10+ with HiCache hits (§5.3)
            self.cached_tiers = {k: int(v) for k, v in tiers.items() if isinstance(v, (int, float))}
        reason = meta.get("finish_reason")
        if reason:
            detail = reason if isinstance(reason, dict) else {"type": str(reason)}
            self.finish_reason = detail.get("type")
            if self.finish_reason == "abort":
                self.error = f"server aborted the request: {detail.get('message', '')}".strip()

    def feed_completions(self, obj: dict[str, Any], now: float) -> None:
        if "error" in obj:
            self.error = _error_text(obj["error"])
            return
        if self.server_rid is None:
            self.server_rid = obj.get("id")
        usage = obj.get("usage")
        ct = None
        if usage:
            ct = usage.get("completion_tokens")
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                self.cached_tokens = details["cached_tokens"]
            if isinstance(ct, int):
                self.completion_tokens = ct
        choices = obj.get("choices")
        if not choices:
            return  # the final usage-only chunk
        choice = choices[0]
        if isinstance(ct, int):
            new = ct - self.last_ct
            self.last_ct = ct
        else:
            new = 1 if choice.get("text") else 0
        if new > 0:
            self.times.append(now)
            self.tokens.append(new)
            if self.counter is not None:
                self.counter.tokens += new
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        err = err.get("message") or err
    return " ".join(str(err).split())[:300]


def _http_error(what: str, endpoint: str, body: bytes) -> str:
    """One line for a non-streamed answer: the server's own ``message`` when the body is JSON.

    A rejected request's reason, e.g. the too-long-input text ``Input length (N tokens) exceeds
    the maximum allowed length (M tokens).`` (§4.4), comes in the error body. The reference does
    not fix that body's JSON shape, so ``error.message``, ``message`` and ``detail`` are tried in
    turn and the raw text is kept otherwise; the reason leads, so it survives truncation.
    """
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    reason = None
    if isinstance(obj, dict):
        error = obj.get("error")
        for candidate in (error.get("message") if isinstance(error, dict) else error, obj.get("message"),
                          obj.get("detail")):
            if candidate:
                reason = candidate
                break
    text = _error_text(reason) if reason is not None else " ".join(body[:200].decode("utf-8", "replace").split())
    return f"{what} from {endpoint}: {text}"


class _ProtocolError(Exception):
    """The server's bytes are not the HTTP/1.1 (or SSE) this client understands."""


_HEAD, _CHUNKED, _LENGTH, _UNTIL_EOF, _DONE = range(5)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection carrying one exchange at a time.

    Parses the response in ``data_received`` itself: status line and headers, then a chunked,
    ``Content-Length`` or close-delimited body. An SSE body (200, ``text/event-stream``) is split
    into ``data:`` payloads handed to ``on_payload(payload, now_s)`` with the time the bytes were
    read; any other body is kept (first 64 KiB) for the error message. No task wakes up per chunk:
    the exchange's future resolves once, at the end of the body.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.state = _DONE
        self.done: asyncio.Future[None] | None = None
        self.on_payload: Callable[[bytes, float], None] | None = None
        self.t0 = 0.0
        self.buf = b""
        self.sse = b""
        self.left = 0
        self.skip = 0
        self.status = 0
        self.is_sse = False
        self.keep_alive = True
        self.got_bytes = False
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.state == _UNTIL_EOF:
            self._finish()
        elif self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionResetError(str(exc) if exc else "the server closed the connection"))

    def usable(self) -> bool:
        return not self.lost and self.keep_alive and self.state == _DONE and self.transport is not None \
            and not self.transport.is_closing()

    def close(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()

    def exchange(self, data: bytes, on_payload: Callable[[bytes, float], None] | None, t0: float) -> asyncio.Future[None]:
        """Write one request; the future resolves at the end of its response body."""
        assert self.transport is not None
        self.state, self.buf, self.sse, self.left, self.skip = _HEAD, b"", b"", 0, 0
        self.status, self.is_sse, self.keep_alive, self.got_bytes, self.body = 0, False, True, False, []
        self.on_payload, self.t0 = on_payload, t0
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.done

    def _finish(self) -> None:
        self.state = _DONE
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _fail(self, err: BaseException) -> None:
        self.close()
        if self.done is not None and not self.done.done():
            self.done.set_exception(err)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic() - self.t0
        self.got_bytes = True
        if self.buf:
            data, self.buf = self.buf + data, b""
        try:
            if self.state == _HEAD:
                data = data.lstrip(b"\r\n")  # the end of a previous chunked body may linger
                end = data.find(b"\r\n\r\n")
                if end < 0:
                    self.buf = data
                    return
                self._head(data[:end])
                data = data[end + 4:]
                if self.state == _DONE:  # an empty body (Content-Length: 0)
                    self._finish()
                    return
            if self.state == _CHUNKED:
                payload = self._dechunk(data)
            elif self.state == _LENGTH:
                payload = data[:self.left]
                self.left -= len(payload)
                if self.left == 0:
                    self.state = _DONE
            elif self.state == _UNTIL_EOF:
                payload = data
            else:
                return  # bytes after a complete response: ignored
            if payload:
                self._body(payload, now)
            if self.state == _DONE:
                self._finish()
        except _ProtocolError as err:
            self._fail(err)
        except Exception as err:  # noqa: BLE001 - a bad line must fail this request, not the event loop
            self._fail(_ProtocolError(f"unreadable SSE data: {type(err).__name__}: {err}"))

    def _head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _ProtocolError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
        self.status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        self.keep_alive = headers.get("connection") != "close" and parts[0] != "HTTP/1.0"
        self.is_sse = self.status == 200 and "text/event-stream" in headers.get("content-type", "")
        if "chunked" in headers.get("transfer-encoding", ""):
            self.state = _CHUNKED
        elif "content-length" in headers:
            self.left = int(headers["content-length"])
            self.state = _LENGTH if self.left else _DONE
        else:
            self.state, self.keep_alive = _UNTIL_EOF, False

    def _dechunk(self, data: bytes) -> bytes:
        out = []
        pos, n = 0, len(data)
        while pos < n:
            if self.skip:  # the CRLF after a chunk's data
                step = min(self.skip, n - pos)
                pos += step
                self.skip -= step
            elif self.left:  # the rest of a chunk split across reads
                stop = min(pos + self.left, n)
                out.append(data[pos:stop])
                self.left -= stop - pos
                pos = stop
                if not self.left:
                    self.skip = 2
            else:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    self.buf = data[pos:]
                    break
                size = int(data[pos:eol].partition(b";")[0], 16)
                pos = eol + 2
                if size == 0:  # last chunk; no trailers expected (a CRLF left over is skipped later)
                    self.state = _DONE
                    break
                if pos + size + 2 <= n:  # the common case: the whole chunk is here
                    out.append(data[pos:pos + size])
                    pos += size + 2
                else:
                    self.left = size
        return out[0] if len(out) == 1 else b"".join(out)

    def _body(self, payload: bytes, now: float) -> None:
        if not self.is_sse or self.on_payload is None:
            if sum(map(len, self.body)) < 65536:
                self.body.append(payload)
            return
        if self.sse:
            payload, self.sse = self.sse + payload, b""
        if not payload.endswith(b"\n"):  # keep a partial line for the next read
            cut = payload.rfind(b"\n") + 1
            payload, self.sse = payload[:cut], payload[cut:]
        on_payload = self.on_payload
        for line in payload.split(b"\n"):
            if line[:5] == b"data:":
                data = line[5:].strip()
                if data:
                    on_payload(data, now)


class StreamClient:
    """An SSE client for one server: ``async with StreamClient(...) as client: await client.send(req, ...)``.

    Args:
        url: The server's base URL (an API path at its end is stripped).
        api: ``generate`` (SGLang native) or ``completions`` (OpenAI-compatible).
        max_connections: Connector size; the run's concurrency (0 = unlimited).
        request_timeout_s: Limit for one request, send to end of stream.
        connect_timeout_s: Limit for opening a connection.
        model: ``model`` field for ``completions``; ``None`` asks ``GET /v1/models`` in :meth:`check`.
        headers: Extra HTTP headers (e.g. ``Authorization``).
        transport: ``raw`` (default for ``http://``): this module's HTTP/1.1 keep-alive connections,
            which parse SSE as bytes arrive, ~1.7x less CPU per streamed token than aiohttp's
            stream reader (measured in ``tests/benchmarks/bench_load.py``); ``aiohttp``: one
            ``aiohttp.ClientSession`` with a connector sized to ``max_connections`` (always used
            for ``https://``).

    Raises:
        LoadError: A malformed URL or an unknown transport.
    """

    def __init__(
        self,
        url: str,
        *,
        api: Api = "generate",
        max_connections: int = 0,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        model: str | None = None,
        headers: Mapping[str, str] | None = None,
        transport: Transport = "raw",
    ) -> None:
        if api not in API_PATHS:
            raise LoadError(f"--api {api!r} is not supported", hint="use generate or completions")
        if transport not in ("raw", "aiohttp"):
            raise LoadError(f"--transport {transport!r} is not supported", hint="use raw or aiohttp")
        self.base_url = normalize_url(url)
        parts = urlsplit(self.base_url)
        self.transport: Transport = "aiohttp" if parts.scheme == "https" else transport
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        path = parts.path + API_PATHS[api]
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._request_head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\n{extra}Content-Length: "
        ).encode("latin-1")
        self._get_head = f"GET {{path}} HTTP/1.1\r\nHost: {parts.netloc}\r\n{extra}\r\n"
        self._idle: list[_Connection] = []
        self._connect_timeout_s = connect_timeout_s
        self.api = api
        self.endpoint = self.base_url + API_PATHS[api]
        self.model = model
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(
            total=request_timeout_s, sock_connect=connect_timeout_s
        )
        self.request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> StreamClient:
        _raise_fd_limit(self._max_connections or 4096)  # 0 = unlimited (open loop)
        if self.transport == "raw":
            return self
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, read_bufsize=2**18, auto_decompress=False
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _payload(self, request: Request) -> bytes:
        if self.api == "generate":
            body: dict[str, Any] = {
                **({"text": request.text} if request.text is not None else {"input_ids": request.input_ids}),
                "sampling_params": {
                    "max_new_tokens": request.max_new_tokens,
                    "ignore_eos": True,
                    "temperature": 0.0,
                },
                "stream": True,
            }
        else:
            body = {
                "model": self.model or "default",
                "prompt": request.text if request.text is not None else request.input_ids,
                "max_tokens": request.max_new_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
        return orjson.dumps(body)

    async def send(
        self, request: Request, *, t0: float, phase: str = "measure", counter: TokenCounter | None = None
    ) -> RequestRecord:
        """Send ``request``, stream its answer, and return its record (never raises for HTTP/transport).

        Args:
            request: What to send.
            t0: The run's start on the monotonic clock; record times are offsets from it (s).
            phase: Phase label stored in the record.
            counter: Incremented with every streamed chunk's new tokens.

        Returns:
            The :class:`RequestRecord`; ``status`` is ``ok``, ``error`` or ``incomplete`` (cancelled).
        """
        stream = _Stream(counter)
        feed = stream.feed_generate if self.api == "generate" else stream.feed_completions
        loads = orjson.loads

        def on_payload(payload: bytes, now: float) -> None:
            if payload == b"[DONE]":
                stream.done = True
                return
            obj = loads(payload)
            if not isinstance(obj, dict):
                raise _ProtocolError(f"SSE data is not a JSON object: {payload[:80]!r}")
            feed(obj, now)

        body = self._payload(request)
        clock = time.monotonic
        send = clock() - t0
        try:
            if self.transport == "raw":
                status, kind, error = await self._send_raw(body, on_payload, t0)
            else:
                status, kind, error = await self._send_aiohttp(body, on_payload, t0)
        except asyncio.CancelledError:
            status, kind, error = "incomplete", "cancelled", "cancelled before the stream finished"
        if status == "ok":
            if stream.error is not None:
                status, kind, error = "error", "server", stream.error
            elif not stream.done and stream.finish_reason is None:
                status, kind, error = "error", "disconnect", "the stream ended before data: [DONE]"
        end = clock() - t0
        return RequestRecord.model_construct(
            rid=request.rid,
            phase=phase,
            status=status,
            send_time_s=send,
            first_token_time_s=stream.times[0] if stream.times else None,
            end_time_s=end,
            chunk_times_s=stream.times,
            chunk_tokens=stream.tokens,
            prompt_tokens=stream.prompt_tokens,
            completion_tokens=stream.completion_tokens,
            cached_tokens=stream.cached_tokens,
            cached_tiers=stream.cached_tiers,
            finish_reason=stream.finish_reason,
            error=error,
            error_kind=kind,
            input_len=len(request.input_ids),
            max_new_tokens=request.max_new_tokens,
            e2e_latency_s=end - send if status == "ok" else None,
            group=request.group,
            server_rid=stream.server_rid,
            spec_verify_ct=stream.spec_verify_ct,
            prompt_class=request.prompt_class,
        )

    async def _connection(self) -> tuple[_Connection, bool]:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                return conn, True
            conn.close()
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Connection, self._host, self._port), self._connect_timeout_s
        )
        return conn, False

    async def _exchange(
        self, data: bytes, on_payload: Callable[[bytes, float], None] | None, t0: float, timeout_s: float
    ) -> tuple[_Connection | None, tuple[str, str | None, str | None]]:
        """One request on a pooled connection (retried once on a fresh one when a reused
        connection turns out closed before any byte came back)."""
        for attempt in range(2):
            try:
                conn, reused = await self._connection()
            except (TimeoutError, OSError) as err:
                reason = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
                return None, ("error", "connect", f"cannot connect to {self.base_url}: {reason}")
            finished = False
            try:
                await asyncio.wait_for(conn.exchange(data, on_payload, t0), timeout_s)
                finished = True
            except ConnectionResetError as err:
                if reused and not conn.got_bytes and attempt == 0:
                    continue
                return None, ("error", "disconnect", f"connection lost: {err}")
            except TimeoutError:
                return None, ("error", "timeout", f"no complete answer within {timeout_s:g} s")
            except _ProtocolError as err:
                return None, ("error", "server", str(err))
            finally:
                if finished and conn.usable():
                    self._idle.append(conn)
                elif not finished or not conn.keep_alive:
                    conn.close()
            return conn, ("ok", None, None)
        return None, ("error", "disconnect", "connection lost twice")  # not reached

    async def _send_raw(
        self, body: bytes, on_payload: Callable[[bytes, float], None], t0: float
    ) -> tuple[str, str | None, str | None]:
        data = self._request_head + b"%d\r\n\r\n" % len(body) + body
        conn, outcome = await self._exchange(data, on_payload, t0, self.request_timeout_s)
        if conn is None:
            return outcome
        if conn.status != 200 or not conn.is_sse:
            what = f"HTTP {conn.status}" if conn.status != 200 else "HTTP 200 without an SSE stream"
            return "error", "http", _http_error(what, self.endpoint, b"".join(conn.body)[:_ERROR_BODY_BYTES])
        return outcome

    async def _send_aiohttp(
        self, body: bytes, on_payload: Callable[[bytes, float], None], t0: float
    ) -> tuple[str, str | None, str | None]:
        assert self._session is not None, "use StreamClient as an async context manager"
        clock = time.monotonic
        try:
            async with self._session.post(self.endpoint, data=body, headers=self._headers) as resp:
                if resp.status != 200:
                    body = (await resp.read())[:_ERROR_BODY_BYTES]
                    return "error", "http", _http_error(f"HTTP {resp.status}", self.endpoint, body)
                buf = b""
                readany = resp.content.readany
                while data := await readany():
                    now = clock() - t0
                    if buf:
                        data, buf = buf + data, b""
                    if not data.endswith(b"\n"):  # keep a partial line for the next read
                        cut = data.rfind(b"\n") + 1
                        data, buf = data[:cut], data[cut:]
                    for line in data.split(b"\n"):
                        if line[:5] == b"data:":
                            payload = line[5:].strip()
                            if payload:
                                on_payload(payload, now)
        except aiohttp.ClientConnectorError as err:
            return "error", "connect", f"cannot connect to {self.base_url}: {err.os_error or err}"
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as err:
            return "error", "disconnect", f"connection lost: {type(err).__name__}: {err}"
        except (TimeoutError, aiohttp.ServerTimeoutError):
            return "error", "timeout", f"no complete answer within {self.request_timeout_s:g} s"
        except aiohttp.ClientError as err:
            return "error", "http", f"{type(err).__name__}: {err}"
        except (_ProtocolError, ValueError, AttributeError, TypeError, KeyError) as err:
            return "error", "server", f"unreadable SSE data: {type(err).__name__}: {err}"
        return "ok", None, None

    async def _discover_model(self, timeout_s: float) -> None:
        if self.transport == "raw":
            data = self._get_head.format(path=urlsplit(self.base_url).path + "/v1/models").encode("latin-1")
            conn, (status, _, _) = await self._exchange(data, None, time.monotonic(), timeout_s)
            try:
                parsed = orjson.loads(b"".join(conn.body)) if conn is not None and conn.status == 200 else None
                self.model = parsed["data"][0]["id"] if parsed else (self.model or "default")
            except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
                self.model = self.model or "default"
            return
        assert self._session is not None
        try:
            async with self._session.get(
                self.base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status == 200:
                    data = await resp.json(loads=orjson.loads, content_type=None)
                    self.model = data["data"][0]["id"]
        except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError):
            self.model = self.model or "default"

    async def check(self, *, timeout_s: float = 30.0) -> RequestRecord:
        """Send one 8-token, 1-output-token streamed request and fail clearly if it does not work.

        Args:
            timeout_s: Limit for the whole check.

        Returns:
            The probe's record (not part of any measurement).

        Raises:
            LoadError: The server is down, the URL is not an SGLang server, or the probe failed.
        """
        if self.api == "completions" and self.model is None:
            await self._discover_model(min(timeout_s, 10.0))
        probe = Request.model_construct(
            rid="probe", input_ids=list(range(100, 108)), max_new_tokens=1, arrival_s=None, group=None, after=None
        )
        timeout = LoadError(
            f"{self.endpoint} gave no answer to a 1-token request within {timeout_s:g} s",
            hint="check that the server is up and idle, or raise the timeout",
        )
        try:
            # send() turns the cancellation into an "incomplete" record, so wait_for returns it.
            record = await asyncio.wait_for(self.send(probe, t0=time.monotonic()), timeout_s)
        except TimeoutError as err:
            raise timeout from err
        if record.status == "incomplete":
            raise timeout
        if record.status == "ok":
            return record
        if record.error_kind == "connect":
            raise LoadError(f"cannot connect to {self.base_url}", hint="start the server or fix --url")
        if record.error_kind == "http" and (record.error or "").startswith("HTTP 404"):
            raise LoadError(
                f"{self.endpoint} answered HTTP 404: not an SGLang server",
                hint="point --url at the server's base URL (e.g. http://127.0.0.1:30000) or choose --api",
            )
        raise LoadError(
            f"a 1-token probe request to {self.endpoint} failed: {record.error}",
            hint="check the server's log; its /health must answer 200",
        )
