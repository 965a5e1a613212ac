"""Re-publish a stored message exactly as it was first delivered."""

from __future__ import annotations

from typing import Any

from celery_pulse.store.base import Recovered

#: Not ``expiration``: a broker TTL (RabbitMQ's, from Celery's ``expires``) would drop a
#: re-published message nobody consumes in time, leaving its claim open, re-published
#: at every publish lease for good. Without it the consumer judges the ``expires``
#: header, as Celery does on receipt, and the claim ends revoked.
_PASS_PROPERTIES = ("correlation_id", "reply_to", "delivery_mode", "priority",
                    "message_id", "timestamp", "type", "user_id", "app_id")


def republish(app: Any, item: Recovered) -> None:
    """Publish ``item.message`` (body bytes untouched) to its original exchange/routing key."""
    message = item.message
    properties = {k: v for k, v in message.properties.items()
                  if k in _PASS_PROPERTIES and v is not None}
    delivery = message.delivery_info
    with app.producer_or_acquire() as producer:
        producer.publish(
            message.body,
            exchange=delivery.get("exchange") or "",
            routing_key=delivery.get("routing_key") or "",
            headers=dict(message.headers),
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            retry=True,
            retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5},
            **properties,
        )
