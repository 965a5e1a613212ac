"""How the SQL store's parts talk to the database: one statement, a read, a transaction.

Every part of the store (and the result rows, and the credentials) opens its
connections here, so the three ways are decided once per dialect:

* :meth:`Connections.single`: independent statements, each atomic on its own.
  Autocommit on PostgreSQL (one round trip, no ``BEGIN``/``COMMIT``); a transaction
  elsewhere (SQLite's ``BEGIN IMMEDIATE`` takes the write lock up front).
* :meth:`Connections.read`: reads that need no transaction around them. Autocommit on
  PostgreSQL (a poll costs one round trip instead of three: the leader's beat polls every
  second); on SQLite a :data:`~.engine.READ_ONLY` connection begins no transaction, so a
  writer holding the file's lock never blocks it.
* :meth:`Connections.statement`: one write on its own, as :meth:`single` (one round trip
  on PostgreSQL), and on MySQL/MariaDB run again after contention as :meth:`atomic`: a
  lone ``UPDATE`` can be a deadlock's victim too (the CLI's ``review retry`` met one
  against a worker's Recover scan).
* :meth:`Connections.atomic`: one transaction. On MySQL/MariaDB a deadlock, a lock-wait
  timeout (1213/1205) or a lost duplicate-key race rolls it back whole, and it is run
  again a few times (every one the store runs is safe to repeat: nothing of it
  committed), then reported as :class:`~celery_pulse.errors.Contended`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from celery_pulse.errors import Contended
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.engine import READ_ONLY
from celery_pulse.store.sql.errors import mysql_code, translated
from celery_pulse.store.sql.tables import claims

#: The retried transactions' log lines keep the logger MySQL's store logged them under.
logger = logging.getLogger("celery_pulse.store.sql.mysql")

T = TypeVar("T")

#: MySQL's error for a unique key inserted twice (another transaction got there first).
DUPLICATE_KEY = 1062


class Connections:
    """One engine's three kinds of connection (see the module doc), and its clock."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.dialect = Dialect(engine.dialect.name)
        #: The store clock as an SQL expression (built once: the hot path uses it).
        self.now = self.dialect.now()
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")

    def single(self) -> AbstractContextManager[sa.Connection]:
        """A connection for independent statements, each atomic on its own."""
        if self.dialect.autocommit_statements:
            return self._autocommit.connect()
        return self.engine.begin()

    def read(self, *, outside_transaction: bool = True) -> AbstractContextManager[sa.Connection]:
        """A connection for reads that need no transaction around them.

        ``outside_transaction=False`` (the result rows' and the credentials' reads): on
        SQLite a plain connection, whose first statement begins a transaction as a
        write's would.
        """
        if self.dialect.autocommit_statements:
            return self._autocommit.connect()
        if outside_transaction:
            return self.engine.connect().execution_options(**{READ_ONLY: True})
        return self.engine.connect()

    @contextmanager
    def reading(self, where: str, *, outside_transaction: bool = True
                ) -> Iterator[sa.Connection]:
        """:meth:`read` with its driver errors translated (named ``where``)."""
        with translated(where), self.read(outside_transaction=outside_transaction) as conn:
            yield conn

    @contextmanager
    def writing(self, where: str) -> Iterator[sa.Connection]:
        """:meth:`single` with its driver errors translated (named ``where``)."""
        with translated(where), self.single() as conn:
            yield conn

    def atomic(self, where: str, body: Callable[[sa.Connection], T]) -> T:
        """Run ``body`` in one transaction; on MySQL again (whole) after a deadlock, a
        lock-wait timeout or a lost duplicate-key race, with a short jittered backoff."""
        attempts = self.dialect.transaction_attempts
        delay = 0.005
        for attempt in range(attempts):
            try:
                with translated(where), self.engine.begin() as conn:
                    return body(conn)
            except Contended as exc:
                if attempt == attempts - 1:
                    raise
                why = str(exc)
            except sa_exc.IntegrityError as exc:
                if mysql_code(exc.orig) != DUPLICATE_KEY or attempt == attempts - 1:
                    raise
                why = "another transaction inserted the same key first"
            logger.debug("pulse: %s rolled back (%s): running it again", where, why)
            time.sleep(delay * (0.5 + random.random()))
            delay *= 2
        raise Contended(f"store contended during {where}")  # pragma: no cover

    def statement(self, where: str, stmt: Any) -> int:
        """Run one write on its own (see the module doc); the rows it matched."""
        if self.dialect.autocommit_statements:
            with translated(where), self._autocommit.connect() as conn:
                return int(conn.execute(stmt).rowcount)
        return self.atomic(where, lambda conn: int(conn.execute(stmt).rowcount))

    def updated(self, conn: sa.Connection, task_ids: Sequence[str], stmt: Any) -> list[Any]:
        """Run ``stmt`` (an UPDATE of ``pulse_claims``); the rows it changed as
        (task_id, epoch, token).

        Where there is no RETURNING (MySQL) the rows of ``task_ids`` are read back after
        it: callers lock them first, so nothing else can have changed them in between.
        """
        if self.dialect.returning:
            return list(conn.execute(stmt.returning(claims.c.task_id, claims.c.epoch,
                                                    claims.c.token)))
        conn.execute(stmt)
        return list(conn.execute(sa.select(claims.c.task_id, claims.c.epoch, claims.c.token)
                                 .where(claims.c.task_id.in_(list(task_ids)))))
