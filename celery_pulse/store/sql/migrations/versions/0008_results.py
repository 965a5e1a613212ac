"""The ``pulse://`` result backend's table.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import BLOB, SECONDS, TABLE_OPTIONS

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pulse_results",
        sa.Column("key", sa.String(512), primary_key=True),
        sa.Column("value", BLOB),
        sa.Column("counter", sa.BigInteger),
        sa.Column("state", sa.String(32)),
        sa.Column("updated_at", SECONDS, nullable=False),
        sa.Column("expires_at", SECONDS),
        **TABLE_OPTIONS,
    )
    op.create_index("ix_pulse_results_expires", "pulse_results", ["expires_at"],
                    postgresql_where=sa.text("expires_at IS NOT NULL"),
                    sqlite_where=sa.text("expires_at IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_pulse_results_expires", "pulse_results")
    op.drop_table("pulse_results")
