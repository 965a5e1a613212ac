"""The claims' queue, and one index per filter of the operators' pages.

The Pulse pages list claims newest first under a filter (state, queue, task name,
holder) and must answer at once with 100,000 claims: each filter gets an index ending in
``(created_at, task_id)``, the pages' order, so a page is a range scan of one index and
its cursor a seek into it. The queue was only inside ``delivery_info`` (JSON text); it is
now kept at reservation. Claims reserved before this revision keep a NULL queue (filling
it would rewrite every row of a large table while the migration holds it).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: additive (a nullable column and
#: indexes; older code leaves the queue NULL, as rows from before this revision have it).
OLDEST_CODE = "0010"

#: Kept here as written at this revision (tables.VIEW_INDEXES may change later).
INDEXES: dict[str, tuple[str, ...]] = {
    "created": (), "state_created": ("state",), "queue_created": ("queue",),
    "name_created": ("task_name",), "holder_created": ("holder",)}


def upgrade() -> None:
    with op.batch_alter_table("pulse_claims") as batch:
        batch.add_column(sa.Column("queue", sa.String(255)))
    for name, columns in INDEXES.items():
        op.create_index(f"ix_pulse_claims_{name}", "pulse_claims",
                        [*columns, "created_at", "task_id"])


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(f"ix_pulse_claims_{name}", table_name="pulse_claims")
    with op.batch_alter_table("pulse_claims") as batch:
        batch.drop_column("queue")
