"""Claim indexes that stay off the hot path.

Every task updates its claim row twice after the insert (start, completion), and
renewals update live rows every interval; each update of an indexed column adds an
entry to every index. The holder index served no query (all of them key on the task
id) and misled the planner into scanning a worker's every claim for one start; the
expiry and retention indexes now only cover the rows their scans look for (under a
lease; finished), so a finished claim leaves the expiry index for good.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: indexes only, older code runs
#: the same queries on it.
OLDEST_CODE = "0005"

LEASED = sa.text("lease_until IS NOT NULL")
FINISHED = sa.text("finished_at IS NOT NULL")


def upgrade() -> None:
    op.drop_index("ix_pulse_claims_holder", table_name="pulse_claims")
    op.drop_index("ix_pulse_claims_state_lease", table_name="pulse_claims")
    op.drop_index("ix_pulse_claims_finished", table_name="pulse_claims")
    op.create_index("ix_pulse_claims_lease", "pulse_claims", ["lease_until"],
                    postgresql_where=LEASED, sqlite_where=LEASED)
    op.create_index("ix_pulse_claims_finished", "pulse_claims", ["finished_at"],
                    postgresql_where=FINISHED, sqlite_where=FINISHED)


def downgrade() -> None:
    op.drop_index("ix_pulse_claims_finished", table_name="pulse_claims")
    op.drop_index("ix_pulse_claims_lease", table_name="pulse_claims")
    op.create_index("ix_pulse_claims_finished", "pulse_claims", ["finished_at"])
    op.create_index("ix_pulse_claims_state_lease", "pulse_claims", ["state", "lease_until"])
    op.create_index("ix_pulse_claims_holder", "pulse_claims", ["holder"])
