"""A small Celery app on celery-pulse.

Embedded default (no servers): a SQLite store and kombu's ``filesystem://`` broker,
both under ``./.celery-pulse/``. For production set two variables::

    PULSE_STORE_URL=postgresql+psycopg://root@127.0.0.1/test
    PULSE_BROKER_URL=amqp://guest:guest@127.0.0.1//
"""

from __future__ import annotations

from example_project.app import app

__all__ = ["app"]
