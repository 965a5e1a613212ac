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
    pytest.param("pgb-session", id="pgb-session", marks=pytest.mark.postgres),
    pytest.param("pgb-transaction", id="pgb-transaction", marks=pytest.mark.postgres),
]

#: The URL fixture (tests/conftest.py, tests/helpers/pgbouncer.py) of each SQL store kind.
URL_FIXTURES = {"sqlite": "sqlite_url", "postgres": "pg_url", "mariadb": "mariadb_url",
                "pgb-session": "pgb_session_url", "pgb-transaction": "pgb_transaction_url"}
#: The suites also run through PgBouncer (both modes): the ones whose statements the
#: pooler changes (the hot path's pipeline, permits, results, recovery, leadership and
#: beat's transactions); the others' SQL is the same on every connection.
PGBOUNCER_SUITES = {"test_claims_contract.py", "test_permits_contract.py",
                    "test_results_contract.py", "test_recover_contract.py",
                    "test_leader_beat_contract.py", "test_checkpoints_contract.py",
                    "test_permit_folds_contract.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the PgBouncer variants of the suites not in :data:`PGBOUNCER_SUITES`."""
    keep, drop = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        kind = spec.params.get("store") if spec is not None else None
        through_pooler = isinstance(kind, str) and kind.startswith("pgb-")
        (drop if through_pooler and item.path.name not in PGBOUNCER_SUITES else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
