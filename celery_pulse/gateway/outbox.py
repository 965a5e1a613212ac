"""What a remote worker's task published, published by the gateway before its finish.

A gateway worker has no broker: what its running task publishes (``self.retry()``, a
chain's next step, ``apply_async`` to its own queue) travels in the attempt's
``task.finish`` as ``result.publish`` (:mod:`celery_pulse.gateway.transport` keeps it).
The rules, before any code:

* **Before the finish applies**, as a direct worker's pool child publishes before its
  completion: a finish applied first and a gateway dying before it published would lose
  the retry (the claim waits, open, for a publication that never comes). A broker that
  can't take them fails the finish ``UNAVAILABLE``; the worker sends it again.
* **Once per publication, whatever repeats**: a re-sent finish publishes again, with the
  same headers, so the same publication id (``pulse_pub``): the store reserves it once
  (:mod:`celery_pulse.messages`).
* **Only to the instance's own queue**, through the default exchange: a credential for
  one queue puts nothing on another, whatever the frame names (``FORBIDDEN``).
* **Never by an attempt that never started**: its finish is evidence only (seed 003 §4).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

from celery_pulse.gateway.frames import Code, ProtocolError
from celery_pulse.gateway.protocol import Finish

#: The AMQP properties of a publication the gateway passes on.
PROPERTIES = frozenset({"correlation_id", "reply_to", "priority", "delivery_mode"})
#: At most this many publications ride in one finish.
MAX_PUBLISHED = 100
#: How a publication is sent again if the broker drops the connection meanwhile.
RETRY_POLICY = {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5}


def published(finish: Finish, queue: str) -> list[dict[str, Any]]:
    """The finish's publications, checked (``INVALID_FRAME``, or ``FORBIDDEN`` for another
    queue than ``queue``, the instance's)."""
    result = finish.result
    items = result.get("publish") if isinstance(result, Mapping) else None
    if items is None:
        return []
    if not isinstance(items, list) or len(items) > MAX_PUBLISHED:
        _invalid(f"result.publish must be a list of at most {MAX_PUBLISHED} messages")
    checked = []
    for i, item in enumerate(items):
        path = f"result.publish[{i}]"
        if not isinstance(item, Mapping):
            _invalid(f"{path} must be an object")
        if item.get("queue") != queue:
            raise ProtocolError(Code.FORBIDDEN, f"{path}.queue: this credential publishes "
                                                f"only to its queue {queue!r}")
        try:
            body = base64.b64decode(str(item.get("body")), validate=True)
        except (binascii.Error, ValueError):
            _invalid(f"{path}.body must be base64")
        headers, properties = item.get("headers", {}), item.get("properties", {})
        if not isinstance(headers, Mapping) or not isinstance(properties, Mapping):
            _invalid(f"{path}.headers and .properties must be objects")
        if not headers.get("id") or not headers.get("task"):
            _invalid(f"{path}.headers must name a Celery task (id, task)")
        for name in ("content_type", "content_encoding"):
            if not isinstance(item.get(name), str):
                _invalid(f"{path}.{name} must be a string")
        checked.append({
            "body": body, "content_type": item["content_type"],
            "content_encoding": item["content_encoding"], "headers": dict(headers),
            **{k: v for k, v in properties.items() if k in PROPERTIES}})
    return checked


def publish(app: Any, queue: str, messages: Sequence[dict[str, Any]]) -> None:
    """Publish ``messages`` to ``queue`` with the app's producer (blocking: a thread's);
    raises what the broker raised."""
    with app.producer_or_acquire() as producer:
        for message in messages:
            producer.publish(**message, exchange="", routing_key=queue, retry=True,
                             retry_policy=RETRY_POLICY)


def _invalid(message: str) -> None:
    raise ProtocolError(Code.INVALID_FRAME, message)
