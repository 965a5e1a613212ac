"""A rate key's upper bound on its recent starts: five nullable columns on
``pulse_permits``, so a start far from its limit is granted without counting the
window (:mod:`celery_pulse.store.rate_bound`).

``bucket_no``, ``bucket_starts`` and ``prev_starts``: two fixed buckets of ``bucket_s``
seconds; ``bounded_at``: when this code last kept them, trusted only while it equals
``updated_at`` (which a worker of the revision before sets at each start of the key).

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: additive. Older code never reads
#: the columns, and its starts of a rate key move ``updated_at``, so the bound is not
#: trusted until the next start counts the window again.
OLDEST_CODE = "0017"

COLUMNS = ("bounded_at", "bucket_s", "bucket_no", "bucket_starts", "prev_starts")


def upgrade() -> None:
    with op.batch_alter_table("pulse_permits") as batch:
        batch.add_column(sa.Column("bounded_at", SECONDS))
        batch.add_column(sa.Column("bucket_s", SECONDS))
        batch.add_column(sa.Column("bucket_no", sa.BigInteger))
        batch.add_column(sa.Column("bucket_starts", sa.Integer))
        batch.add_column(sa.Column("prev_starts", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("pulse_permits") as batch:
        for name in reversed(COLUMNS):
            batch.drop_column(name)
