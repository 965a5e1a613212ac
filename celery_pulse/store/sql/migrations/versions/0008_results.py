"""The ``pulse://`` result backend's table; on PostgreSQL, a trigger that announces each
value written (``NOTIFY pulse_results, '<key>'``), so that ``AsyncResult.get()`` wakes
on the commit instead of polling.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import BLOB, SECONDS, TABLE_OPTIONS

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: its own.
OLDEST_CODE = "0008"

#: The channel is the one ``celery_pulse.store.sql.results.CHANNEL`` listens on.
NOTIFY_FUNCTION = """
CREATE OR REPLACE FUNCTION pulse_results_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('pulse_results', NEW.key);
    RETURN NULL;
END
$$ LANGUAGE plpgsql
"""


def upgrade() -> None:
    op.create_table(
        "pulse_results",
        sa.Column("key", sa.String(512), primary_key=True),
        sa.Column("value", BLOB),
        sa.Column("counter", sa.BigInteger),
        sa.Column("state", sa.String(32)),
        sa.Column("updated_at", SECONDS, nullable=False),
        sa.Column("expires_at", SECONDS),
        **TABLE_OPTIONS,
    )
    op.create_index("ix_pulse_results_expires", "pulse_results", ["expires_at"],
                    postgresql_where=sa.text("expires_at IS NOT NULL"),
                    sqlite_where=sa.text("expires_at IS NOT NULL"))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(NOTIFY_FUNCTION)
        op.execute("CREATE TRIGGER pulse_results_notify AFTER INSERT OR UPDATE OF value "
                   "ON pulse_results FOR EACH ROW WHEN (NEW.value IS NOT NULL) "
                   "EXECUTE FUNCTION pulse_results_notify()")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS pulse_results_notify ON pulse_results")
        op.execute("DROP FUNCTION IF EXISTS pulse_results_notify()")
    op.drop_index("ix_pulse_results_expires", "pulse_results")
    op.drop_table("pulse_results")
