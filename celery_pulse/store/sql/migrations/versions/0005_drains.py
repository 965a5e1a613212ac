"""Persistent drain requests.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TABLE_OPTIONS

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: its own.
OLDEST_CODE = "0005"


def upgrade() -> None:
    op.create_table(
        "pulse_drains",
        sa.Column("worker_id", sa.String(255), primary_key=True),
        sa.Column("requested_by", sa.String(255), nullable=False),
        sa.Column("requested_at", SECONDS, nullable=False),
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    op.drop_table("pulse_drains")
