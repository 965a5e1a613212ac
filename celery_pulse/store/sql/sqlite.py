"""The claim hot path on SQLite: a worker's whole exchange in one transaction.

SQLite has one writer at a time and a commit per transaction; the three verbs of an
exchange (completions, reservations, starts) each in their own transaction cost two or
three ``BEGIN IMMEDIATE``/``COMMIT`` pairs per batch, most of a no-op task's store time.
Here they share one, as the contract allows (if it raises, none took effect), and the
batch statements go to the driver's connection directly (SQLAlchemy's execution
context cost more than SQLite's execution of them). Starts that need a concurrency
permit keep their own transactions (:mod:`.permits`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from celery_pulse.store.base import Completion, Exchanged, LeaseKey, Permit, ReserveRequest
from celery_pulse.store.rules import split_starts
from celery_pulse.store.sql.batch_sql import Statement
from celery_pulse.store.sql.claims import BatchClaims
from celery_pulse.store.sql.errors import translated


class SqliteClaims(BatchClaims):
    """:class:`BatchClaims` with the exchange in one SQLite transaction."""

    def rows(self, conn: sa.Connection, statement: Statement) -> Any:
        """On the driver's connection: its tuples are what the callers read. Its errors
        are wrapped as SQLAlchemy wraps them, for :func:`.errors.translated`."""
        try:
            return conn.connection.driver_connection.execute(*statement)  # type: ignore[union-attr]
        except sqlite3.Error as exc:
            raise sa_exc.DBAPIError.instance(statement[0], statement[1], exc, sqlite3.Error,
                                             hide_parameters=True) from exc

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged | None:
        """Completions, then reservations, then starts, in one transaction; None (the
        three verbs, in order) when a start needs a permit."""
        limited, unique = split_starts(permits, starts)
        if limited:
            return None
        counted: dict[str, tuple[int, str]] = {}
        with translated("exchange"), self.conns.engine.begin() as conn:
            completed = self.complete_in(conn, holder, completions, counted)
            reserved = self.reserve_in(conn, holder, reserves, ttl) if reserves else []
            started = self.start_in(conn, holder, unique, ttl)
        return Exchanged(dict(completed), reserved, started, counted)
