"""``postgres://`` and ``postgresql://`` store URLs reach PostgreSQL through psycopg 3."""

from __future__ import annotations

import pytest

from celery_pulse.settings import Settings
from celery_pulse.store.sql import open_store


@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_driverless_postgres_url_connects_with_psycopg(scheme: str, pg_url: str) -> None:
    url = f"{scheme}://{pg_url.partition('://')[2]}"
    store = open_store(Settings.from_conf({"pulse_store_url": url}).store_url,
                       check_schema=False)
    try:
        assert store.engine.dialect.name == "postgresql"
        assert store.engine.dialect.driver == "psycopg"
        assert store.now() > 0  # a real round trip
    finally:
        store.close()
    # The store factory alone (a URL that never went through Settings) does the same.
    direct = open_store(url, check_schema=False)
    try:
        assert direct.engine.dialect.driver == "psycopg"
        direct.migrate()
        assert direct.list_workers() == []
    finally:
        direct.close()
