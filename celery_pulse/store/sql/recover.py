"""Taking claims back in SQL: Recover's scan of expired leases, a worker's requeue, and
the mark that a recovered claim was published again (the contract is
:class:`~celery_pulse.store.base.RecoverStore`).

Recover reads a batch of expired claims (``FOR UPDATE SKIP LOCKED`` where the database
has row locks: rows another scanner is taking are skipped, not waited for) and moves
each group in one statement fenced by (task_id, epoch): ``open`` again under the
scanner's lease, ``failed`` when the attempt budget is spent, ``needs_review`` when a
review-policy task had started. A row it cannot read is marked failed, never left to
stall the scan.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.base import (
    FAILED,
    LIVE_STATES,
    NEEDS_REVIEW,
    OPEN,
    RESERVED,
    RETRY,
    LeaseKey,
    Recovered,
)
from celery_pulse.store.sql.claim_rows import lease_key_in, recovered
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import claims

#: The logger the store's recovery lines have always been under.
logger = logging.getLogger("celery_pulse.store.sql.store")


class SqlRecover:
    """The recovery verbs of :class:`~.store.SqlStore`."""

    conns: Connections

    def recover(self, scanner: str, batch: int, publish_ttl: float) -> list[Recovered]:
        now = self.conns.now
        expired = sa.or_(
            sa.and_(claims.c.state.in_(LIVE_STATES), claims.c.lease_until <= now),
            sa.and_(claims.c.state == OPEN, claims.c.lease_until.is_not(None),
                    claims.c.lease_until <= now))
        pick = sa.select(claims).where(expired).order_by(claims.c.lease_until).limit(batch)
        if self.conns.dialect.locking_reads:
            # Rows another scanner is taking right now are skipped, not waited for.
            pick = pick.with_for_update(skip_locked=True)
        out: list[Recovered] = []
        with translated("recover"), self.conns.engine.begin() as conn:
            rows = conn.execute(pick).all()
            groups: dict[str, list[Any]] = {OPEN: [], FAILED: [], NEEDS_REVIEW: []}
            for r in rows:
                redispatch = r.state in (RESERVED, OPEN) or r.policy == "redispatch"
                if not redispatch:
                    groups[NEEDS_REVIEW].append(r)
                elif r.attempts >= r.max_attempts:
                    groups[FAILED].append(r)
                else:
                    groups[OPEN].append(r)
            for state, members in groups.items():
                if members:
                    out += self._move(conn, scanner, publish_ttl, state, members)
        return out

    def _move(self, conn: sa.Connection, scanner: str, publish_ttl: float, state: str,
              members: list[Any]) -> list[Recovered]:
        """One group of Recover's batch to ``state``, fenced by (task_id, epoch)."""
        now = self.conns.now
        key = sa.tuple_(claims.c.task_id, claims.c.epoch).in_(
            [(r.task_id, r.epoch) for r in members])
        values: dict[str, Any] = {"state": state, "epoch": claims.c.epoch + 1}
        if state == OPEN:
            values.update(holder=scanner, token=self.conns.dialect.new_token(),
                          lease_until=now + publish_ttl)
        elif state == FAILED:
            values.update(token=None, lease_until=None, finished_at=now,
                          outcome="exhausted",
                          error="attempt budget exhausted (lease expired)")
        else:  # it enters review now (``finished_at``: retention never purges needs_review)
            values.update(token=None, lease_until=None, outcome="unknown", finished_at=now,
                          error="started, then its lease expired: outcome unknown")
        granted = {g.task_id: g for g in self.conns.updated(
            conn, [r.task_id for r in members],
            sa.update(claims).where(key).values(**values))}
        out: list[Recovered] = []
        for r in members:
            g = granted.get(r.task_id)
            if g is None:
                continue
            try:
                out.append(recovered(r, state, int(g.epoch), g.token))
            except (ValueError, TypeError) as exc:
                # A corrupted row must not stall recovery of every other claim.
                logger.error("pulse: claim %s is corrupted (%s): marked failed",
                             r.task_id, exc)
                conn.execute(sa.update(claims).where(
                    claims.c.task_id == r.task_id, claims.c.epoch == g.epoch).values(
                    state=FAILED, outcome="corrupted", finished_at=now,
                    lease_until=None, token=None,
                    error=f"corrupted claim row: {exc}"[:500]))
        return out

    def requeue(self, holder: str, leases: Sequence[LeaseKey], publish_ttl: float
                ) -> list[Recovered]:
        if not leases:
            return []
        now = self.conns.now
        out: list[Recovered] = []
        with translated("requeue"), self.conns.engine.begin() as conn:
            rows = {r.task_id: r for r in conn.execute(sa.select(claims).where(
                claims.c.holder == holder, lease_key_in(leases),
                claims.c.state.in_(LIVE_STATES), claims.c.lease_until > now
            ).with_for_update())}
            if not rows:
                return []
            moved = self.conns.updated(conn, list(rows), sa.update(claims).where(
                sa.tuple_(claims.c.task_id, claims.c.epoch).in_(
                    [(r.task_id, r.epoch) for r in rows.values()]),
                claims.c.state.in_(LIVE_STATES)).values(
                state=OPEN, epoch=claims.c.epoch + 1, holder=holder,
                token=self.conns.dialect.new_token(), lease_until=now + publish_ttl,
                started_at=None, outcome=RETRY, error="requeued"))
            for g in moved:
                out.append(recovered(rows[g.task_id], OPEN, int(g.epoch), g.token))
        return out

    def mark_published(self, items: Sequence[LeaseKey]) -> int:
        if not items:
            return 0
        stmt = (sa.update(claims).where(lease_key_in(items), claims.c.state == OPEN)
                .values(lease_until=None, holder=None, token=None))
        return self.conns.statement("mark_published", stmt)
