"""Recover, requeue and the review workflow in memory (the contract is ``RecoverStore``).

Every takeover moves the claim under a new epoch, as in SQL, so whatever the previous
attempt still holds (its token, its permits) stops counting at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from celery_pulse.errors import InvalidConfig, Moved, NotFound
from celery_pulse.store.contracts import RecoverStore
from celery_pulse.store.memory.core import MemoryCore
from celery_pulse.store.memory.tables import ClaimRow, ReviewRow, new_token
from celery_pulse.store.records import (
    FAILED,
    LIVE_STATES,
    NEEDS_REVIEW,
    OPEN,
    RESERVED,
    RETRY,
    SUCCEEDED,
    LeaseKey,
    Message,
    Recovered,
)
from celery_pulse.store.views import moved_message

logger = logging.getLogger(__name__)


def recovered(row: ClaimRow, was: str, holder: str | None) -> Recovered:
    """The claim as taken over (its state already moved on from ``was``, from ``holder``)."""
    return Recovered(row.task_id, row.task_name, row.state, was, row.epoch, row.token,
                     row.attempts, Message(row.body, json.loads(row.headers),
                                           json.loads(row.properties),
                                           json.loads(row.delivery_info), row.content_type,
                                           row.content_encoding), holder)


class MemoryRecover(MemoryCore, RecoverStore):
    """``RecoverStore`` on the memory store's tables."""

    def recover(self, scanner: str, batch: int, publish_ttl: float) -> list[Recovered]:
        with self._lock:
            now = self._enter()
            due = [row for row in self.tables.claims.values()
                   if row.lease_until is not None and row.lease_until <= now
                   and (row.state in LIVE_STATES or row.state == OPEN)]
            due.sort(key=lambda row: row.lease_until or 0.0)
            groups: dict[str, list[ClaimRow]] = {OPEN: [], FAILED: [], NEEDS_REVIEW: []}
            for row in due[:batch]:
                if not (row.state in (RESERVED, OPEN) or row.policy == "redispatch"):
                    groups[NEEDS_REVIEW].append(row)
                elif row.attempts >= row.max_attempts:
                    groups[FAILED].append(row)
                else:
                    groups[OPEN].append(row)
            out: list[Recovered] = []
            for state, members in groups.items():
                for row in members:
                    was, holder = row.state, row.holder
                    self._take_over(row, state, scanner, now, publish_ttl)
                    try:
                        out.append(recovered(row, was, holder))
                    except (ValueError, TypeError) as exc:
                        # A corrupted row must not stall recovery of every other claim.
                        logger.error("pulse: claim %s is corrupted (%s): marked failed",
                                     row.task_id, exc)
                        row.state, row.outcome, row.finished_at = FAILED, "corrupted", now
                        row.lease_until = row.token = None
                        row.error = f"corrupted claim row: {exc}"[:500]
            return out

    @staticmethod
    def _take_over(row: ClaimRow, state: str, scanner: str, now: float, publish_ttl: float
                   ) -> None:
        row.state = state
        row.epoch += 1
        if state == OPEN:
            row.holder, row.token, row.lease_until = scanner, new_token(), now + publish_ttl
        elif state == FAILED:
            row.token = row.lease_until = None
            row.finished_at, row.outcome = now, "exhausted"
            row.error = "attempt budget exhausted (lease expired)"
        else:  # it enters review now (retention never purges needs_review)
            row.token = row.lease_until = None
            row.outcome, row.finished_at = "unknown", now
            row.error = "started, then its lease expired: outcome unknown"

    def requeue(self, holder: str, leases: Sequence[LeaseKey], publish_ttl: float
                ) -> list[Recovered]:
        with self._lock:
            now = self._enter()
            out: list[Recovered] = []
            for row in self._live(holder, leases, now):
                was = row.state
                row.state, row.token = OPEN, new_token()
                row.epoch += 1
                row.lease_until, row.started_at = now + publish_ttl, None
                row.outcome, row.error = RETRY, "requeued"
                out.append(recovered(row, was, holder))
            return out

    def mark_published(self, items: Sequence[LeaseKey]) -> int:
        with self._lock:
            self._enter()
            done: set[str] = set()
            for task_id, epoch, token in items:
                row = self.tables.claims.get(task_id)
                if row is not None and row.epoch == epoch and row.token == token \
                        and row.state == OPEN:
                    row.lease_until = row.holder = row.token = None
                    done.add(task_id)
            return len(done)

    # -- review ------------------------------------------------------------------------------
    def _audit(self, task_id: str, action: str, outcome: str | None, who: str,
               note: str | None, now: float) -> None:
        self.tables.reviews.append(ReviewRow(task_id, action, outcome, note, who, now))

    def _moved(self, task_id: str, row: ClaimRow) -> Moved:
        """The error for a decision on a claim that moved on: what it is now."""
        last = [r for r in self.tables.reviews if r.task_id == task_id]
        return Moved(moved_message(task_id, row.state, row.epoch, None if not last else (
            last[-1].action, last[-1].outcome, last[-1].decided_by, last[-1].decided_at)))

    def review_retry(self, task_id: str, scanner: str, publish_ttl: float, who: str,
                     note: str | None, expected_epoch: int | None = None) -> Recovered:
        with self._lock:
            now = self._enter()
            row = self.tables.claims.get(task_id)
            if row is None:
                raise NotFound(f"no needs-review or failed task {task_id}")
            if row.state not in (NEEDS_REVIEW, FAILED) or (
                    expected_epoch is not None and row.epoch != expected_epoch):
                raise self._moved(task_id, row)
            was, last_holder = row.state, row.holder
            row.state, row.holder, row.token = OPEN, scanner, new_token()
            row.epoch += 1
            row.lease_until = now + publish_ttl
            row.max_attempts = max(row.max_attempts, row.attempts + 1)
            row.finished_at = row.outcome = row.error = None
            self._audit(task_id, "retry", None, who, note, now)
            return recovered(row, was, last_holder)

    def review_resolve(self, task_id: str, outcome: str, who: str, note: str | None,
                       expected_epoch: int | None = None) -> None:
        if outcome not in (SUCCEEDED, FAILED):
            raise InvalidConfig(f"--outcome must be succeeded or failed, got {outcome!r}")
        with self._lock:
            now = self._enter()
            row = self.tables.claims.get(task_id)
            if row is None:
                raise NotFound(f"no needs-review task {task_id}")
            if row.state != NEEDS_REVIEW or (
                    expected_epoch is not None and row.epoch != expected_epoch):
                raise self._moved(task_id, row)
            row.state = row.outcome = outcome
            row.finished_at = now
            row.error = f"resolved by {who}" + (f": {note}" if note else "")
            self._audit(task_id, "resolve", outcome, who, note, now)
