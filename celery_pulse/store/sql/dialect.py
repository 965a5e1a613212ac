"""The few things that differ between PostgreSQL and SQLite, in one place."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite


class Dialect:
    """SQL fragments evaluated *by the store*: its clock and its token generator."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_postgres = name == "postgresql"
        if self.is_postgres:
            # clock_timestamp(), not now(): the real time even inside a transaction.
            self._now = "extract(epoch from clock_timestamp())::float8"
            # Two v4 UUIDs carry 244 random bits; md5 folds them to 128 bits of hex.
            self._token = "md5(gen_random_uuid()::text || gen_random_uuid()::text)"
        elif name == "sqlite":
            # julianday('now') has millisecond precision; convert to unix seconds.
            self._now = "((julianday('now') - 2440587.5) * 86400.0)"
            self._token = "lower(hex(randomblob(16)))"
        else:  # pragma: no cover - settings validation rejects other schemes
            raise ValueError(f"unsupported dialect {name}")

    def now(self) -> sa.ColumnElement[float]:
        """The store clock as an SQL expression."""
        return sa.literal_column(self._now, sa.Float(precision=53))

    def new_token(self) -> sa.ColumnElement[str]:
        """A fresh random token minted inside the statement."""
        return sa.literal_column(self._token, sa.String)

    def insert(self, table: sa.Table) -> Any:
        """A dialect ``INSERT`` that supports ``on_conflict_do_*``."""
        return (postgresql.insert if self.is_postgres else sqlite.insert)(table)
