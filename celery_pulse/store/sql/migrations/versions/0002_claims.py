"""Task claims and evidence.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import BLOB, SECONDS, TABLE_OPTIONS, TEXT

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: its own.
OLDEST_CODE = "0002"

_ts = SECONDS


def upgrade() -> None:
    op.create_table(
        "pulse_claims",
        sa.Column("task_id", sa.String(255), primary_key=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("holder", sa.String(255)),
        sa.Column("token", sa.String(64)),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("lease_until", _ts),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("policy", sa.String(16), nullable=False),
        sa.Column("retries", sa.Integer, nullable=False),
        sa.Column("body", BLOB, nullable=False),
        sa.Column("headers", TEXT, nullable=False),
        sa.Column("properties", TEXT, nullable=False),
        sa.Column("delivery_info", TEXT, nullable=False),
        sa.Column("content_type", sa.String(128), nullable=False),
        sa.Column("content_encoding", sa.String(64), nullable=False),
        sa.Column("created_at", _ts, nullable=False),
        sa.Column("reserved_at", _ts),
        sa.Column("started_at", _ts),
        sa.Column("finished_at", _ts),
        sa.Column("outcome", sa.String(32)),
        sa.Column("error", TEXT),
        **TABLE_OPTIONS,
    )
    op.create_index("ix_pulse_claims_state_lease", "pulse_claims", ["state", "lease_until"])
    op.create_index("ix_pulse_claims_holder", "pulse_claims", ["holder"])
    op.create_index("ix_pulse_claims_finished", "pulse_claims", ["finished_at"])
    op.create_table(
        "pulse_evidence",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("error", TEXT),
        sa.Column("recorded_at", _ts, nullable=False),
        **TABLE_OPTIONS,
    )
    op.create_index("ix_pulse_evidence_task_id", "pulse_evidence", ["task_id"])


def downgrade() -> None:
    op.drop_table("pulse_evidence")
    op.drop_table("pulse_claims")
