"""What operators read, in SQL: filtered pages of claims, one claim's detail, and the
oldest review item's time (the rules are :mod:`celery_pulse.store.views`).

Every filter of a page has its own index ending in ``(created_at, task_id)``
(:data:`~.tables.VIEW_INDEXES`), the page's order: a page is a backward range scan of one
index that stops after ``limit + 1`` rows (then its rows by primary key), and the cursor
is a seek into it, written
``created_at <= c AND (created_at < c OR task_id < t)`` (the range on ``created_at`` is
what every database's planner turns into an index bound; row-value comparisons are not,
on MariaDB). The total is a count over the same index.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_pulse.store.checkpoints import Checkpoint
from celery_pulse.store.pages import AuditRow, ClaimDetail, ClaimPage, ClaimQuery, EvidenceRow
from celery_pulse.store.records import NEEDS_REVIEW
from celery_pulse.store.sql.claims_admin import claim_info, info_columns
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.reviews import filtered
from celery_pulse.store.sql.tables import claims, evidence, reviews
from celery_pulse.store.views import args_summary, check_query, encode_cursor


def page_statement(conns: Connections, query: ClaimQuery, after: tuple[float, str] | None
                   ) -> Any:
    """The SELECT of one page of ``query`` (``limit + 1`` rows: the extra says more follow).

    The page's task ids come from the filter's index alone, then their rows by primary
    key (a deferred join): MariaDB otherwise walks the index *and the rows* from the
    filter's newest claim down to the cursor (90 ms half-way down 100,000 claims, 1 ms
    this way); PostgreSQL and SQLite take both forms alike.
    """
    ids = filtered(sa.select(claims.c.task_id), query)
    if after is not None:
        created_at, task_id = after
        ids = ids.where(claims.c.created_at <= created_at,
                        sa.or_(claims.c.created_at < created_at, claims.c.task_id < task_id))
    page = (ids.order_by(claims.c.created_at.desc(), claims.c.task_id.desc())
            .limit(query.limit + 1).subquery("page"))
    return (sa.select(*info_columns(conns))
            .select_from(claims.join(page, claims.c.task_id == page.c.task_id))
            .order_by(claims.c.created_at.desc(), claims.c.task_id.desc()))


def count_statement(query: ClaimQuery) -> Any:
    """The SELECT of the number of claims ``query`` matches, on every page."""
    return filtered(sa.select(sa.func.count()).select_from(claims), query)


class SqlViews:
    """The operators' reads of :class:`~.store.SqlStore`."""

    conns: Connections

    def find_claims(self, query: ClaimQuery) -> ClaimPage:
        after = check_query(query)
        with translated("find_claims"), self.conns.read() as conn:
            now = float(conn.execute(sa.select(self.conns.now)).scalar_one())
            rows = conn.execute(page_statement(self.conns, query, after)).all()
            total = int(conn.execute(count_statement(query)).scalar_one())
        page = rows[:query.limit]
        cursor = (encode_cursor(float(page[-1].created_at), page[-1].task_id)
                  if len(rows) > query.limit else None)
        return ClaimPage([claim_info(r) for r in page], cursor, total, now)

    def claim_detail(self, task_id: str) -> ClaimDetail | None:
        with translated("claim_detail"), self.conns.read() as conn:
            row = conn.execute(sa.select(*info_columns(self.conns), claims.c.retries,
                                         claims.c.headers, claims.c.checkpoint,
                                         claims.c.checkpoint_epoch)
                               .where(claims.c.task_id == task_id)).one_or_none()
            if row is None:
                return None
            stale = conn.execute(
                sa.select(evidence.c.epoch, evidence.c.holder, evidence.c.outcome,
                          evidence.c.error, evidence.c.recorded_at, evidence.c.result)
                .where(evidence.c.task_id == task_id).order_by(evidence.c.id)).all()
            audit = conn.execute(
                sa.select(reviews.c.action, reviews.c.outcome, reviews.c.note,
                          reviews.c.decided_by, reviews.c.decided_at)
                .where(reviews.c.task_id == task_id).order_by(reviews.c.id)).all()
        return ClaimDetail(
            claim_info(row), int(row.retries), args_summary(row.headers),
            [EvidenceRow(int(e.epoch), e.holder, e.outcome, e.error, float(e.recorded_at),
                         e.result)
             for e in stale],
            [AuditRow(a.action, a.outcome, a.note, a.decided_by, float(a.decided_at))
             for a in audit],
            None if row.checkpoint is None else Checkpoint.of(
                row.checkpoint, row.checkpoint_epoch, row.checkpoint_at or 0.0))

    def oldest_review_since(self) -> float | None:
        stmt = sa.select(sa.func.min(claims.c.finished_at)).where(claims.c.state == NEEDS_REVIEW)
        with translated("oldest_review_since"), self.conns.read() as conn:
            since = conn.execute(stmt).scalar_one()
        return None if since is None else float(since)
