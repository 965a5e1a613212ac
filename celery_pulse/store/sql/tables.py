"""Table definitions, once. Migrations are checked against these by the test suite.

Timestamps are store-clock seconds since the epoch as double precision: the same
arithmetic works on PostgreSQL and SQLite, and nothing ever compares them with a
process clock.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

workers = sa.Table(
    "pulse_workers",
    metadata,
    sa.Column("worker_id", sa.String(255), primary_key=True),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("labels", sa.Text, nullable=False),
    sa.Column("registered_at", sa.Float(precision=53), nullable=False),
    sa.Column("last_heartbeat", sa.Float(precision=53), nullable=False),
    sa.Column("expires_at", sa.Float(precision=53), nullable=False),
    sa.Column("draining", sa.Boolean, nullable=False, server_default=sa.false()),
)
