"""The claim hot path on SQLite: a worker's whole exchange in one transaction.

SQLite has one writer at a time and a commit per transaction; the three verbs of an
exchange (completions, reservations, starts) each in their own transaction cost two or
three ``BEGIN IMMEDIATE``/``COMMIT`` pairs per batch, most of a no-op task's store time.
Here they share one, as the contract allows (if it raises, none took effect), and the
batch statements go to the driver's connection directly (SQLAlchemy's execution
context cost more than SQLite's execution of them). Starts that need a concurrency
permit keep their own transactions (:mod:`.permits`).

The usual exchange (:func:`.claim_rows.usual`) runs on the driver's connection alone,
its ``BEGIN IMMEDIATE`` and ``COMMIT`` included: SQLAlchemy's connection, transaction
and events were half of its Python, and the worker's commit thread shares one
interpreter lock with its consumer loop. When a completion does not apply or a
reservation is refused, the answer needs the general path's reads (why, and the
evidence it keeps): the transaction is rolled back, having changed nothing (it held the
write lock throughout), and the general path makes the exchange.

A worker's event loop makes the usual exchange itself (:meth:`SqliteClaims.begin_exchange`,
:mod:`.sqlite_loop`), on a connection that never waits for the write lock.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from celery_pulse.store.base import (
    Completion,
    Exchanged,
    Grant,
    LeaseKey,
    Permit,
    Refusal,
    ReserveRequest,
)
from celery_pulse.store.rules import split_starts
from celery_pulse.store.sql.batch_sql import Statement
from celery_pulse.store.sql.claim_rows import grants, started_leases, usual
from celery_pulse.store.sql.claims import BatchClaims
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.results import ResultRows
from celery_pulse.store.sql.sqlite_loop import LoopConnection, MadeExchange, busy

#: What a usual exchange made: completions' answers, reservations' grants, starts.
Made = tuple[dict[str, str], list[Grant | Refusal], dict[str, float]]


class SqliteClaims(BatchClaims):
    """:class:`BatchClaims` with the exchange in one SQLite transaction."""

    nonblocking_exchange = True
    exchange_in_process = True

    def __init__(self, conns: Connections, results: ResultRows) -> None:
        super().__init__(conns, results)
        #: Usual exchanges made on the driver's connection, and those rolled back for
        #: the general path; of them, those the event loop made, and those it left to
        #: the commit thread because another connection held the write lock: the
        #: worker's stats show them.
        self.made = {"direct_exchanges": 0, "direct_exchanges_redone": 0,
                     "loop_exchanges": 0, "loop_exchanges_locked": 0}
        self.counts = self.made
        self.on_loop = LoopConnection(conns.engine)

    def close(self) -> None:
        self.on_loop.close()

    def rows(self, conn: sa.Connection, statement: Statement) -> Any:
        """On the driver's connection: its tuples are what the callers read. Its errors
        are wrapped as SQLAlchemy wraps them, for :func:`.errors.translated`."""
        return _run(conn.connection.driver_connection, statement)

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged | None:
        """Completions, then reservations, then starts, in one transaction; None (the
        three verbs, in order) when a start needs a permit."""
        limited, unique = split_starts(permits, starts)
        if limited:
            return None
        done = self._usual(holder, ttl, completions, reserves, unique)
        if done is not None:
            return Exchanged(*done, {})
        counted: dict[str, tuple[int, str]] = {}
        with translated("exchange"), self.conns.engine.begin() as conn:
            completed = self.complete_in(conn, holder, completions, counted)
            reserved = self.reserve_in(conn, holder, reserves, ttl) if reserves else []
            started = self.start_in(conn, holder, unique, ttl)
        return Exchanged(dict(completed), reserved, started, counted)

    def begin_exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                       reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                       permits: Mapping[str, Sequence[Permit]] | None = None
                       ) -> MadeExchange | None:
        """The usual exchange, made now on the event loop's connection; None (the commit
        thread makes it) for any other, when another connection holds the write lock,
        or when an answer needs the general path (rolled back: nothing done)."""
        limited, unique = split_starts(permits, starts)
        if limited or not usual(completions, reserves, unique):
            return None
        on_loop = self.on_loop
        with translated("exchange"):
            try:
                db = on_loop.driver()
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                if busy(exc):
                    self.made["loop_exchanges_locked"] += 1
                    return None
                raise _wrapped(exc, ("BEGIN IMMEDIATE", ())) from exc
            try:
                done = self._ended(db, holder, ttl, completions, reserves, unique)
            except BaseException:
                on_loop.rolled_back()
                raise
        if done is None:
            return None
        self.made["loop_exchanges"] += 1
        return MadeExchange(on_loop.ready, Exchanged(*done, {}))

    # A verb on its own is an exchange of one verb: the usual one takes the same path.
    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]:
        done = self._usual(holder, ttl, [], requests, [])
        return super().reserve(holder, requests, ttl) if done is None else done[1]

    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        done = self._usual(holder, 0.0, completions, [], [])
        return super().complete(holder, completions, counted) if done is None else done[0]

    def start_many(self, holder: str, leases: Sequence[LeaseKey], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]:
        limited, unique = split_starts(permits, leases)
        done = None if limited else self._usual(holder, ttl, [], [], unique)
        if done is None:
            return super().start_many(holder, leases, ttl, permits, waiting)
        return done[2]

    def _usual(self, holder: str, ttl: float, completions: Sequence[Completion],
               reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey]
               ) -> Made | None:
        """The exchange made by :meth:`_direct` if it is a usual one; None: nothing done."""
        if not usual(completions, reserves, starts):
            return None
        return self._direct(holder, ttl, completions, reserves, starts)

    def _direct(self, holder: str, ttl: float, completions: Sequence[Completion],
                reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey]
                ) -> Made | None:
        """A usual exchange on the driver's connection; None: rolled back, for the
        general path (a completion that did not apply, a reservation refused)."""
        with translated("exchange"):
            try:
                raw = self.conns.engine.raw_connection()
            except sqlite3.Error as exc:  # the pool raises the driver's error unwrapped
                raise _wrapped(exc, ("connect", ())) from exc
            try:  # on an error the pool rolls back (or drops) the connection it gets back
                db: Any = raw.driver_connection
                _run(db, ("BEGIN IMMEDIATE", ()))
                return self._ended(db, holder, ttl, completions, reserves, starts)
            finally:
                raw.close()

    def _ended(self, db: Any, holder: str, ttl: float, completions: Sequence[Completion],
               reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey]
               ) -> Made | None:
        """The exchange's statements in the transaction begun on ``db``, then ``COMMIT``;
        ``ROLLBACK`` and None when an answer needs the general path. Counted."""
        done = self._body(db, holder, ttl, completions, reserves, starts)
        _run(db, ("ROLLBACK" if done is None else "COMMIT", ()))
        self.made["direct_exchanges_redone" if done is None else "direct_exchanges"] += 1
        return done

    def _body(self, db: Any, holder: str, ttl: float, completions: Sequence[Completion],
              reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey]) -> Made | None:
        """The exchange's statements; None as soon as one answer needs the general path."""
        if completions:
            applied = {row[0] for row in _run(db, self.complete_statement(completions))}
            if len(applied) != len(completions):
                return None
        granted = grants(_run(db, self.sql.reserve_statement(holder, reserves, ttl))
                         ) if reserves else {}
        if len(granted) != len(reserves):
            return None
        started = started_leases(_run(db, self.sql.start_statement(holder, list(starts), ttl))
                                 ) if starts else {}
        return (dict.fromkeys((c.task_id for c in completions), "applied"),
                [granted[r.task_id] for r in reserves], started)


def _run(db: Any, statement: Statement) -> Any:
    """``statement`` on the driver's connection, its rows read; a driver error wrapped
    as SQLAlchemy wraps it, for :func:`.errors.translated`."""
    try:
        return db.execute(*statement).fetchall()
    except sqlite3.Error as exc:
        raise _wrapped(exc, statement) from exc


def _wrapped(exc: sqlite3.Error, statement: Statement) -> sa_exc.StatementError:
    """``exc`` as SQLAlchemy wraps a driver error (its parameters hidden)."""
    return sa_exc.DBAPIError.instance(statement[0], statement[1], exc, sqlite3.Error,
                                      hide_parameters=True)
