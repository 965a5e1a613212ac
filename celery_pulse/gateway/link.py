"""One gateway connection's I/O: its bounds, its bounded writer, and how it ends.

The asyncio shell's smallest room (websockets' ``ServerConnection`` underneath): frames
are written by one task per connection from a queue of at most ``outbound_frames``; a
peer that doesn't read fills it and is disconnected (:class:`Closing`), and a write
taking longer than ``write_timeout`` ends the connection; a peer that said nothing for
a while is asked whether it is still there (a ping). Nothing here knows a frame's
meaning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode

from celery_pulse.gateway import frames
from celery_pulse.gateway.deadlines import within
from celery_pulse.gateway.frames import Frame, ProtocolError

# The server's log lines keep the server's logger name, wherever their code lives.
logger = logging.getLogger("celery_pulse.gateway.server")


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """The seed's bounds (§6): a development baseline, not load-tested figures."""

    max_connections: int = 128
    #: Places held by handshakes whose credential isn't checked yet (None: a quarter of
    #: ``max_connections``) and by one credential (None: half of it): see
    #: :mod:`celery_pulse.gateway.admission`.
    max_unauthenticated: int | None = None
    max_per_credential: int | None = None
    #: Credential lookups in the store at once (the rest of the handshakes wait).
    credential_checks: int = 2
    inbound_frames: int = 4
    #: Frames waiting to be written: half for assignments (a feeder's batch at most).
    outbound_frames: int = 16
    hello_timeout: float = 5.0
    read_idle: float = 60.0
    write_timeout: float = 5.0
    store_timeout: float = 8.0
    #: How long a session lives without an operation (the seed's 45 s window).
    session_ttl: float = 45.0
    #: The longest execution lease the gateway grants (the seed's 30 s).
    lease_ttl: float = 30.0
    #: How often a gateway asks the store whether its sessions are still current (one
    #: replaced on another gateway is closed within this).
    session_check: float = 1.0
    #: Operations of one connection applied at once (each attempt's in order).
    concurrent_operations: int = 16
    #: Dispatch rounds (one reservation statement each, any number of tasks) per second
    #: per instance; 0: as fast as slots free up (the seed's baseline is 4: see
    #: docs/gateway.md, Limits).
    dispatch_rate: float = 0.0


class Closing(Exception):
    """End this connection with ``code`` after sending ``error`` (if any)."""

    def __init__(self, code: int, reason: str, error: ProtocolError | None = None) -> None:
        super().__init__(reason)
        self.code, self.reason, self.error = code, reason, error


class Link:
    """One connection's writer: a bounded queue of frames and one task writing them,
    each write under the write deadline."""

    def __init__(self, conn: ServerConnection, limits: Limits) -> None:
        self.conn = conn
        self.limits = limits
        self._queue: asyncio.Queue[str | None] = asyncio.Queue(limits.outbound_frames)
        self._task = asyncio.create_task(self._write())

    def pending(self) -> int:
        """Frames queued and not yet written."""
        return self._queue.qsize()

    def send(self, frame: Frame) -> None:
        try:
            self._queue.put_nowait(frames.encode(frame))
        except asyncio.QueueFull:
            raise Closing(CloseCode.POLICY_VIOLATION, "slow consumer: outbound queue full"
                           ) from None

    async def _write(self) -> None:
        while True:
            text = await self._queue.get()
            if text is None:
                return
            try:
                await within(self.conn.send(text), self.limits.write_timeout)
            except (TimeoutError, ConnectionClosed):
                logger.info("pulse gateway: dropping %s: write did not complete",
                            self.conn.remote_address)
                self.conn.transport.abort()
                return

    async def answers_ping(self) -> bool:
        """Whether a peer with nothing to say for ``read_idle`` is still there: it answers
        a ping within the write deadline. A pong counts as a read (seed 003 §6's read
        idle): every WebSocket client answers pings on its own, so a worker idle for
        hours keeps its session and nothing has to be sent to keep it."""
        async def probe() -> None:
            pong = await self.conn.ping()  # the write itself may wait: both under the deadline
            await pong

        try:
            await asyncio.wait_for(probe(), self.limits.write_timeout)
        except (TimeoutError, ConnectionClosed):
            return False
        return True

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        """Write what is queued (within the write deadline), then close."""
        try:
            self._queue.put_nowait(None)
            await asyncio.wait_for(asyncio.shield(self._task), self.limits.write_timeout)
        except (asyncio.QueueFull, TimeoutError):
            self._task.cancel()
        await self.conn.close(code, reason)


class suppress_closing:
    """A frame that can't be queued any more (the link is closing anyway) is dropped."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, Closing)


def server_ssl_context(certfile: str, keyfile: str | None) -> ssl.SSLContext:
    """TLS for the gateway (``ssl`` module defaults: TLS 1.2+, no compression), issuing
    no TLS 1.3 session tickets.

    A TLS 1.3 server sends its tickets just after the handshake, while the worker is
    sending its upgrade request. A threaded client (websockets' sync client, which
    :class:`~celery_pulse.gateway.client.GatewayClient` is) reads them in one thread
    while it writes in another, and an OpenSSL connection is not safe for both at once:
    now and then the request is lost and the handshake times out (reproduced here about
    once in a few hundred connections). Workers reconnect rarely, so resumption buys
    nothing worth that.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    context.num_tickets = 0
    return context
