"""Operators' reviews in SQL: the claims in ``needs_review``, and the two decisions on
one (retry it, or resolve it as succeeded or failed), each audited in ``pulse_reviews``
in the decision's own transaction."""

from __future__ import annotations

import json

import sqlalchemy as sa

from celery_pulse.errors import InvalidConfig, NotFound
from celery_pulse.store.base import (
    FAILED,
    NEEDS_REVIEW,
    OPEN,
    SUCCEEDED,
    Recovered,
    ReviewItem,
)
from celery_pulse.store.sql.claim_rows import recovered
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import claims, reviews


class SqlReviews:
    """The review verbs of :class:`~.store.SqlStore`."""

    conns: Connections

    def list_review(self, limit: int = 1000) -> list[ReviewItem]:
        stmt = (sa.select(claims.c.task_id, claims.c.task_name, claims.c.holder, claims.c.epoch,
                          claims.c.attempts, claims.c.headers, claims.c.reserved_at,
                          claims.c.created_at)
                .where(claims.c.state == NEEDS_REVIEW).order_by(claims.c.created_at).limit(limit))
        with translated("list_review"), self.conns.read() as conn:
            rows = conn.execute(stmt).all()
        items = []
        for r in rows:
            try:
                headers = json.loads(r.headers)
                summary = f"{headers.get('argsrepr', '')} {headers.get('kwargsrepr', '')}".strip()
            except (ValueError, AttributeError):
                summary = "<unreadable headers>"
            items.append(ReviewItem(r.task_id, r.task_name, r.holder, int(r.epoch),
                                    int(r.attempts), summary[:200],
                                    float(r.reserved_at or r.created_at)))
        return items

    def _audit(self, conn: sa.Connection, task_id: str, action: str, outcome: str | None,
               who: str, note: str | None) -> None:
        conn.execute(sa.insert(reviews).values(task_id=task_id, action=action, outcome=outcome,
                                               note=note, decided_by=who,
                                               decided_at=self.conns.now))

    def review_retry(self, task_id: str, scanner: str, publish_ttl: float, who: str,
                     note: str | None) -> Recovered:
        dialect, now = self.conns.dialect, self.conns.now
        with translated("review_retry"), self.conns.engine.begin() as conn:
            row = conn.execute(sa.select(claims).where(
                claims.c.task_id == task_id,
                claims.c.state.in_((NEEDS_REVIEW, FAILED))).with_for_update()).one_or_none()
            if row is None:
                raise NotFound(f"no needs-review or failed task {task_id}")
            (got,) = self.conns.updated(
                conn, [task_id], sa.update(claims)
                .where(claims.c.task_id == task_id, claims.c.epoch == row.epoch)
                .values(state=OPEN, epoch=claims.c.epoch + 1, holder=scanner,
                        token=dialect.new_token(), lease_until=now + publish_ttl,
                        max_attempts=dialect.greatest(claims.c.max_attempts,
                                                      claims.c.attempts + 1),
                        finished_at=None, outcome=None, error=None))
            self._audit(conn, task_id, "retry", None, who, note)
        return recovered(row, OPEN, int(got.epoch), got.token)

    def review_resolve(self, task_id: str, outcome: str, who: str, note: str | None) -> None:
        if outcome not in (SUCCEEDED, FAILED):
            raise InvalidConfig(f"--outcome must be succeeded or failed, got {outcome!r}")
        with translated("review_resolve"), self.conns.engine.begin() as conn:
            done = conn.execute(
                sa.update(claims).where(claims.c.task_id == task_id,
                                        claims.c.state == NEEDS_REVIEW)
                .values(state=outcome, outcome=outcome, finished_at=self.conns.now,
                        error=f"resolved by {who}" + (f": {note}" if note else ""))).rowcount
            if not done:
                raise NotFound(f"no needs-review task {task_id}")
            self._audit(conn, task_id, "resolve", outcome, who, note)
