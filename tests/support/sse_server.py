"""A small, fast SGLang-shaped SSE server for the load generator's tests and benchmark.

Run as a subprocess: ``python tests/support/sse_server.py --port 0 [--ttft-ms 5 --itl-ms 20 --workers 2]``;
it prints ``PORT <n>`` once listening. It answers ``POST /generate`` (``input_ids``,
``sampling_params.max_new_tokens``; SSE ``data: {json}`` lines with cumulative
``meta_info.completion_tokens``, ``prompt_tokens``, ``cached_tokens``, ``finish_reason`` and
``data: [DONE]``, as ``shared/sglang-reference.md`` §5.3 describes), ``POST /v1/completions``
(token-id ``prompt``; ``usage`` per chunk with ``continuous_usage_stats``, a final usage chunk with
``prompt_tokens_details.cached_tokens``), ``GET /health``, ``GET /v1/models`` and ``GET /stats``
(per request: the server's receive and first-token send times on the monotonic clock, which is
system-wide on Linux, so the benchmark can compare them with the client's).

Each stream gets its first token ``ttft_ms`` after it is admitted, then one token every
``itl_ms``, on a 1 ms timing wheel (so streams are spread in time, not sent in bursts). With
``--capacity N`` at most N streams run at once and the rest queue, so latency grows with load. Prefix
caching is modelled per 64-token block of the prompt (``--no-cache`` turns it off). Raw asyncio
protocols keep the server cheap; ``--workers N`` forks N processes sharing one listening socket.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import sys
import time

BLOCK = 64
# SSE lines as bytes templates (cheap to fill; the JSON matches §5.3's fields).
GENERATE = (
    b'data: {"text":"%s","output_ids":[7],"meta_info":{"id":"%s","prompt_tokens":%d,'
    b'"completion_tokens":%d,"cached_tokens":%d,"finish_reason":%s%s}}\n\n'
)
COMPLETION = (
    b'data: {"id":"%s","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":%s}],'
    b'"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n'
)
USAGE = (
    b'data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,'
    b'"prompt_tokens_details":{"cached_tokens":%d}}}\n\n'
)


class Engine:
    """Streams due tokens on a 1 ms wheel."""

    def __init__(self, ttft_s: float, itl_s: float, cache: bool, stamp: bool, capacity: int, fail: str = "") -> None:
        self.ttft_s, self.itl_s, self.cache, self.stamp, self.fail = ttft_s, itl_s, cache, stamp, fail
        self.capacity, self.running, self.queue = capacity, 0, collections.deque()
        self.wheel: dict[int, list[Stream]] = {}
        self.blocks: set[int] = set()
        self.stats: dict[str, list[float]] = {}
        self.next_id = 0

    def slot(self, t: float) -> int:
        return int(t * 1000)

    def admit(self, stream: Stream) -> None:
        """Start ``stream`` if fewer than ``capacity`` run, else queue it (its TTFT then grows)."""
        if self.capacity and self.running >= self.capacity:
            self.queue.append(stream)
            return
        self.running += 1
        stream.due = time.monotonic() + self.ttft_s
        self.add(stream, stream.due)

    def finished(self) -> None:
        self.running -= 1
        while self.queue and (not self.capacity or self.running < self.capacity):
            stream = self.queue.popleft()
            if not stream.conn.closed:
                self.admit(stream)

    def add(self, stream: Stream, due: float) -> None:
        self.wheel.setdefault(self.slot(due), []).append(stream)

    def cached_tokens(self, ids: list[int]) -> int:
        if not self.cache:
            return 0
        hit, h = 0, 0
        hits_possible = True
        for end in range(BLOCK, len(ids) + 1, BLOCK):
            h = hash((h, tuple(ids[end - BLOCK:end])))
            if hits_possible and h in self.blocks:
                hit = end
            else:
                hits_possible = False
                self.blocks.add(h)
        return min(hit, len(ids) - 1) if hit else 0

    async def run(self, stats_dir: str) -> None:
        current = self.slot(time.monotonic())
        dumped_at, dumped = time.monotonic(), 0
        while True:
            if stats_dir and time.monotonic() - dumped_at > 0.5 and len(self.stats) != dumped:
                dumped_at, dumped = time.monotonic(), len(self.stats)
                path = os.path.join(stats_dir, f"{os.getpid()}.json")
                with open(path + ".tmp", "w") as f:
                    json.dump(self.stats, f)
                os.replace(path + ".tmp", path)
            now_slot = self.slot(time.monotonic())
            while current <= now_slot:
                for stream in self.wheel.pop(current, ()):
                    stream.emit(self)
                current += 1
            await asyncio.sleep(max(0.0, (current / 1000) - time.monotonic()))


class Stream:
    __slots__ = ("conn", "api", "rid", "prompt", "cached", "total", "done_tokens", "recv", "first", "due")

    def __init__(self, conn: Conn, api: str, rid: str, prompt: int, cached: int, total: int, recv: float) -> None:
        self.conn, self.api, self.rid = conn, api, rid
        self.prompt, self.cached, self.total = prompt, cached, total
        self.done_tokens, self.recv, self.first, self.due = 0, recv, 0.0, 0.0

    def emit(self, engine: Engine) -> None:
        if self.conn.closed:
            engine.finished()
            return
        self.done_tokens += 1
        now = time.monotonic()
        if engine.fail and self.done_tokens == 3:
            self.fail(engine)
            return
        if self.done_tokens == 1:
            self.first = now
            engine.stats[self.rid] = [self.recv, now]
        finished = self.done_tokens >= self.total
        rid = self.rid.encode()
        if self.api == "generate":
            reason = b'{"type":"length","length":%d}' % self.total if finished else b"null"
            stamp = b',"server_first_token_s":%.6f' % self.first if engine.stamp else b""
            out = [GENERATE % (b"x" * self.done_tokens, rid, self.prompt, self.done_tokens, self.cached, reason, stamp)]
        else:
            reason = b'"length"' if finished else b"null"
            out = [COMPLETION % (rid, reason, self.prompt, self.done_tokens, self.prompt + self.done_tokens)]
        if finished:
            if self.api == "completions":
                out.append(USAGE % (self.prompt, self.total, self.prompt + self.total, self.cached))
            out.append(b"data: [DONE]\n\n")
        data = b"".join(out)
        self.conn.write_chunk(data)
        if finished:
            self.conn.end_stream()
            engine.finished()
        else:
            self.due += engine.itl_s
            engine.add(self, self.due)


    def fail(self, engine: Engine) -> None:
        """``--fail``: end the third token's chunk the way a failing server does."""
        if engine.fail == "abort":
            reason = b'{"type":"abort","message":"aborted by test","status_code":500}'
            self.conn.write_chunk(GENERATE % (b"xx", self.rid.encode(), self.prompt, 2, 0, reason, b"") + b"data: [DONE]\n\n")
            self.conn.end_stream()
        elif engine.fail == "error":
            self.conn.write_chunk(b'data: {"error":{"message":"boom in the test server"}}\n\ndata: [DONE]\n\n')
            self.conn.end_stream()
        elif engine.fail == "garbage":
            self.conn.write_chunk(b"data: [1, 2]\n\ndata: [DONE]\n\n")
            self.conn.end_stream()
        elif engine.fail == "cut":
            assert self.conn.transport is not None
            self.conn.transport.close()
        engine.finished()


class Conn(asyncio.Protocol):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buf = b""
        self.closed = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # asyncio sets TCP_NODELAY only on sockets made with proto=IPPROTO_TCP; without it,
        # Nagle + delayed ACK hold every small SSE chunk for ~40 ms.
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            method, path = head[0].split(" ")[:2]
            self.handle(method, path, body)

    def reply(self, status: str, body: bytes, content_type: str = "application/json") -> None:
        assert self.transport is not None
        self.transport.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    def write_chunk(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        assert self.transport is not None
        self.transport.write(b"0\r\n\r\n")

    def handle(self, method: str, path: str, body: bytes) -> None:
        engine = self.engine
        if path == "/health":  # an empty body (Content-Length: 0)
            return self.reply("200 OK", b"")
        if method == "GET" and path == "/v1/models":
            return self.reply("200 OK", b'{"object":"list","data":[{"id":"sse-test-model","object":"model"}]}')
        if method == "GET" and path == "/stats":
            return self.reply("200 OK", json.dumps(engine.stats).encode())
        if method != "POST" or path not in ("/generate", "/v1/completions"):
            return self.reply("404 Not Found", b'{"detail":"Not Found"}')
        if engine.fail == "http500" and body != b"" and b'"max_new_tokens":1,' not in body:
            return self.reply("500 Internal Server Error", b'{"error":{"message":"overloaded (test)"}}')
        recv = time.monotonic()
        req = json.loads(body)
        if path == "/generate":
            api, ids = "generate", req["input_ids"]
            total = req["sampling_params"]["max_new_tokens"]
        else:
            api, ids, total = "completions", req["prompt"], req["max_tokens"]
        if not isinstance(ids, list) or not ids or total < 1:
            return self.reply("400 Bad Request", b'{"error":{"message":"bad request"}}')
        engine.next_id += 1
        rid = f"{os.getpid()}-{engine.next_id}"
        stream = Stream(self, api, rid, len(ids), engine.cached_tokens(ids), total, recv)
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        engine.admit(stream)


async def serve(sock: socket.socket, args: argparse.Namespace) -> None:
    engine = Engine(args.ttft_ms / 1000, args.itl_ms / 1000, not args.no_cache, args.stamp, args.capacity, args.fail)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(engine), sock=sock)
    ticker = loop.create_task(engine.run(args.stats_dir))
    async with server:
        await asyncio.gather(server.serve_forever(), ticker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=5.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cpus", default="", help="comma-separated CPUs to pin the workers to")
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--capacity", type=int, default=0, help="streams decoded at once; more wait (0 = unlimited)")
    parser.add_argument("--fail", choices=["", "abort", "error", "garbage", "cut", "http500"], default="",
                        help="fail every stream at its 3rd token (http500: every request but the 1-token check)")
    parser.add_argument("--stamp", action="store_true", help="put server_first_token_s in meta_info")
    parser.add_argument("--stats-dir", default="", help="each worker writes {rid: [recv_s, first_token_s]} here")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(4096)
    sock.setblocking(False)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    for _ in range(args.workers - 1):
        if os.fork() == 0:
            break
    try:
        import uvloop  # the server must not be the benchmark's bottleneck
    except ImportError:
        uvloop = None
    try:
        (uvloop.run if uvloop is not None else asyncio.run)(serve(sock, args))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
