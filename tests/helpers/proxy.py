"""A TCP proxy between a client and a server that a test can cut: every connection
through it is dropped at once (both sides see the TCP connection end), new ones are
let through again; or :meth:`freeze` it: connections stay open and nothing passes (a
peer gone silent, a network partition without a reset). TLS passes through untouched:
the client still checks the server's certificate end to end."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Proxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self.connections = 0
        #: When each connection was let through (``time.time()``), oldest first.
        self.accepted_at: list[float] = []
        self._closed = False
        self._flowing = threading.Event()
        self._flowing.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))
                self.connections += 1
                self.accepted_at.append(time.time())
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self._flowing.wait()  # frozen: held, never delivered
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def freeze(self) -> None:
        """Deliver nothing more, either way, and close nothing (until :meth:`close`)."""
        self._flowing.clear()

    def cut(self) -> int:
        """Drop every connection now; how many there were."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        return len(pairs)

    def close(self) -> None:
        """Let no new connection through (the listener shut down: a blocked accept ends,
        so nothing is accepted after this) and drop every connection."""
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.cut()
