"""The example's own tables, in the pulse store's database.

They live next to the ``pulse_*`` tables on purpose: ``lease.fenced(conn)`` can only
fence writes to the store's database (it locks the task's claim row in the same
transaction). Create them with::

    python -m example_project.schema          # idempotent; workers also do it at startup
"""

from __future__ import annotations

import os
import sys
import threading

import sqlalchemy as sa
from sqlalchemy.schema import CreateIndex, CreateTable

metadata = sa.MetaData()

#: One row per order charged. The primary key makes a second charge of the same order
#: impossible; ``(task_id, epoch)`` is the fencing token of the attempt that wrote it.
ledger = sa.Table(
    "example_ledger",
    metadata,
    sa.Column("order_id", sa.String(64), primary_key=True),
    sa.Column("amount_cents", sa.Integer, nullable=False),
    sa.Column("provider_ref", sa.String(64), nullable=False),
    sa.Column("task_id", sa.String(255), nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("worker", sa.String(255), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.current_timestamp()),
)

#: Finished reports: written once, at the end, under the lease.
reports = sa.Table(
    "example_reports",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("sections", sa.Integer, nullable=False),
    sa.Column("task_id", sa.String(255), nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("worker", sa.String(255), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False,
              server_default=sa.func.current_timestamp()),
)

#: Exchange rates, upserted by the idempotent periodic sync (a re-run is harmless).
rates = sa.Table(
    "example_rates",
    metadata,
    sa.Column("currency", sa.String(8), primary_key=True),
    sa.Column("rate", sa.Float, nullable=False),
    sa.Column("synced_by", sa.String(255), nullable=False),
    sa.Column("syncs", sa.Integer, nullable=False),
)


def make_engine(url: str) -> sa.Engine:
    """A plain SQLAlchemy engine on the store's database (what a task would use)."""
    if url.startswith("sqlite"):
        # Several worker processes share the file: wait for its write lock.
        return sa.create_engine(url, connect_args={"timeout": 30})
    return sa.create_engine(url)


_engines: dict[tuple[int, str], sa.Engine] = {}
_lock = threading.Lock()


def engine_for(url: str) -> sa.Engine:
    """One engine per process and URL (pool children are forked: never share one)."""
    key = (os.getpid(), url)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = make_engine(url)
    return engine


def ensure_schema(url: str, attempts: int = 5) -> None:
    """Create the example tables if they are missing. Safe to run concurrently."""
    engine = make_engine(url)
    try:
        for attempt in range(attempts):
            try:
                with engine.begin() as conn:
                    for table in metadata.sorted_tables:
                        conn.execute(CreateTable(table, if_not_exists=True))
                        for index in table.indexes:
                            conn.execute(CreateIndex(index, if_not_exists=True))
                return
            except sa.exc.DBAPIError:
                # Two processes creating the same table at the same moment (PostgreSQL
                # can report a duplicate type even with IF NOT EXISTS): try again.
                if attempt == attempts - 1:
                    raise
    finally:
        engine.dispose()


def main() -> None:
    from example_project.app import app

    url = app.conf.pulse_store_url
    ensure_schema(url)
    print(f"example tables ready in {engine_for(url).url.render_as_string()}", file=sys.stdout)


if __name__ == "__main__":
    main()
