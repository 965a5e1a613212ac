"""Publish a task message by hand, with a chosen publication identity."""

from __future__ import annotations

import datetime
from typing import Any

from celery import Celery

from celery_pulse.bootsteps.intake import PUBLICATION_HEADER


def publish_raw(app: Celery, queue: str, name: str, args: list[Any], task_id: str,
                publication: str | None, expires: datetime.datetime | None = None) -> None:
    """Publish one task message as ``publication`` (as a redelivery of it would arrive).

    ``send_task`` stamps a new publication each time once pulse is installed in this
    process; this doesn't. ``expires`` goes in the task header only (``send_task`` would
    also give the AMQP message a TTL, and RabbitMQ would drop an expired one before any
    worker saw it).
    """
    message = app.amqp.as_task_v2(task_id, name, args=tuple(args), kwargs={}, expires=expires)
    headers = dict(message.headers)
    if publication is not None:
        headers[PUBLICATION_HEADER] = publication
    with app.producer_or_acquire() as producer:
        producer.publish(message.body, exchange="", routing_key=queue, headers=headers,
                         serializer="json", **message.properties)
