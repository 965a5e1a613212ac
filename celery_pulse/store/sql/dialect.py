"""The few things that differ between PostgreSQL, MySQL/MariaDB and SQLite, in one place."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

#: SQLAlchemy's names for the MySQL family (``mariadb`` when the URL says so).
MYSQL_NAMES = ("mysql", "mariadb")


class Dialect:
    """SQL fragments evaluated *by the store*: its clock and its token generator."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_postgres = name == "postgresql"
        self.is_mysql = name in MYSQL_NAMES
        if self.is_postgres:
            # clock_timestamp(), not now(): the real time even inside a transaction.
            self._now = "extract(epoch from clock_timestamp())::float8"
            # Two v4 UUIDs carry 244 random bits; md5 folds them to 128 bits of hex.
            self._token = "md5(gen_random_uuid()::text || gen_random_uuid()::text)"
        elif self.is_mysql:
            # UTC_TIMESTAMP(6) ignores the session's time zone and TIMESTAMPDIFF is plain
            # arithmetic on it (UNIX_TIMESTAMP would convert through the session zone);
            # evaluated once per statement, like clock_timestamp() per statement.
            self._now = ("(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', "
                         "UTC_TIMESTAMP(6)) / 1e6)")
            # UUID() is unique per call (per row, too), RAND() adds entropy; md5 folds.
            self._token = "md5(concat(uuid(), rand(), rand()))"
        elif name == "sqlite":
            # julianday('now') has millisecond precision; convert to unix seconds.
            self._now = "((julianday('now') - 2440587.5) * 86400.0)"
            self._token = "lower(hex(randomblob(16)))"
        else:  # pragma: no cover - settings validation rejects other schemes
            raise ValueError(f"unsupported dialect {name}")

    @property
    def clock(self) -> str:
        """The store clock as SQL text (for hand-written statements)."""
        return self._now

    def now(self) -> sa.ColumnElement[float]:
        """The store clock as an SQL expression."""
        return sa.literal_column(self._now, sa.Float(precision=53))

    def new_token(self) -> sa.ColumnElement[str]:
        """A fresh random token minted inside the statement."""
        return sa.literal_column(self._token, sa.String)

    def insert(self, table: sa.Table) -> Any:
        """A dialect ``INSERT`` that supports ``on_conflict_do_*`` (``on_duplicate_key_update``
        on MySQL)."""
        if self.is_mysql:
            return mysql.insert(table)
        return (postgresql.insert if self.is_postgres else sqlite.insert)(table)
