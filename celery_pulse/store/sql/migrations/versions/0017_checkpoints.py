"""Checkpoints carried by the lease: four nullable columns on ``pulse_claims``.

``checkpoint`` (JSON text), the ``checkpoint_epoch`` and ``checkpoint_seq`` of the write
that made it, and ``checkpoint_at`` (store clock). On the claim row, so retention purges
a checkpoint with its claim.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TEXT

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: additive (nullable columns older
#: code never reads nor writes).
OLDEST_CODE = "0016"

COLUMNS = ("checkpoint", "checkpoint_epoch", "checkpoint_seq", "checkpoint_at")


def upgrade() -> None:
    with op.batch_alter_table("pulse_claims") as batch:
        batch.add_column(sa.Column("checkpoint", TEXT))
        batch.add_column(sa.Column("checkpoint_epoch", sa.BigInteger))
        batch.add_column(sa.Column("checkpoint_seq", sa.BigInteger))
        batch.add_column(sa.Column("checkpoint_at", SECONDS))


def downgrade() -> None:
    with op.batch_alter_table("pulse_claims") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
