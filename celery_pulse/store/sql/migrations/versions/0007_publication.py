"""The publication a claim belongs to, so a task id may be published again.

Celery re-uses a task id on purpose (``Task.replace``, a frozen signature applied
again, a deterministic ``task_id``, a retry): each is a new publication and must run,
while a redelivery of one publication must not. ``pulse_pub`` (stamped at publish
time) tells the two apart; claims made before this revision have none.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: its own.
OLDEST_CODE = "0007"


def upgrade() -> None:
    with op.batch_alter_table("pulse_claims") as batch:
        batch.add_column(sa.Column("publication", sa.String(64)))


def downgrade() -> None:
    with op.batch_alter_table("pulse_claims") as batch:
        batch.drop_column("publication")
