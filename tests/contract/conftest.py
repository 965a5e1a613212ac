"""The ``store`` fixture: every contract suite, run on every Store implementation.

One fixture, four stores: ``memory`` (:class:`~celery_pulse.store.memory.MemoryStore` on
the wall clock), ``sqlite``, ``postgres`` and ``mariadb`` (fresh and migrated). A test
that speaks about SQL itself (row locks, session timeouts, driver errors, migrations,
``lease.fenced`` on a SQL connection, the ``pulse://`` backend's table) takes
``sql_store`` (tests/conftest.py) instead, and says why in its docstring.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_pulse.store.base import Store
from celery_pulse.store.memory import MemoryStore
from tests.helpers.stores import migrated

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
    sql = migrated(request.getfixturevalue(URL_FIXTURES[request.param]))
    try:
        yield sql
    finally:
        sql.close()
