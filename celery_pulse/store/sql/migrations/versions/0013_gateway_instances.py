"""Gateway worker instances bound to their owner (``pulse_gateway_instances``).

An instance id belongs to the credential and instance secret that first said hello for
it. A gateway kept that in memory only, so on a new or restarted gateway the first
hello took it, whoever sent it; the store keeps it now, for every gateway process.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TABLE_OPTIONS

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: additive (a new table older code
#: never reads; older gateways keep instances in memory, as before).
OLDEST_CODE = "0012"


def upgrade() -> None:
    op.create_table(
        "pulse_gateway_instances",
        sa.Column("instance_id", sa.String(32), primary_key=True),
        sa.Column("credential_id", sa.String(32), nullable=False),
        sa.Column("secret_digest", sa.String(64), nullable=False),
        sa.Column("created_at", SECONDS, nullable=False),
        sa.Column("seen_at", SECONDS, nullable=False),
        **TABLE_OPTIONS,
    )


def downgrade() -> None:
    op.drop_table("pulse_gateway_instances")
