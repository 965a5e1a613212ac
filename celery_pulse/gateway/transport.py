"""``pulsegw://``: the broker of a gateway worker, as a kombu virtual transport.

Deliveries are the ``task.assign`` frames the worker's gateway client received: each is
already reserved in the store for this instance, and acknowledged to the real broker by
the gateway. So acknowledging here is kombu's bookkeeping only, and giving a delivery
back keeps it in this process (its lease at the gateway decides). A gateway worker holds
no broker credentials: what a running task publishes to its own queue (``self.retry()``,
a chain's next step, ``apply_async``) is kept and travels in the attempt's
``task.finish``, and the gateway publishes it before it applies the finish, as a direct
worker's pool child publishes before its completion. Anything else, or a publication
outside a task, fails with a clear error (docs/gateway.md). Its remote-control queue
holds only the ``revoke`` messages its gateway's ``task.cancel`` frames carry
(:mod:`.cancels`).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import os
import queue as queue_module
import uuid
from typing import Any

from kombu.transport import virtual

from celery_pulse.deferral import deferral, keep_published
from celery_pulse.errors import PulseError
from celery_pulse.gateway.cancels import PIDBOX_SUFFIX, pidbox_message
from celery_pulse.gateway.worker import EPOCH_HEADER, client_for

#: How often the worker's loop looks for an assignment (the client fills a queue).
POLLING_INTERVAL = 0.005


#: A publication's AMQP properties the gateway passes on (the rest are the broker's).
CARRIED_PROPERTIES = ("correlation_id", "reply_to", "priority", "delivery_mode")
#: At most this much of a task's publications rides in one finish (its result is at most
#: 256 KiB, and the task's own result shares it).
PUBLISHED_LIMIT = 128 * 1024


class NoPublishing(PulseError):
    """A gateway worker publishes only from a running task and to its own queue (it has
    no broker: what it publishes travels in the task's finish)."""


def _running_queue() -> str | None:
    """The queue the task running in this thread came from (the transport routed it with
    the default exchange, so Celery sends its retry straight back there)."""
    from celery import current_task

    request = getattr(current_task, "request", None)
    info = getattr(request, "delivery_info", None) or {}
    queue = info.get("routing_key")
    return queue if isinstance(queue, str) else None


def kept(message: dict[str, Any], exchange: str, routing_key: str) -> dict[str, Any]:
    """A task's publication as its finish carries it (``publish`` in the result: see
    docs/gateway.md), or :class:`NoPublishing` saying why it can't be."""
    queue = _running_queue()
    if queue is None:
        raise NoPublishing("a gateway worker publishes only from a running task (its "
                           "messages travel in the task's finish)")
    if routing_key != queue or exchange not in ("", queue):
        raise NoPublishing(f"a gateway worker publishes only to its own queue {queue!r}, "
                           f"not to exchange {exchange!r} with routing key {routing_key!r}: "
                           f"route that task to a direct worker's queue")
    body = message["body"]
    properties = message.get("properties") or {}
    publication = {
        "queue": queue,
        "body": base64.b64encode(body if isinstance(body, bytes) else body.encode()).decode(),
        "content_type": message.get("content-type"),
        "content_encoding": message.get("content-encoding"),
        "headers": dict(message.get("headers") or {}),
        "properties": {k: properties[k] for k in CARRIED_PROPERTIES
                       if properties.get(k) is not None}}
    try:
        size = len(json.dumps(publication, allow_nan=False, separators=(",", ":")))
    except (TypeError, ValueError) as exc:
        raise NoPublishing(f"a gateway worker's publication travels as JSON: {exc}") from None
    if size > PUBLISHED_LIMIT:
        raise NoPublishing(f"a publication of {size} bytes is over the {PUBLISHED_LIMIT} a "
                           f"gateway worker's finish carries")
    return publication


class Channel(virtual.Channel):
    do_restore = False
    supports_fanout = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._returned: collections.deque[dict[str, Any]] = collections.deque()

    def _client(self) -> Any:
        url = self.connection.client.transport_options.get("gateway_url")
        return client_for(url) if url else None

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        client = self._client()
        if client is not None and queue.endswith(PIDBOX_SUFFIX):
            return pidbox_message(client.controls.get_nowait(), queue)  # Empty if none
        if client is None or queue != client.queue_id:
            raise queue_module.Empty()
        if self._returned:
            return self._returned.popleft()
        assigned = client.assignments.get_nowait()  # Empty when there is none
        task = assigned.message
        properties = dict(task.get("properties") or {})
        properties.update(body_encoding="base64", delivery_tag=uuid.uuid4().hex,
                          delivery_info={**dict(task.get("delivery_info") or {}),
                                         "exchange": "", "routing_key": queue})
        return {"body": task["body"], "content-type": task["content_type"],
                "content-encoding": task["content_encoding"],
                "headers": {**dict(task.get("headers") or {}),
                            EPOCH_HEADER: assigned.ref["epoch"]},
                "properties": properties}

    def _restore(self, message: Any) -> None:
        """Given back (a pause, a reject with requeue): kept here, first in line."""
        self._returned.appendleft(message.serializable())

    def basic_publish(self, message: Any, exchange: str, routing_key: str, **kwargs: Any
                      ) -> None:
        """Kept for the running task's finish (:func:`kept`), never routed here."""
        publication = kept(message, exchange, routing_key)
        carried = sum(len(json.dumps(p, separators=(",", ":")))
                      for p in [*(deferral.published or ()), publication])
        if carried > PUBLISHED_LIMIT:
            raise NoPublishing(f"this task's publications are over the {PUBLISHED_LIMIT} "
                               f"bytes a gateway worker's finish carries")
        if not keep_published(publication):
            raise NoPublishing("a gateway worker publishes only from a running task")

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        raise NoPublishing()

    def _size(self, queue: str) -> int:
        client = self._client()
        if client is not None and queue.endswith(PIDBOX_SUFFIX):
            return int(client.controls.qsize())
        if client is None or queue != client.queue_id:
            return 0
        return int(client.assignments.qsize()) + len(self._returned)

    def _purge(self, queue: str) -> int:
        return 0

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return True

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        return None

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        return None

    def _queue_bind(self, *args: Any) -> None:
        return None


class Transport(virtual.Transport):
    """On the worker's event loop (asynchronous, so the pulse pool runs its hub path):
    the client's wake-up pipe is a reader, and every assignment waiting is delivered as
    soon as it is readable; a timer picks up deliveries given back meanwhile."""

    Channel = Channel
    state = virtual.BrokerState()
    driver_type = "pulsegw"
    driver_name = "pulsegw"
    polling_interval = POLLING_INTERVAL
    #: ``fanout``: Celery's remote control consumes its broadcast queue (only the
    #: revokes :mod:`.cancels` puts there; nothing is ever published to it).
    implements = virtual.Transport.implements.extend(
        asynchronous=True, exchange_type=frozenset({"direct", "topic", "fanout"}))

    def driver_version(self) -> str:
        return "1"

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        options = getattr(self.client, "transport_options", None) or {}
        url = options.get("gateway_url")
        client = client_for(url) if url else None
        if client is None:
            return
        fd = client.wakeup_fd()
        loop.add_reader(fd, self._on_readable, connection, fd)
        loop.call_repeatedly(0.1, self._deliver_waiting, connection)

    def _on_readable(self, connection: Any, fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 4096)
        self._deliver_waiting(connection)

    def _deliver_waiting(self, connection: Any) -> None:
        while True:
            try:
                self.drain_events(connection, timeout=0)
            except (queue_module.Empty, TimeoutError):
                return
