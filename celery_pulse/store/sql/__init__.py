"""The SQL store: SQLAlchemy 2 Core over PostgreSQL (psycopg 3) or SQLite."""

from __future__ import annotations

from celery_pulse.store.sql.store import SqlStore, open_store

__all__ = ["SqlStore", "open_store"]
