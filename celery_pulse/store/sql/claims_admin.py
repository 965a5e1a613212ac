"""Claim verbs every dialect writes alike in SQLAlchemy Core: a lease's own state, its
release, and the listings operators read (claims, counts, permits).

The per-task hot path (reserve, start, renew, complete) is the dialect's claim engine
(:mod:`.claim_engine`); these are the rest of
:class:`~celery_pulse.store.base.ClaimStore`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.base import (
    LIVE_STATES,
    RESERVED,
    ClaimInfo,
    LeaseKey,
    PermitSignals,
    PermitUsage,
)
from celery_pulse.store.sql import permits as permits_sql
from celery_pulse.store.sql import pooler
from celery_pulse.store.sql.claim_rows import lease_key_in
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import claims


def info_columns(conns: Connections) -> list[Any]:
    """The columns :func:`claim_info` reads, the lease's remainder by the store clock."""
    now = sa.select(conns.now).scalar_subquery()
    return [claims.c.task_id, claims.c.task_name, claims.c.state, claims.c.holder,
            claims.c.epoch, claims.c.attempts, claims.c.max_attempts, claims.c.policy,
            (claims.c.lease_until - now).label("remaining"), claims.c.created_at,
            claims.c.started_at, claims.c.finished_at, claims.c.outcome, claims.c.error,
            claims.c.queue, claims.c.checkpoint_at,
            sa.func.length(claims.c.checkpoint).label("checkpoint_size")]


def claim_info(r: Any) -> ClaimInfo:
    """A row of :func:`info_columns` as the contract shows it."""
    return ClaimInfo(r.task_id, r.task_name, r.state, r.holder, int(r.epoch), int(r.attempts),
                     int(r.max_attempts), r.policy,
                     None if r.remaining is None else float(r.remaining), float(r.created_at),
                     r.started_at, r.finished_at, r.outcome, r.error, r.queue,
                     r.checkpoint_at, r.checkpoint_size)


class SqlClaimsAdmin:
    """The claim verbs of :class:`~.store.SqlStore` outside the hot path."""

    conns: Connections

    def lease_of(self, holder: str, task_id: str, epoch: int, token: str
                 ) -> tuple[str, float] | None:
        now = self.conns.now
        stmt = sa.select(claims.c.state, claims.c.lease_until, now.label("now")).where(
            claims.c.task_id == task_id, claims.c.holder == holder, claims.c.epoch == epoch,
            claims.c.token == token, claims.c.state.in_(LIVE_STATES),
            claims.c.lease_until > now)
        with translated("lease_of"), self.conns.read() as conn:
            row = conn.execute(stmt).one_or_none()
        return None if row is None else (str(row.state), float(row.lease_until))

    def release(self, holder: str, leases: Sequence[LeaseKey], *,
                never_ran: bool = False) -> int:
        if not leases:
            return 0
        states = LIVE_STATES if never_ran else (RESERVED,)
        stmt = (sa.update(claims)
                .where(claims.c.holder == holder, lease_key_in(leases),
                       claims.c.state.in_(states))
                .values(lease_until=self.conns.now, state=RESERVED, started_at=None))
        return self.conns.statement("release", stmt)

    def list_claims(self, states: Sequence[str] | None = None, limit: int = 1000
                    ) -> list[ClaimInfo]:
        stmt = sa.select(*info_columns(self.conns))
        if states:
            stmt = stmt.where(claims.c.state.in_(list(states)))
        stmt = stmt.order_by(claims.c.created_at.desc()).limit(limit)
        with translated("list_claims"), self.conns.read() as conn:
            return [claim_info(r) for r in conn.execute(stmt)]

    def claim_counts(self) -> dict[str, int]:
        now = self.conns.now
        expired = sa.and_(claims.c.state.in_(LIVE_STATES), claims.c.lease_until <= now)
        with translated("claim_counts"), self.conns.read() as conn:
            counts = {r.state: int(r.n) for r in conn.execute(
                sa.select(claims.c.state, sa.func.count().label("n")).group_by(claims.c.state))}
            counts["expired"] = int(conn.execute(
                sa.select(sa.func.count()).select_from(claims).where(expired)).scalar_one())
        return counts

    def permit_usage(self) -> list[PermitUsage]:
        with translated("permit usage"), self.conns.read() as conn:
            return permits_sql.usage(conn, self.conns.dialect)

    def permit_signals(self) -> AbstractContextManager[PermitSignals] | None:
        engine = self.conns.engine
        if not self.conns.dialect.notifies:
            return None
        with translated("permit signal"):
            if not pooler.listens(engine):
                return None  # waiters poll (docs/production.md#pgbouncer)
        return permits_sql.signals(engine)
