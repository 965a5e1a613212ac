"""Gateway sessions and attempts in the store (``pulse_gateway_instances`` grows, and
``pulse_gateway_attempts``).

A gateway kept its instances' sessions and the attempts it assigned in its own memory:
a restarted gateway, or another one behind the same load balancer, answered a re-sent
``task.finish`` NOT_FOUND and finished work went to review. The store keeps them now,
so every gateway process answers every instance.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_pulse.store.sql.types import SECONDS, TABLE_OPTIONS

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None
#: The oldest code revision that runs on this schema: additive (columns with defaults,
#: a new table; older gateways keep sessions in memory, as before).
OLDEST_CODE = "0013"


def upgrade() -> None:
    with op.batch_alter_table("pulse_gateway_instances") as batch:
        batch.add_column(sa.Column("generation", sa.BigInteger, nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("session_id", sa.String(32)))
        batch.add_column(sa.Column("gateway", sa.String(255)))
        batch.add_column(sa.Column("identity_digest", sa.String(64)))
        batch.add_column(sa.Column("capacity_sequence", sa.BigInteger, nullable=False,
                                   server_default="-1"))
        batch.add_column(sa.Column("capacity", sa.Integer, nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("drain", sa.Boolean, nullable=False,
                                   server_default=sa.false()))
    op.create_table(
        "pulse_gateway_attempts",
        sa.Column("attempt_id", sa.String(32), primary_key=True),
        sa.Column("instance_id", sa.String(32), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("wire_task_id", sa.String(32), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("token_digest", sa.String(64), nullable=False),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("created_at", SECONDS, nullable=False),
        **TABLE_OPTIONS,
    )
    op.create_index("ix_pulse_gateway_attempts_instance", "pulse_gateway_attempts",
                    ["instance_id", "created_at"])
    op.create_index("ix_pulse_gateway_attempts_created", "pulse_gateway_attempts",
                    ["created_at"])
    op.create_index("ix_pulse_gateway_attempts_task", "pulse_gateway_attempts", ["task_id"])


def downgrade() -> None:
    op.drop_table("pulse_gateway_attempts")
    with op.batch_alter_table("pulse_gateway_instances") as batch:
        for column in ("drain", "capacity", "capacity_sequence", "identity_digest",
                       "gateway", "session_id", "generation"):
            batch.drop_column(column)
