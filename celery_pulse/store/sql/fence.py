"""``lease.fenced(conn)``: side effects that commit only while the lease is held.

One transaction on the caller's connection: it first locks this task's claim row
with a no-op UPDATE whose WHERE checks epoch, token, state and expiry by the store
clock, runs the caller's block, checks again, and commits. While the row is locked
no takeover (a new epoch) can be granted, so a stale holder's write never lands.
On PostgreSQL the transaction's lock, statement and idle timeouts are capped at the
lease TTL, so a holder paused inside the block loses its transaction instead of
pinning the row; on MySQL/MariaDB the session's lock wait and statement time (and, on
MariaDB, its idle time in a transaction) are capped the same way for the block. On
SQLite the UPDATE takes the database write lock for the block.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from celery_pulse.errors import InvalidConfig
from celery_pulse.lease import Lease, fence_kind_of
from celery_pulse.store.base import LIVE_STATES
from celery_pulse.store.checkpoints import CheckpointWrite
from celery_pulse.store.sql import checkpoints
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.engine import drop_on_failover
from celery_pulse.store.sql.tables import claims
from celery_pulse.store_urls import canonical_store_url, pg_servers


def identity(url: sa.URL) -> tuple[str, tuple[tuple[str, str], ...], str | None]:
    """The database a URL names: its family, its servers (every host of a multi-host
    PostgreSQL URL, in any spelling: a failover changes which one answers, not the
    database) and its name."""
    database = url.database
    backend = url.get_backend_name()
    if backend == "sqlite" and database:
        database = os.path.realpath(database)
    if backend == "mariadb":  # the same server family whichever name the URL uses
        backend = "mysql"
    if backend == "postgresql":
        servers = pg_servers(url.host, url.port, url.query)
    else:
        servers = ((url.host or "", str(url.port or "")),)
    return (backend, servers, database)


def make_fencer(store_url: str, ttl: float, pooler_mode: Callable[[], str] | None = None
                ) -> Callable[[Lease, Any], Any]:
    """A fencer bound to the store at ``store_url`` (the pool child builds one);
    ``pooler_mode`` tells the store's pooler mode (:mod:`.pooler`)."""
    expected = identity(make_url(canonical_store_url(store_url)))

    def same_store(url: str) -> bool:
        return identity(make_url(canonical_store_url(url))) == expected

    def fencer(lease: Lease, target: Any) -> AbstractContextManager[Any]:
        kind = fence_kind_of(target)
        if kind is not None:
            return kind.fenced(lease, target, ttl, same_store)
        return fenced(lease, target)

    @contextmanager
    def fenced(lease: Lease, target: Any) -> Iterator[Any]:
        if isinstance(target, Session):
            what, noun = "session", "session"
        elif isinstance(target, sa.Connection):
            what, noun = "conn", "connection"
        elif type(target).__module__.startswith("django."):
            raise InvalidConfig("lease.fenced(): a Django connection needs "
                                "'celery_pulse.contrib.django' in INSTALLED_APPS")
        else:
            raise InvalidConfig("lease.fenced() takes a SQLAlchemy Connection or Session")
        if target.in_transaction():
            raise InvalidConfig(f"lease.fenced({what}): the {noun} is already in a "
                                "transaction; commit or roll back first")
        with target.begin():
            conn = target.connection() if isinstance(target, Session) else target
            saved = _guard(conn, lease)
            lease.fence_writes(lambda seq, text: _checkpoint(conn, lease, seq, text))
            try:
                yield target
                _recheck(conn, lease)
            finally:
                lease.fence_writes(None)
                _restore(conn, saved)

    def _check_database(conn: sa.Connection) -> None:
        if identity(conn.engine.url) != expected:
            raise InvalidConfig(
                "lease.fenced() needs a connection to the pulse store's database; for "
                "another resource use lease.check() and the (task_id, epoch) token")
        if conn.dialect.name == "postgresql":
            # The application's engine reaches the store's servers: after a failover
            # its pool must leave the old primary as pulse's own does.
            drop_on_failover(conn.engine)

    def _guard(conn: sa.Connection, lease: Lease) -> dict[str, Any]:
        """Lock the claim row if the lease holds; returns session settings to restore."""
        _check_database(conn)
        lease.check()
        dialect = Dialect(conn.dialect.name)
        if dialect.is_postgres and pooler_mode is not None:
            _check_prepare(conn, pooler_mode())
        if dialect.is_postgres:
            for statement in postgres_caps(ttl):
                conn.exec_driver_sql(statement)
        saved: dict[str, Any] = {}
        if dialect.is_mysql:
            saved = _cap_mysql_session(conn, ttl)
        guard = guard_statement(lease, dialect)
        if dialect.is_mysql:  # no RETURNING; the engine counts matched rows (FOUND_ROWS)
            held = bool(conn.execute(guard).rowcount)
        else:
            held = conn.execute(guard).first() is not None
        if not held:
            raise lease.lost_error(" (the store refused the fenced write)")
        return saved

    def _recheck(conn: sa.Connection, lease: Lease) -> None:
        lease.check()
        if conn.execute(held_statement(lease, Dialect(conn.dialect.name))).first() is None:
            raise lease.lost_error(" (expired before commit)")

    return fencer


def _checkpoint(conn: sa.Connection, lease: Lease, seq: int, text: str) -> None:
    """A checkpoint in the fenced block's transaction: it commits with the block."""
    write = CheckpointWrite(lease.task_id, lease.epoch, lease.token, seq, text)
    conn.execute(checkpoints.write_statement(lease.holder, Dialect(conn.dialect.name).now()),
                 checkpoints.params(write))


def postgres_caps(ttl: float) -> list[str]:
    """A fenced block's caps on PostgreSQL, for its transaction only: a holder paused in
    the block loses its transaction instead of pinning the claim row."""
    ms = max(1, int(ttl * 1000))
    return [f"SET LOCAL {setting} = {ms}" for setting in
            ("lock_timeout", "statement_timeout", "idle_in_transaction_session_timeout")]


def mysql_caps(ttl: float, mariadb: bool) -> dict[str, Any]:
    """A fenced block's session caps on MySQL (lock waits, statements) and MariaDB (idling
    too), set for the block and put back before it ends (MySQL has no ``SET LOCAL``)."""
    seconds = max(1, int(ttl + 0.999))
    if mariadb:
        return {"innodb_lock_wait_timeout": seconds, "max_statement_time": round(ttl, 3),
                "idle_transaction_timeout": seconds}
    # MySQL: max_execution_time caps SELECTs only, in milliseconds
    return {"innodb_lock_wait_timeout": seconds, "max_execution_time": max(1, int(ttl * 1000))}


def guard_statement(lease: Lease, dialect: Dialect) -> Any:
    """The no-op UPDATE that locks the claim row if this attempt holds its lease by the
    store clock (RETURNING its id where the database has it; MySQL counts the row)."""
    guard = (sa.update(claims)
             .where(claims.c.task_id == lease.task_id, claims.c.epoch == lease.epoch,
                    claims.c.token == lease.token, claims.c.state.in_(LIVE_STATES),
                    claims.c.lease_until > dialect.now())
             .values(epoch=claims.c.epoch))
    return guard if dialect.is_mysql else guard.returning(claims.c.task_id)


def held_statement(lease: Lease, dialect: Dialect) -> Any:
    """The check before commit: the attempt still holds, by the store clock."""
    return (sa.select(claims.c.task_id)
            .where(claims.c.task_id == lease.task_id, claims.c.epoch == lease.epoch,
                   claims.c.state.in_(LIVE_STATES), claims.c.lease_until > dialect.now()))


def _check_prepare(conn: sa.Connection, mode: str) -> None:
    """Under a transaction pooler psycopg's auto-prepare (after 5 uses of a statement)
    names statements on a server connection the next transaction may not have:
    refused before it fails at random."""
    threshold = getattr(conn.connection.driver_connection, "prepare_threshold", None)
    if mode == "transaction" and threshold is not None:
        raise InvalidConfig(
            "lease.fenced(): the store is behind a transaction pooler (pulse_store_pooler) "
            "and this engine's psycopg connections prepare statements (prepare_threshold="
            f"{threshold}): create the engine with connect_args={{'prepare_threshold': None}}",
            setting="pulse_store_pooler")


def _cap_mysql_session(conn: sa.Connection, ttl: float) -> dict[str, Any]:
    """Cap lock waits and statements (MariaDB: idling too) at the lease TTL.

    MySQL has no ``SET LOCAL``: the session values are set here and put back by
    :func:`_restore` before the transaction ends; returns the values to put back.
    """
    caps = mysql_caps(ttl, bool(getattr(conn.dialect, "is_mariadb", False)))
    names = list(caps)
    row = conn.exec_driver_sql(
        "SELECT " + ", ".join(f"@@SESSION.{name}" for name in names)).one()
    conn.exec_driver_sql("SET " + ", ".join(f"SESSION {name} = {value}"
                                            for name, value in caps.items()))
    return dict(zip(names, row, strict=True))


def _restore(conn: sa.Connection, saved: dict[str, Any]) -> None:
    """Put the caller's session settings back (best effort: a connection the server
    closed for idling is discarded by the pool anyway)."""
    if not saved or conn.invalidated:
        return
    with suppress(sa_exc.SQLAlchemyError):
        conn.exec_driver_sql("SET " + ", ".join(f"SESSION {name} = {value}"
                                                for name, value in saved.items()))
