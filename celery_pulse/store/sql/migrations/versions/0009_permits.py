"""Cluster-wide concurrency permits: the limits seen (``pulse_permits``) and which claim
asked for which (``pulse_permit_holds``).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TABLE_OPTIONS

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: its own.
OLDEST_CODE = "0009"


def upgrade() -> None:
    op.create_table(
        "pulse_permits",
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("max_running", sa.Integer, nullable=False),
        sa.Column("updated_at", SECONDS, nullable=False),
        **TABLE_OPTIONS,
    )
    op.create_table(
        "pulse_permit_holds",
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("task_id", sa.String(255), primary_key=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("held", sa.Boolean, nullable=False),
        **TABLE_OPTIONS,
    )
    op.create_index("ix_pulse_permit_holds_task", "pulse_permit_holds", ["task_id"])


def downgrade() -> None:
    op.drop_index("ix_pulse_permit_holds_task", "pulse_permit_holds")
    op.drop_table("pulse_permit_holds")
    op.drop_table("pulse_permits")
