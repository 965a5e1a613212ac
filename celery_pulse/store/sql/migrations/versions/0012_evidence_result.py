"""The late result kept with a stale attempt's evidence.

A stale attempt's late success was kept as an outcome only; the reviewer deciding a
needs-review task needs what it returned (its repr, as Celery shows it). Nullable: rows
recorded before this revision, failures and remote workers' completions have none.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import TEXT

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: additive (a nullable column; older
#: code leaves it NULL, as rows from before this revision have it).
OLDEST_CODE = "0011"


def upgrade() -> None:
    with op.batch_alter_table("pulse_evidence") as batch:
        batch.add_column(sa.Column("result", TEXT))


def downgrade() -> None:
    with op.batch_alter_table("pulse_evidence") as batch:
        batch.drop_column("result")
