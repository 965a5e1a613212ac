"""Operators' reviews in SQL: the claims in ``needs_review``, and the two decisions on
one (retry it, or resolve it as succeeded or failed), each audited in ``pulse_reviews``
in the decision's own transaction.

A decision names the claim it saw (``expected_epoch``); if the claim moved on meanwhile
(another reviewer retried or resolved it, or a newer attempt took it) the decision
changes nothing and raises :class:`~celery_pulse.errors.Moved` saying what it is now.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_pulse.errors import InvalidConfig, Moved, NotFound
from celery_pulse.store.base import (
    FAILED,
    NEEDS_REVIEW,
    OPEN,
    SUCCEEDED,
    Recovered,
    ReviewItem,
)
from celery_pulse.store.pages import ClaimQuery
from celery_pulse.store.sql.claim_rows import recovered
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import claims, reviews
from celery_pulse.store.views import (
    REVIEWABLE_STATES,
    args_summary,
    check_query,
    moved_message,
    review_reason,
)


def filtered(stmt: Any, query: ClaimQuery) -> Any:
    """``stmt`` with ``query``'s filters (each one an indexed column)."""
    if query.states:
        stmt = stmt.where(claims.c.state.in_(list(query.states)))
    if query.queue is not None:
        stmt = stmt.where(claims.c.queue == query.queue)
    if query.task_name is not None:
        stmt = stmt.where(claims.c.task_name == query.task_name)
    if query.worker is not None:
        stmt = stmt.where(claims.c.holder == query.worker)
    return stmt


class SqlReviews:
    """The review verbs of :class:`~.store.SqlStore`."""

    conns: Connections

    def list_review(self, limit: int = 1000, query: ClaimQuery | None = None
                    ) -> list[ReviewItem]:
        query = query or ClaimQuery()
        check_query(query, REVIEWABLE_STATES)
        if not query.states:
            query = ClaimQuery((NEEDS_REVIEW,), query.queue, query.task_name, query.worker)
        stmt = filtered(
            sa.select(claims.c.task_id, claims.c.task_name, claims.c.holder, claims.c.epoch,
                      claims.c.attempts, claims.c.max_attempts, claims.c.headers,
                      claims.c.reserved_at, claims.c.created_at, claims.c.finished_at,
                      claims.c.outcome, claims.c.error, claims.c.checkpoint_at,
                      sa.func.length(claims.c.checkpoint).label("checkpoint_size")), query)
        stmt = stmt.order_by(claims.c.created_at, claims.c.task_id).limit(limit)
        with translated("list_review"), self.conns.read() as conn:
            rows = conn.execute(stmt).all()
        return [ReviewItem(r.task_id, r.task_name, r.holder, int(r.epoch), int(r.attempts),
                           args_summary(r.headers), float(r.reserved_at or r.created_at),
                           review_reason(r.outcome, r.error, r.holder, int(r.epoch),
                                         int(r.max_attempts)),
                           None if r.finished_at is None else float(r.finished_at),
                           r.checkpoint_at, r.checkpoint_size)
                for r in rows]

    def _audit(self, conn: sa.Connection, task_id: str, action: str, outcome: str | None,
               who: str, note: str | None) -> None:
        conn.execute(sa.insert(reviews).values(task_id=task_id, action=action, outcome=outcome,
                                               note=note, decided_by=who,
                                               decided_at=self.conns.now))

    @staticmethod
    def _moved(conn: sa.Connection, task_id: str, what: str) -> NotFound:
        """:class:`Moved` saying what the claim is now, or NotFound if there is none."""
        row = conn.execute(sa.select(claims.c.state, claims.c.epoch)
                           .where(claims.c.task_id == task_id)).one_or_none()
        if row is None:
            return NotFound(f"no {what} task {task_id}")
        last = conn.execute(
            sa.select(reviews.c.action, reviews.c.outcome, reviews.c.decided_by,
                      reviews.c.decided_at).where(reviews.c.task_id == task_id)
            .order_by(reviews.c.id.desc()).limit(1)).one_or_none()
        return Moved(moved_message(task_id, row.state, int(row.epoch), None if last is None
                                   else (last.action, last.outcome, last.decided_by,
                                         float(last.decided_at))))

    def review_retry(self, task_id: str, scanner: str, publish_ttl: float, who: str,
                     note: str | None, expected_epoch: int | None = None) -> Recovered:
        dialect, now = self.conns.dialect, self.conns.now
        pick = sa.select(claims).where(claims.c.task_id == task_id,
                                       claims.c.state.in_((NEEDS_REVIEW, FAILED)))
        if expected_epoch is not None:
            pick = pick.where(claims.c.epoch == expected_epoch)
        with translated("review_retry"), self.conns.engine.begin() as conn:
            row = conn.execute(pick.with_for_update()).one_or_none()
            if row is None:
                raise self._moved(conn, task_id, "needs-review or failed")
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

    def review_resolve(self, task_id: str, outcome: str, who: str, note: str | None,
                       expected_epoch: int | None = None) -> None:
        if outcome not in (SUCCEEDED, FAILED):
            raise InvalidConfig(f"--outcome must be succeeded or failed, got {outcome!r}")
        stmt = sa.update(claims).where(claims.c.task_id == task_id,
                                       claims.c.state == NEEDS_REVIEW)
        if expected_epoch is not None:
            stmt = stmt.where(claims.c.epoch == expected_epoch)
        with translated("review_resolve"), self.conns.engine.begin() as conn:
            done = conn.execute(
                stmt.values(state=outcome, outcome=outcome, finished_at=self.conns.now,
                            error=f"resolved by {who}" + (f": {note}" if note else ""))
            ).rowcount
            if not done:
                raise self._moved(conn, task_id, "needs-review")
            self._audit(conn, task_id, "resolve", outcome, who, note)
