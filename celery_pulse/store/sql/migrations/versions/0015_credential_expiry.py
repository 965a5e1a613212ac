"""Gateway credentials that expire, and rotate with two live secrets (``pulse_credentials``).

A credential lived until revoked, and changing its secret meant a new credential (a new
id, a new name) and a moment when the workers held a token that no longer worked. Now a
credential may carry an expiry, and a rotation keeps the previous secret valid for a
grace period while the workers' files are replaced.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: additive (nullable columns older
#: code never reads: its credentials neither expire nor rotate).
OLDEST_CODE = "0014"

COLUMNS = ("expires_at", "previous_digest", "previous_until", "rotated_at", "rotated_by")


def upgrade() -> None:
    with op.batch_alter_table("pulse_credentials") as batch:
        batch.add_column(sa.Column("expires_at", SECONDS))
        batch.add_column(sa.Column("previous_digest", sa.String(64)))
        batch.add_column(sa.Column("previous_until", SECONDS))
        batch.add_column(sa.Column("rotated_at", SECONDS))
        batch.add_column(sa.Column("rotated_by", sa.String(255)))


def downgrade() -> None:
    with op.batch_alter_table("pulse_credentials") as batch:
        for column in reversed(COLUMNS):
            batch.drop_column(column)
