"""Test helper (tests/sglang): a real HTTP server on 127.0.0.1 serving canned SGLang answers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve(routes: dict[str, tuple[int, str]]) -> Iterator[str]:
    """Serve ``path -> (status, body)`` on a free loopback port; yields the base URL."""
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            status, body = routes.get(self.path, (404, "not found"))
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

