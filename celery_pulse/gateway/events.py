"""Celery events on behalf of gateway workers: Flower (and ``celery events``) see them.

A gateway worker sends no events (it has no broker). The gateway, which has one, sends
them for it under the worker's holder name (``gw:<credential>:<instance>``, so the
hostname itself says which kind it is): ``worker-online`` when a session opens,
``worker-heartbeat`` with the registry's heartbeat, ``worker-offline`` when the last
session ends, and ``task-started`` / ``task-succeeded`` / ``task-failed`` as the store
applies each start and finish. Publishing runs in a thread of its own (one: events go
out in the order sent, and never wait behind store calls for a thread), and a failure
is logged, never in a session's way: events are for watching, the claims fence the work.

Task events are sent as a Celery worker under its event loop sends them: buffered
(Celery's ``buffer_group``) and published together, one ``task.multi`` message for
those queued meanwhile, when the thread has no more to send (``EventReceiver``, and
so Flower, reads a batch as its events). One message per event cost the gateway a
seventh of its CPU on short tasks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

from celery.events.event import group_from

logger = logging.getLogger(__name__)

#: What the worker events say sent them (``sw_ident``).
SOFTWARE = "celery-pulse-gateway"
#: The most task events published in one message.
BUFFER_LIMIT = 100


class GatewayEvents:
    """One event dispatcher per gateway, sending for any of its instances."""

    def __init__(self, app: Any, freq: float) -> None:
        self.app, self.freq = app, freq
        self._lock = threading.Lock()
        self._dispatcher: Any = None
        self._connection: Any = None
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pulse-gateway-events")
        #: Events handed to the thread and not sent yet: the last one flushes the buffer.
        self._queued = 0
        self._counting = threading.Lock()  # never held while publishing (the loop takes it)

    def _send(self, kind: str, hostname: str, fields: dict[str, Any]) -> None:
        with self._counting:
            self._queued -= 1
            last = self._queued == 0
        with self._lock:
            if self._dispatcher is None:
                self._connection = self.app.connection_for_write()
                self._dispatcher = self.app.events.Dispatcher(
                    self._connection, enabled=True, buffer_group=["task"],
                    buffer_limit=BUFFER_LIMIT)
            try:
                # One dispatcher speaks for every instance: the event's hostname is the
                # dispatcher's, set under the lock for each send (a buffered event keeps
                # the hostname it was made with).
                self._dispatcher.hostname = hostname
                if group_from(kind) not in self._dispatcher.buffer_group:
                    self._dispatcher.flush()  # the buffered events before it go first
                self._dispatcher.send(kind, **fields)
                if last:
                    self._dispatcher.flush()
            except Exception:
                self._dispatcher, connection = None, self._connection  # reconnect next time
                self._connection = None
                if connection is not None:
                    connection.release()
                raise

    async def send(self, kind: str, hostname: str, **fields: Any) -> None:
        with self._counting:
            self._queued += 1
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._thread, self._send, kind, hostname, fields)
        except Exception as exc:
            logger.warning("pulse gateway: %s event for %s not sent: %r", kind, hostname, exc)

    def worker(self, kind: str, hostname: str, active: int = 0) -> Any:
        """``worker-online`` / ``worker-heartbeat`` / ``worker-offline`` for ``hostname``."""
        return self.send(f"worker-{kind}", hostname, freq=self.freq, active=active,
                         processed=0, sw_ident=SOFTWARE, sw_ver="1", sw_sys="gateway")

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.release()
            self._dispatcher = self._connection = None
