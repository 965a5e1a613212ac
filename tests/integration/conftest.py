"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kombu.asynchronous import Hub


@pytest.fixture
def hub() -> Iterator[Hub]:
    """A kombu hub: the event loop a Celery worker runs (turned by the test itself)."""
    hub = Hub()
    yield hub
    hub.close()
