"""Review decisions (audit trail).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TABLE_OPTIONS, TEXT

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: its own.
OLDEST_CODE = "0003"


def upgrade() -> None:
    op.create_table(
        "pulse_reviews",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("outcome", sa.String(32)),
        sa.Column("note", TEXT),
        sa.Column("decided_by", sa.String(255), nullable=False),
        sa.Column("decided_at", SECONDS, nullable=False),
        **TABLE_OPTIONS,
    )
    op.create_index("ix_pulse_reviews_task_id", "pulse_reviews", ["task_id"])


def downgrade() -> None:
    op.drop_table("pulse_reviews")
