"""Gateway credentials (``pulse_credentials``): hashed secrets, scopes and queues.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TABLE_OPTIONS, TEXT

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: its own.
OLDEST_CODE = "0010"


def upgrade() -> None:
    op.create_table(
        "pulse_credentials",
        sa.Column("credential_id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("secret_digest", sa.String(64), nullable=False),
        sa.Column("scopes", TEXT, nullable=False),
        sa.Column("queues", TEXT, nullable=False),
        sa.Column("created_at", SECONDS, nullable=False),
        sa.Column("created_by", sa.String(255), nullable=False),
        sa.Column("revoked_at", SECONDS),
        sa.Column("revoked_by", sa.String(255)),
        **TABLE_OPTIONS,
    )
    op.create_index("ux_pulse_credentials_name", "pulse_credentials", ["name"], unique=True)


def downgrade() -> None:
    op.drop_index("ux_pulse_credentials_name", "pulse_credentials")
    op.drop_table("pulse_credentials")
