"""What operators read, in memory: filtered pages of claims, one claim's detail, and the
review queue (the rules are :mod:`celery_pulse.store.views`, shared with SQL).

A page is a sort and a scan, as a SQL store without the index would do it: the memory
store holds a test's few claims, and its answers are what the SQL pages must equal.
"""

from __future__ import annotations

from celery_pulse.store.checkpoints import Checkpoint
from celery_pulse.store.memory.core import MemoryCore, claim_info
from celery_pulse.store.memory.tables import ClaimRow
from celery_pulse.store.pages import AuditRow, ClaimDetail, ClaimPage, ClaimQuery, EvidenceRow
from celery_pulse.store.records import NEEDS_REVIEW, ReviewItem
from celery_pulse.store.views import (
    REVIEWABLE_STATES,
    args_summary,
    check_query,
    encode_cursor,
    review_reason,
)


def _matches(row: ClaimRow, query: ClaimQuery) -> bool:
    return ((not query.states or row.state in query.states)
            and (query.queue is None or row.queue == query.queue)
            and (query.task_name is None or row.task_name == query.task_name)
            and (query.worker is None or row.holder == query.worker))


class MemoryViews(MemoryCore):
    """The operators' reads of the contract on the memory store's tables."""

    def find_claims(self, query: ClaimQuery) -> ClaimPage:
        after = check_query(query)
        with self._lock:
            now = self._enter()
            rows = [row for row in self.tables.claims.values() if _matches(row, query)]
        rows.sort(key=lambda row: (row.created_at, row.task_id), reverse=True)
        total = len(rows)
        if after is not None:
            rows = [row for row in rows if (row.created_at, row.task_id) < after]
        page = rows[:query.limit]
        more = len(rows) > query.limit
        cursor = encode_cursor(page[-1].created_at, page[-1].task_id) if more else None
        return ClaimPage([claim_info(row, now) for row in page], cursor, total, now)

    def claim_detail(self, task_id: str) -> ClaimDetail | None:
        with self._lock:
            now = self._enter()
            row = self.tables.claims.get(task_id)
            if row is None:
                return None
            evidence = [EvidenceRow(e.epoch, e.holder, e.outcome, e.error, e.recorded_at,
                                    e.result)
                        for e in self.tables.evidence if e.task_id == task_id]
            reviews = [AuditRow(r.action, r.outcome, r.note, r.decided_by, r.decided_at)
                       for r in self.tables.reviews if r.task_id == task_id]
            checkpoint = None if row.checkpoint is None else Checkpoint.of(
                row.checkpoint, row.checkpoint_epoch or 0, row.checkpoint_at or 0.0)
            return ClaimDetail(claim_info(row, now), row.retries, args_summary(row.headers),
                               evidence, reviews, checkpoint)

    def oldest_review_since(self) -> float | None:
        with self._lock:
            self._enter()
            times = [row.finished_at for row in self.tables.claims.values()
                     if row.state == NEEDS_REVIEW and row.finished_at is not None]
            return min(times, default=None)

    def list_review(self, limit: int = 1000, query: ClaimQuery | None = None
                    ) -> list[ReviewItem]:
        query = query or ClaimQuery()
        check_query(query, REVIEWABLE_STATES)
        if not query.states:
            query = ClaimQuery((NEEDS_REVIEW,), query.queue, query.task_name, query.worker)
        with self._lock:
            self._enter()
            rows = sorted((row for row in self.tables.claims.values() if _matches(row, query)),
                          key=lambda row: (row.created_at, row.task_id))
            return [ReviewItem(r.task_id, r.task_name, r.holder, r.epoch, r.attempts,
                               args_summary(r.headers), r.reserved_at or r.created_at,
                               review_reason(r.outcome, r.error, r.holder, r.epoch,
                                             r.max_attempts), r.finished_at,
                               r.checkpoint_at,
                               None if r.checkpoint is None else len(r.checkpoint))
                    for r in rows[:limit]]
