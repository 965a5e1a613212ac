"""What pulse reads of a task message, shared by the worker's intake and the gateway.

Celery-free on purpose: the gateway reserves deliveries for remote workers with the same
rules as a direct worker's intake (the message kept byte for byte, the publication it
belongs to, the task's policy when its attempt is lost), and neither may pull the other's
side in to get them. A message here is anything shaped like kombu's (``body``,
``headers``, ``properties``, ``delivery_info``, ``content_type``, ``content_encoding``).
"""

from __future__ import annotations

from typing import Any

from celery_pulse.store.base import Message

#: Message header naming the publication (stamped by pulse's ``before_task_publish``).
PUBLICATION_HEADER = "pulse_pub"
#: Header a publisher sets to choose the publication itself (a beat slot: its copies
#: published by two leaders are one publication). The stamp moves it to
#: ``PUBLICATION_HEADER``, so a retry that copies the request's headers doesn't keep it.
FIXED_PUBLICATION_HEADER = "pulse_pub_fixed"
#: Properties of one delivery, not of the message: never stored, never republished.
DELIVERY_PROPERTIES = ("delivery_tag", "delivery_info", "body_encoding")
#: What a stored message keeps of its delivery (where to publish it again).
KEPT_DELIVERY_INFO = ("exchange", "routing_key", "priority", "redelivered")
#: The longest publication id a claim keeps.
MAX_PUBLICATION = 64


def publication_of(headers: Any) -> str | None:
    """The publication a message belongs to (None: its publisher stamped none)."""
    value = headers.get(PUBLICATION_HEADER) or headers.get(FIXED_PUBLICATION_HEADER)
    return str(value)[:MAX_PUBLICATION] if value else None


def capture(message: Any) -> Message:
    """The message as delivered, byte-exact, minus delivery-specific bits."""
    properties = {k: v for k, v in (message.properties or {}).items()
                  if k not in DELIVERY_PROPERTIES}
    delivery = {k: v for k, v in (message.delivery_info or {}).items()
                if k in KEPT_DELIVERY_INFO}
    body = message.body
    if isinstance(body, str):
        body = body.encode(message.content_encoding or "utf-8")
    return Message(body, dict(message.headers or {}), properties, delivery,
                   message.content_type or "", message.content_encoding or "")


def policy_for(task: Any, default: str | None) -> str:
    """``pulse_on_lost`` of the task, else the setting, else by acks_late/idempotent."""
    explicit = getattr(task, "pulse_on_lost", None) or default
    if explicit:
        return str(explicit)
    if getattr(task, "acks_late", False) or getattr(task, "pulse_idempotent", False):
        return "redispatch"
    return "review"


def mark_redelivered(message: Any) -> None:
    """Say the delivery came before (a later attempt), as a broker's requeue would."""
    info = getattr(message, "delivery_info", None)
    if isinstance(info, dict):
        info["redelivered"] = True
