"""The gateway judges Celery's ``expires`` header as Celery's worker does."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

from celery_pulse.gateway.expiry import expired

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)


def test_no_expires_never_expires() -> None:
    assert not expired({}, "UTC", NOW)


def test_an_aware_time_is_compared_as_it_is() -> None:
    assert expired({"expires": (NOW - timedelta(seconds=1)).isoformat()}, "UTC", NOW)
    assert not expired({"expires": (NOW + timedelta(seconds=1)).isoformat()}, "UTC", NOW)


def test_a_naive_time_is_in_the_apps_timezone() -> None:
    naive = "2026-12-05T13:30:00"  # 12:30 UTC in Paris: not yet
    assert not expired({"expires": naive}, ZoneInfo("Europe/Paris"), NOW)
    assert expired({"expires": naive}, ZoneInfo("UTC"), NOW + timedelta(hours=2))


def test_a_value_celery_cannot_read_is_left_to_the_worker() -> None:
    assert not expired({"expires": "soon"}, "UTC", NOW)
