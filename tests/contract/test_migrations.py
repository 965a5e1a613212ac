"""Migrations: idempotent, identical to ``tables.metadata``, and enforced at open (SQL only)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from celery_pulse.errors import SchemaMissing
from celery_pulse.store.sql import open_store
from celery_pulse.store.sql.migrate import COMPAT_TABLE, VERSION_TABLE, head_revision
from celery_pulse.store.sql.tables import metadata


def _is_version_table(diff: Any) -> bool:
    return (isinstance(diff, tuple) and diff[0] in ("add_table", "remove_table")
            and diff[1].name in (VERSION_TABLE, COMPAT_TABLE))


def _same_server_default(_ctx: Any, _inspected: Any, _column: Any, inspected: str | None,
                         _default: Any, rendered: str | None) -> bool | None:
    """MySQL reflects a boolean ``DEFAULT false`` as ``'0'``: the same default."""
    if rendered in ("false", "0") and inspected in ("'0'", "0"):
        return False
    return None  # Alembic's own comparison


def test_migrate_is_idempotent(store_url: str) -> None:
    store = open_store(store_url, check_schema=False)
    try:
        assert store.migrate() == (None, head_revision())
        before, after = store.migrate()
        assert before == after == head_revision()
        assert store.migrate() == (head_revision(), head_revision())
    finally:
        store.close()


def test_migrated_schema_matches_metadata(store_url: str) -> None:
    store = open_store(store_url, check_schema=False)
    try:
        store.migrate()
        with store.engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={
                "compare_type": True, "compare_server_default": _same_server_default})
            diffs = [d for d in compare_metadata(ctx, metadata) if not _is_version_table(d)]
    finally:
        store.close()
    assert diffs == []


def test_compare_metadata_sees_a_missing_schema(store_url: str) -> None:
    """The comparison above is not vacuous: on an empty database it reports the tables."""
    store = open_store(store_url, check_schema=False)
    try:
        with store.engine.connect() as conn:
            diffs = compare_metadata(MigrationContext.configure(conn), metadata)
    finally:
        store.close()
    added = {d[1].name for d in diffs if isinstance(d, tuple) and d[0] == "add_table"}
    assert added == set(metadata.tables)


def test_open_store_on_empty_database_raises_schema_missing(store_url: str) -> None:
    with pytest.raises(SchemaMissing) as exc_info:
        open_store(store_url)
    message = str(exc_info.value)
    assert "celery" in message
    assert "pulse migrate" in message


def test_store_calls_on_empty_database_raise_schema_missing(store_url: str) -> None:
    store = open_store(store_url, check_schema=False)
    try:
        with pytest.raises(SchemaMissing):
            store.register("w", {}, 30.0)
        with pytest.raises(SchemaMissing):
            store.list_workers()
    finally:
        store.close()


def test_check_schema_passes_after_migrate(store_url: str) -> None:
    store = open_store(store_url, check_schema=False)
    try:
        with pytest.raises(SchemaMissing):
            store.check_schema()
        store.migrate()
        store.check_schema()
    finally:
        store.close()
    reopened = open_store(store_url)
    try:
        reopened.check_schema()
        assert reopened.list_workers() == []
    finally:
        reopened.close()


@pytest.mark.postgres
@pytest.mark.parametrize("url_fixture", ["pg_url", "pgb_transaction_url"])
def test_a_migration_stalled_past_the_engines_idle_cap_still_completes(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, url_fixture: str
) -> None:
    """The engine caps a transaction's idle time at a couple of seconds (a paused worker
    must not keep its locks); a migration runs Alembic's Python between its statements,
    which a loaded machine stretched past that cap (CI: "terminating connection due to
    idle-in-transaction timeout"). The stall is injected here: the migration's own cap
    lets it finish, directly and through a transaction-mode PgBouncer."""
    from celery_pulse.store.sql import migrate as migrate_module
    from celery_pulse.store.sql.engine import IDLE_IN_TRANSACTION_S

    url = request.getfixturevalue(url_fixture)
    upgrade = migrate_module.command.upgrade

    def stalled(*args: Any, **kwargs: Any) -> None:
        time.sleep(IDLE_IN_TRANSACTION_S + 1.5)  # the fault: idle inside the transaction
        upgrade(*args, **kwargs)

    monkeypatch.setattr(migrate_module.command, "upgrade", stalled)
    store = open_store(url, check_schema=False)
    try:
        assert store.migrate() == (None, head_revision())
    finally:
        store.close()
