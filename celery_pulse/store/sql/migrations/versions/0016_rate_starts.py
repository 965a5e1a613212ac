"""Cluster-wide rate limits (``pulse_rate_starts``): the starts each rate key granted.

A rate limit ("at most N starts in any window") is decided in the start's statement, by
counting the key's starts newer than the window; this table keeps them, and a rate key's
row of ``pulse_permits`` its window (``window_s``; NULL for a concurrency limit).

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TABLE_OPTIONS

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: additive (a new table and a
#: nullable column older code never reads; it knows no rate limits).
OLDEST_CODE = "0015"


def upgrade() -> None:
    op.create_table(
        "pulse_rate_starts",
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("task_id", sa.String(255), primary_key=True),
        sa.Column("epoch", sa.BigInteger, primary_key=True),
        sa.Column("started_at", SECONDS, nullable=False),
        **TABLE_OPTIONS,
    )
    op.create_index("ix_pulse_rate_starts_key", "pulse_rate_starts", ["key", "started_at"])
    with op.batch_alter_table("pulse_permits") as batch:
        batch.add_column(sa.Column("window_s", SECONDS))


def downgrade() -> None:
    with op.batch_alter_table("pulse_permits") as batch:
        batch.drop_column("window_s")
    op.drop_index("ix_pulse_rate_starts_key", table_name="pulse_rate_starts")
    op.drop_table("pulse_rate_starts")
