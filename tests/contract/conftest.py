"""The ``store`` fixture: one contract suite, run on every Store implementation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_pulse.store.base import RegistryStore as Store
from celery_pulse.store.memory import MemoryStore
from celery_pulse.store.sql import open_store

STORE_KINDS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    pytest.param("mariadb", id="mariadb", marks=pytest.mark.mariadb),
]

#: The URL fixture (tests/conftest.py) of each SQL store kind.
URL_FIXTURES = {"sqlite": "sqlite_url", "postgres": "pg_url", "mariadb": "mariadb_url"}


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A fresh, empty, migrated store (``memory``, ``sqlite``, ``postgres`` or ``mariadb``)."""
    if request.param == "memory":
        yield MemoryStore()
        return
    url: str = request.getfixturevalue(URL_FIXTURES[request.param])
    sql = open_store(url, check_schema=False)
    sql.migrate()
    try:
        yield sql
    finally:
        sql.close()
