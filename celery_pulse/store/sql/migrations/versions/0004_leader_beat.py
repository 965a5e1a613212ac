"""Leader election, beat slots and state, dynamic schedule.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TABLE_OPTIONS, TEXT

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: its own.
OLDEST_CODE = "0004"

_ts = SECONDS


def upgrade() -> None:
    op.create_table(
        "pulse_leaders",
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("lease_until", _ts, nullable=False),
        sa.Column("acquired_at", _ts, nullable=False),
        **TABLE_OPTIONS,
    )
    op.create_table(
        "pulse_beat_slots",
        sa.Column("entry", sa.String(255), primary_key=True),
        sa.Column("due_at", _ts, primary_key=True),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("payload", TEXT, nullable=False),
        sa.Column("leader_epoch", sa.BigInteger, nullable=False),
        sa.Column("created_at", _ts, nullable=False),
        sa.Column("published_at", _ts),
        **TABLE_OPTIONS,
    )
    op.create_index("ix_pulse_beat_slots_unpublished", "pulse_beat_slots", ["published_at"])
    op.create_table(
        "pulse_beat_state",
        sa.Column("entry", sa.String(255), primary_key=True),
        sa.Column("last_run_at", _ts, nullable=False),
        **TABLE_OPTIONS,
    )
    op.create_table(
        "pulse_schedule",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("spec", TEXT, nullable=False),
        sa.Column("args", TEXT, nullable=False),
        sa.Column("kwargs", TEXT, nullable=False),
        sa.Column("options", TEXT, nullable=False),
        sa.Column("enabled", sa.Boolean, nullable=False),
        sa.Column("updated_at", _ts, nullable=False),
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    for table in ("pulse_schedule", "pulse_beat_state", "pulse_beat_slots", "pulse_leaders"):
        op.drop_table(table)
