"""Streaming client: sends one :class:`~tuner.load.workloads.Request` over SSE and records its timeline.

One ``aiohttp.ClientSession`` per run, its connector sized to the run's concurrency. Two APIs
(``shared/sglang-reference.md`` §5.3):

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

Token counts always come from the server. Times use the monotonic clock, taken once per network
read, so events that arrived together share a timestamp. Transport errors are mapped to
``RequestRecord.error_kind`` here (``connect``, ``disconnect``, ``timeout``, ``http``, ``server``,
``cancelled``), and to :class:`tuner.errors.LoadError` in :meth:`StreamClient.check`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import orjson

from tuner.errors import LoadError
from tuner.load.metrics import RequestRecord
from tuner.load.workloads import Request

__all__ = ["Api", "API_PATHS", "TokenCounter", "StreamClient", "normalize_url"]

Api = Literal["generate", "completions"]
API_PATHS: Mapping[str, str] = MappingProxyType({"generate": "/generate", "completions": "/v1/completions"})
logger = logging.getLogger(__name__)


class TokenCounter:
    """Running count of streamed output tokens and chunks, read by the live statistics."""

    __slots__ = ("tokens", "chunks")

    def __init__(self) -> None:
        self.tokens = 0
        self.chunks = 0


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
        LoadError: Not an ``http://`` or ``https://`` URL with a host.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise LoadError(f"--url {url!r} is not an http(s) URL", hint="pass the server's base URL, e.g. http://127.0.0.1:30000")
    path = parts.path.rstrip("/")
    for suffix in API_PATHS.values():
        path = path.removesuffix(suffix)
    return f"{parts.scheme}://{parts.netloc}{path}"


class _Stream:
    """Per-request parse state; one ``feed`` call per SSE ``data:`` payload."""

    __slots__ = (
        "times", "tokens", "last_ct", "prompt_tokens", "completion_tokens", "cached_tokens",
        "finish_reason", "error", "done", "counter", "server_rid",
    )

    def __init__(self, counter: TokenCounter | None) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.last_ct = 0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.done = False
        self.counter = counter
        self.server_rid: str | None = None

    def _add(self, new: int, now: float) -> None:
        self.times.append(now)
        self.tokens.append(new)
        if self.counter is not None:
            self.counter.tokens += new
            self.counter.chunks += 1

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
            self._add(new, now)
        if "prompt_tokens" in meta:
            self.prompt_tokens = meta["prompt_tokens"]
        if "cached_tokens" in meta:
            self.cached_tokens = meta["cached_tokens"]
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
            self._add(new, now)
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        err = err.get("message") or err
    return " ".join(str(err).split())[:300]


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

    Raises:
        LoadError: A malformed URL.
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
    ) -> None:
        if api not in API_PATHS:
            raise LoadError(f"--api {api!r} is not supported", hint="use generate or completions")
        self.base_url = normalize_url(url)
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
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, read_bufsize=2**18, auto_decompress=False
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _payload(self, request: Request) -> bytes:
        if self.api == "generate":
            body: dict[str, Any] = {
                "input_ids": request.input_ids,
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
                "prompt": request.input_ids,
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
        assert self._session is not None, "use StreamClient as an async context manager"
        stream = _Stream(counter)
        feed = stream.feed_generate if self.api == "generate" else stream.feed_completions
        body = self._payload(request)
        clock = time.monotonic
        send = clock() - t0
        status, error, kind = "ok", None, None
        try:
            async with self._session.post(self.endpoint, data=body, headers=self._headers) as resp:
                if resp.status != 200:
                    text = (await resp.text(errors="replace"))[:200]
                    status, kind = "error", "http"
                    error = f"HTTP {resp.status} from {self.endpoint}: {' '.join(text.split())}"
                else:
                    buf = b""
                    loads = orjson.loads
                    readany = resp.content.readany
                    while data := await readany():
                        now = clock() - t0
                        if buf:
                            data, buf = buf + data, b""
                        if not data.endswith(b"\n"):  # keep a partial line for the next read
                            cut = data.rfind(b"\n") + 1
                            data, buf = data[:cut], data[cut:]
                        for line in data.split(b"\n"):
                            if line[:5] != b"data:":
                                continue
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                stream.done = True
                            elif payload:
                                feed(loads(payload), now)
                    if stream.error is not None:
                        status, kind, error = "error", "server", stream.error
                    elif not stream.done and stream.finish_reason is None:
                        status, kind = "error", "disconnect"
                        error = "the stream ended before data: [DONE]"
        except asyncio.CancelledError:
            status, kind, error = "incomplete", "cancelled", "cancelled before the stream finished"
        except aiohttp.ClientConnectorError as err:
            status, kind, error = "error", "connect", f"cannot connect to {self.base_url}: {err.os_error or err}"
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError) as err:
            status, kind, error = "error", "disconnect", f"connection lost: {type(err).__name__}: {err}"
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            status, kind, error = "error", "timeout", f"no complete answer within {self.request_timeout_s:g} s"
        except aiohttp.ClientError as err:
            status, kind, error = "error", "http", f"{type(err).__name__}: {err}"
        except orjson.JSONDecodeError as err:
            status, kind, error = "error", "server", f"invalid JSON in the SSE stream: {err}"
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
            finish_reason=stream.finish_reason,
            error=error,
            error_kind=kind,
            input_len=len(request.input_ids),
            max_new_tokens=request.max_new_tokens,
            e2e_latency_s=end - send if status == "ok" else None,
            group=request.group,
            server_rid=stream.server_rid,
        )

    async def _discover_model(self, timeout_s: float) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                self.base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status == 200:
                    data = await resp.json(loads=orjson.loads, content_type=None)
                    self.model = data["data"][0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, TypeError, ValueError):
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
        except asyncio.TimeoutError as err:
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
