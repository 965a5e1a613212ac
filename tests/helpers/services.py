"""Service availability: fail in CI (CI=true), skip with a message locally."""

from __future__ import annotations

import os

from celery_pulse.contrib import services as plugin_services
from celery_pulse.contrib.services import IN_CI, reachable

__all__ = ["IN_CI", "PG_ADMIN_URL", "RABBIT_URL", "REDIS_URL", "SERVICES", "reachable", "require"]

SERVICES = {
    "postgres": ("127.0.0.1", 5432),
    "rabbitmq": ("127.0.0.1", 5672),
    "redis": ("127.0.0.1", 6379),
}

PG_ADMIN_URL = plugin_services.POSTGRES_URL  # $PULSE_TEST_PG
RABBIT_URL = plugin_services.RABBITMQ_URL  # $PULSE_TEST_AMQP
REDIS_URL = os.environ.get("PULSE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def require(name: str) -> None:
    """Skip (locally) or fail (CI) when service ``name`` is not reachable."""
    plugin_services.require(name, *SERVICES[name])
