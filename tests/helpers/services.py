"""Service availability: fail in CI (CI=true), skip with a message locally."""

from __future__ import annotations

import contextlib
import os

import pytest

from celery_pulse.contrib import services as plugin_services
from celery_pulse.contrib.services import IN_CI, reachable

__all__ = ["IN_CI", "MARIADB_ADMIN_URL", "PG_ADMIN_URL", "RABBIT_URL", "REDIS_URL", "SERVICES", "reachable",
           "require", "require_module", "tidy_queue"]

SERVICES = {
    "postgres": ("127.0.0.1", 5432),
    "mariadb": plugin_services.address(plugin_services.MARIADB_URL, 3306),  # $PULSE_TEST_MARIADB
    "rabbitmq": ("127.0.0.1", 5672),
    "redis": ("127.0.0.1", 6379),
}

PG_ADMIN_URL = plugin_services.POSTGRES_URL  # $PULSE_TEST_PG
MARIADB_ADMIN_URL = plugin_services.MARIADB_URL  # $PULSE_TEST_MARIADB
RABBIT_URL = plugin_services.RABBITMQ_URL  # $PULSE_TEST_AMQP
REDIS_URL = os.environ.get("PULSE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def require(name: str) -> None:
    """Skip (locally) or fail (CI) when service ``name`` is not reachable."""
    plugin_services.require(name, *SERVICES[name])


def require_module(module: str, install: str) -> None:
    """Skip (locally) or fail (CI) when the optional ``module`` is not installed."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        message = f"{module} is not installed ({install})"
        if IN_CI:
            pytest.fail(f"{message} (CI=true: .ci/run installs it)", pytrace=False)
        pytest.skip(message)


def tidy_queue(broker_url: str, queue: str) -> None:
    """Delete a test's queue (and its exchange, or its Redis keys) from a shared broker.

    Best effort: a broker that went away (a fault test stops its own) is not an error.
    """
    with contextlib.suppress(Exception):
        if broker_url.startswith("amqp"):
            plugin_services.delete_amqp_entities(broker_url, [queue], [queue])
        elif broker_url.startswith("redis"):
            import redis

            client = redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=5)
            try:
                keys = list(client.scan_iter(match=f"*{queue}*", count=1000))
                if keys:
                    client.delete(*keys)
            finally:
                client.close()
