"""``lease.fenced(conn)``: side effects that commit only while the lease is held.

One transaction on the caller's connection: it first locks this task's claim row
with a no-op UPDATE whose WHERE checks epoch, token, state and expiry by the store
clock, runs the caller's block, checks again, and commits. While the row is locked
no takeover (a new epoch) can be granted, so a stale holder's write never lands.
On PostgreSQL the transaction's lock, statement and idle timeouts are capped at the
lease TTL, so a holder paused inside the block loses its transaction instead of
pinning the row. On SQLite the UPDATE takes the database write lock for the block.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from celery_pulse.errors import InvalidConfig, LeaseLost
from celery_pulse.lease import Lease
from celery_pulse.store.base import LIVE_STATES
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.tables import claims


def _identity(url: sa.URL) -> tuple[str, str | None, int | None, str | None]:
    database = url.database
    if url.get_backend_name() == "sqlite" and database:
        database = os.path.realpath(database)
    return (url.get_backend_name(), url.host, url.port, database)


def make_fencer(store_url: str, ttl: float) -> Callable[[Lease, Any], Any]:
    """A fencer bound to the store at ``store_url`` (the pool child builds one)."""
    expected = _identity(make_url(store_url))

    @contextmanager
    def fenced(lease: Lease, target: Any) -> Iterator[Any]:
        if isinstance(target, Session):
            if target.in_transaction():
                raise InvalidConfig("lease.fenced(session): the session is already in a "
                                    "transaction; commit or roll back first")
            with target.begin():
                _guard(target.connection(), lease)
                yield target
                _recheck(target.connection(), lease)
            return
        if not isinstance(target, sa.Connection):
            raise InvalidConfig("lease.fenced() takes a SQLAlchemy Connection or Session")
        if target.in_transaction():
            raise InvalidConfig("lease.fenced(conn): the connection is already in a "
                                "transaction; commit or roll back first")
        with target.begin():
            _guard(target, lease)
            yield target
            _recheck(target, lease)

    def _check_database(conn: sa.Connection) -> None:
        if _identity(conn.engine.url) != expected:
            raise InvalidConfig(
                "lease.fenced() needs a connection to the pulse store's database; for "
                "another resource use lease.check() and the (task_id, epoch) token")

    def _guard(conn: sa.Connection, lease: Lease) -> None:
        _check_database(conn)
        lease.check()
        dialect = Dialect(conn.dialect.name)
        if dialect.is_postgres:
            ms = max(1, int(ttl * 1000))
            for setting in ("lock_timeout", "statement_timeout",
                            "idle_in_transaction_session_timeout"):
                conn.exec_driver_sql(f"SET LOCAL {setting} = {ms}")
        held = conn.execute(
            sa.update(claims)
            .where(claims.c.task_id == lease.task_id, claims.c.epoch == lease.epoch,
                   claims.c.token == lease.token, claims.c.state.in_(LIVE_STATES),
                   claims.c.lease_until > dialect.now())
            .values(epoch=claims.c.epoch)
            .returning(claims.c.task_id)).first()
        if held is None:
            lease.mark_lost()
            raise LeaseLost(lease.lost_message() + " (the store refused the fenced write)")

    def _recheck(conn: sa.Connection, lease: Lease) -> None:
        lease.check()
        dialect = Dialect(conn.dialect.name)
        still = conn.execute(
            sa.select(claims.c.task_id)
            .where(claims.c.task_id == lease.task_id, claims.c.epoch == lease.epoch,
                   claims.c.state.in_(LIVE_STATES), claims.c.lease_until > dialect.now())).first()
        if still is None:
            lease.mark_lost()
            raise LeaseLost(lease.lost_message() + " (expired before commit)")

    return fenced
