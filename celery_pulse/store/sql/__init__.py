"""The SQL store: SQLAlchemy 2 Core over PostgreSQL (psycopg 3), MySQL/MariaDB (PyMySQL) or
SQLite."""

from __future__ import annotations

from celery_pulse.store.sql.factory import open_store, store_on
from celery_pulse.store.sql.store import SqlStore

__all__ = ["SqlStore", "open_store", "store_on"]
