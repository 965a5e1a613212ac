"""The few things that differ between PostgreSQL, MySQL/MariaDB and SQLite, in one place.

A :class:`Dialect` is probed once, from the engine's dialect name, and the store's parts
ask it what the database can do (``returning``, ``locking_reads``, ...) instead of asking
which database it is. Its SQL fragments (the store clock, a fresh token) are evaluated
*by the store*, never by a worker's clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

#: SQLAlchemy's names for the MySQL family (``mariadb`` when the URL says so).
MYSQL_NAMES = ("mysql", "mariadb")


class Dialect:
    """One database's clock, token generator and capabilities."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_postgres = name == "postgresql"
        self.is_mysql = name in MYSQL_NAMES
        self.is_sqlite = name == "sqlite"
        #: ``postgresql``, ``mysql`` (MySQL and MariaDB) or ``sqlite``: whose claim engine.
        self.family = "mysql" if self.is_mysql else name
        if self.is_postgres:
            # clock_timestamp(), not now(): the real time even inside a transaction.
            self.clock = "extract(epoch from clock_timestamp())::float8"
            # Two v4 UUIDs carry 244 random bits; md5 folds them to 128 bits of hex.
            self.token = "md5(gen_random_uuid()::text || gen_random_uuid()::text)"
        elif self.is_mysql:
            # UTC_TIMESTAMP(6) ignores the session's time zone and TIMESTAMPDIFF is plain
            # arithmetic on it (UNIX_TIMESTAMP would convert through the session zone);
            # evaluated once per statement, like clock_timestamp() per statement.
            self.clock = ("(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', "
                          "UTC_TIMESTAMP(6)) / 1e6)")
            # UUID() is unique per call (per row, too), RAND() adds entropy; md5 folds.
            self.token = "md5(concat(uuid(), rand(), rand()))"
        elif self.is_sqlite:
            # julianday('now') has millisecond precision; convert to unix seconds.
            self.clock = "((julianday('now') - 2440587.5) * 86400.0)"
            self.token = "lower(hex(randomblob(16)))"
        else:  # pragma: no cover - settings validation rejects other schemes
            raise ValueError(f"unsupported dialect {name}")
        #: The parameter mark of hand-written statements (the DB-API's paramstyle).
        self.mark = "?" if self.is_sqlite else "%s"
        #: A hand-written ``VALUES`` list needs its parameters cast to their columns' types
        #: (PostgreSQL types an untyped parameter there as text).
        self.typed_values = self.is_postgres
        #: ``ON CONFLICT .. DO UPDATE .. WHERE`` and ``UPDATE .. RETURNING`` (MySQL has
        #: neither: it decides in a transaction under row locks instead).
        self.returning = not self.is_mysql
        #: ``IN (SELECT .. LIMIT n)`` (MySQL takes a LIMIT on a single-table DELETE only).
        self.limited_subqueries = not self.is_mysql
        #: ``SELECT .. FOR UPDATE [SKIP LOCKED]`` (SQLite locks the whole file instead).
        self.locking_reads = not self.is_sqlite
        #: One independent statement runs in autocommit: one round trip, no BEGIN/COMMIT
        #: (PostgreSQL; SQLite's BEGIN IMMEDIATE takes its write lock, MySQL decides in
        #: transactions).
        self.autocommit_statements = self.is_postgres
        #: A renewal skips the claim rows a fenced transaction holds locked, instead of
        #: waiting for them (in the renewal statement itself: PostgreSQL).
        self.renew_skips_locked = self.is_postgres
        #: Times one reservation round is sent after a deadlock (PostgreSQL: each round
        #: is one autocommit statement, so a failed one left nothing behind).
        self.round_attempts = 4 if self.is_postgres else 1
        #: Times one transaction is run after a deadlock, a lock-wait timeout or a lost
        #: duplicate-key race (MySQL, whose grants are transactions of several statements).
        self.transaction_attempts = 6 if self.is_mysql else 1
        #: ``LISTEN``/``NOTIFY`` and libpq's pipeline mode (PostgreSQL).
        self.notifies = self.is_postgres

    def now(self) -> sa.ColumnElement[float]:
        """The store clock as an SQL expression."""
        return sa.literal_column(self.clock, sa.Float(precision=53))

    def new_token(self) -> sa.ColumnElement[str]:
        """A fresh random token minted inside the statement."""
        return sa.literal_column(self.token, sa.String)

    def greatest(self, *values: Any) -> Any:
        """The larger of ``values`` (SQLite's ``max`` of several arguments)."""
        return (sa.func.max if self.is_sqlite else sa.func.greatest)(*values)

    def insert(self, table: sa.Table) -> Any:
        """A dialect ``INSERT`` that supports ``on_conflict_do_*`` (``on_duplicate_key_update``
        on MySQL)."""
        if self.is_mysql:
            return mysql.insert(table)
        return (postgresql.insert if self.is_postgres else sqlite.insert)(table)

    def insert_or_keep(self, table: sa.Table, values: Mapping[str, Any],
                       key: Sequence[sa.Column[Any]], unchanged: sa.Column[Any]) -> Any:
        """``INSERT`` of ``values`` that leaves a row already holding ``key`` as it is
        (MySQL: an ``ON DUPLICATE KEY UPDATE`` that sets ``unchanged`` to itself)."""
        stmt = self.insert(table).values(**values)
        if self.is_mysql:
            return stmt.on_duplicate_key_update({unchanged.name: unchanged})
        return stmt.on_conflict_do_nothing(index_elements=list(key))

    def upsert(self, table: sa.Table, values: Mapping[str, Any],
               key: Sequence[sa.Column[Any]], update: Sequence[str]) -> Any:
        """``INSERT`` of ``values`` that, over a row holding ``key``, sets the ``update``
        columns to the inserted values."""
        stmt = self.insert(table).values(**values)
        if self.is_mysql:
            return stmt.on_duplicate_key_update(**{c: stmt.inserted[c] for c in update})
        return stmt.on_conflict_do_update(index_elements=list(key),
                                          set_={c: stmt.excluded[c] for c in update})
