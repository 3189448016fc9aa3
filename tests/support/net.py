"""Loopback networking for tests."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bind port 0, read it, release it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class CuttableProxy:
    """A TCP forwarder on 127.0.0.1 whose link can be cut and restored: a host's network to its
    database server going down (live connections dropped, new ones reset) and coming back.

    Args:
        target_port: The port on 127.0.0.1 to forward to.
    """

    def __init__(self, target_port: int) -> None:
        import threading

        self.target_port = target_port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def cut(self) -> None:
        """Drop every live connection and reset new ones until :meth:`restore`."""
        self._cut.set()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def restore(self) -> None:
        """Forward new connections again."""
        self._cut.clear()

    def close(self) -> None:
        """Stop listening and drop everything."""
        self.cut()
        self._server.close()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self._cut.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()
