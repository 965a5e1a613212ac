"""Opening a store: a first connection that can never succeed fails at once, naming
what is wrong; one that may succeed later (refused, the server starting) is retried."""

from __future__ import annotations

import time

import pytest

from celery_pulse.errors import InvalidConfig
from celery_pulse.store.sql import open_store
from tests.helpers import services
from tests.helpers.bad_stores import CASES, PASSWORD, BadStore


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_store_that_cannot_be_opened_fails_at_once_naming_why(case: BadStore) -> None:
    services.require(case.service)
    started = time.monotonic()
    with pytest.raises(InvalidConfig) as raised:
        open_store(case.url, connect_timeout=10)
    took = time.monotonic() - started
    message = str(raised.value)
    assert took < 2, f"{took:.1f}s: retried as if the store might come up ({message})"
    assert case.names in message, message
    assert message.startswith("pulse_store_url: ") and raised.value.setting == "pulse_store_url"
    assert PASSWORD not in message
    assert "during now" not in message


def test_a_refused_connection_is_retried_until_the_timeout() -> None:
    """Nothing listens on port 1: the server may be starting; wait for it."""
    services.require("postgres")
    url = f"postgresql+psycopg://root:{PASSWORD}@127.0.0.1:1/test"
    started = time.monotonic()
    with pytest.raises(InvalidConfig) as raised:
        open_store(url, connect_timeout=2.0)
    assert time.monotonic() - started >= 1.0  # retried, not given up on the first refusal
    message = str(raised.value)
    assert "after 2s" in message and "refused" in message.lower(), message
    assert PASSWORD not in message and "***" in message
    assert "during now" not in message, message
