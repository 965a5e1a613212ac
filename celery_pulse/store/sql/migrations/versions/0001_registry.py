"""Worker registry.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TABLE_OPTIONS, TEXT

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: its own.
OLDEST_CODE = "0001"


def upgrade() -> None:
    op.create_table(
        "pulse_workers",
        sa.Column("worker_id", sa.String(255), primary_key=True),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("labels", TEXT, nullable=False),
        sa.Column("registered_at", SECONDS, nullable=False),
        sa.Column("last_heartbeat", SECONDS, nullable=False),
        sa.Column("expires_at", SECONDS, nullable=False),
        sa.Column("draining", sa.Boolean, nullable=False, server_default=sa.false()),
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    op.drop_table("pulse_workers")
