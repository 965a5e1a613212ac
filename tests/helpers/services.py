"""Service availability: fail in CI (CI=true), skip with a message locally."""

from __future__ import annotations

import os
import socket

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"

SERVICES = {
    "postgres": ("127.0.0.1", 5432),
    "rabbitmq": ("127.0.0.1", 5672),
    "redis": ("127.0.0.1", 6379),
}

PG_ADMIN_URL = os.environ.get("PULSE_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/test")
RABBIT_URL = os.environ.get("PULSE_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
REDIS_URL = os.environ.get("PULSE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require(name: str) -> None:
    """Skip (locally) or fail (CI) when service ``name`` is not reachable."""
    host, port = SERVICES[name]
    if reachable(host, port):
        return
    message = f"{name} is not reachable at {host}:{port}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: services are required)", pytrace=False)
    pytest.skip(message)
