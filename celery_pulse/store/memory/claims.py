"""Task claims in memory: reservations, starts (with permits), renewals, completions,
releases, retention and the claim listings (the contract is ``ClaimStore``).

Each call runs under the store's lock, against one reading of the store clock: what a
SQL statement decides in its ``WHERE`` clause is decided here by the same rules
(:mod:`celery_pulse.store.rules`), one request after the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from celery_pulse.store.contracts import ClaimStore
from celery_pulse.store.memory import permits as memory_permits
from celery_pulse.store.memory import results as memory_results
from celery_pulse.store.memory.core import MemoryCore, claim_info
from celery_pulse.store.memory.tables import ClaimRow, EvidenceRow, dumps, new_token
from celery_pulse.store.records import (
    FAILED,
    FINISHED_STATES,
    LIVE_STATES,
    OPEN,
    RESERVED,
    RUNNING,
    TERMINAL_STATES,
    ClaimInfo,
    Completion,
    Exchanged,
    Grant,
    LeaseKey,
    Permit,
    PermitUsage,
    Refusal,
    ReserveRequest,
    Waiting,
)
from celery_pulse.store.retention import Batch, drain
from celery_pulse.store.rules import (
    ANSWER_RANK,
    OUTCOME_STATE,
    claimable,
    grantable,
    new_publication,
    queue_of,
    restarts,
    rounds,
    split_by_permits,
)


def _expired(row: ClaimRow, now: float) -> bool:
    return row.lease_until is not None and row.lease_until <= now


class MemoryClaims(MemoryCore, ClaimStore):
    """``ClaimStore`` on the memory store's tables."""

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged:
        """The three calls in order, under one hold of the lock (one transaction)."""
        with self._lock:
            self._enter()
            return super().exchange(holder, ttl, completions, reserves, starts, permits)

    # -- reserve ------------------------------------------------------------------------
    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]:
        with self._lock:
            now = self._enter()
            # One after the other: a later copy of a task id sees what the earlier left.
            return [self._reserve_one(holder, r, ttl, now) for r in requests]

    def _reserve_one(self, holder: str, r: ReserveRequest, ttl: float, now: float
                     ) -> Grant | Refusal:
        state = RUNNING if r.starts_now else RESERVED
        row = self.tables.claims.get(r.task_id)
        if row is None:
            row = ClaimRow(r.task_id, r.task_name, state, holder, new_token(), 1, now + ttl, 1,
                           r.max_attempts, r.policy, r.retries, bytes(r.message.body),
                           dumps(r.message.headers), dumps(r.message.properties),
                           dumps(r.message.delivery_info), r.message.content_type,
                           r.message.content_encoding, r.publication, now, now,
                           started_at=now if r.starts_now else None, queue=queue_of(r.message))
            self.tables.claims[r.task_id] = row
            return self._grant(row)
        expired = _expired(row, now)
        new_pub = new_publication(r.publication, row.publication)
        if grantable(row.state, row.policy, expired, row.attempts, row.max_attempts, new_pub):
            if restarts(row.state, new_pub):
                row.checkpoint = row.checkpoint_epoch = row.checkpoint_seq = None
                row.checkpoint_at = None
            row.state, row.holder, row.token = state, holder, new_token()
            row.epoch += 1
            row.lease_until = now + ttl
            row.attempts = 1 if new_pub else row.attempts + 1
            row.policy, row.retries, row.task_name = r.policy, r.retries, r.task_name
            row.body = bytes(r.message.body)
            row.headers = dumps(r.message.headers)
            row.properties = dumps(r.message.properties)
            row.delivery_info = dumps(r.message.delivery_info)
            row.content_type = r.message.content_type
            row.content_encoding = r.message.content_encoding
            row.reserved_at, row.publication = now, r.publication
            row.queue = queue_of(r.message)
            row.started_at = now if r.starts_now else None
            row.finished_at = row.outcome = row.error = None
            return self._grant(row)
        if row.state in TERMINAL_STATES:
            reason = "terminal"
        elif claimable(row.state, row.policy, expired) and row.attempts >= row.max_attempts \
                and not new_pub:
            reason = "exhausted"
        else:
            reason = "taken"
        refusal = Refusal(r.task_id, reason, row.state, row.holder, row.epoch, row.retries,
                          row.publication)
        if reason == "exhausted":  # from now on the claim is simply finished
            row.state, row.outcome, row.finished_at = FAILED, "exhausted", now
            row.lease_until = row.token = None
            row.error = (f"attempt budget exhausted ({row.attempts} of {row.max_attempts} "
                         f"reservations used)")
        return refusal

    @staticmethod
    def _grant(row: ClaimRow) -> Grant:
        assert row.token is not None and row.lease_until is not None
        return Grant(row.task_id, row.epoch, row.token, row.lease_until, row.attempts,
                     row.state == RUNNING)

    # -- start, renew ---------------------------------------------------------------------
    def start_many(self, holder: str, leases: Sequence[LeaseKey], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]:
        with self._lock:
            now = self._enter()
            limited, plain = split_by_permits(permits, list(dict.fromkeys(
                (lease[0], lease[1], lease[2]) for lease in leases)))
            started: dict[str, float] = {}
            if limited:
                moved, wait = memory_permits.start(self.tables, now, holder, limited, ttl,
                                                   permits or {})
                started.update(moved)
                if isinstance(waiting, Waiting):
                    waiting.add_from(wait)
                elif waiting is not None:
                    waiting.update(wait)
            for row in self._live(holder, plain, now, (RESERVED,)):
                row.state, row.started_at, row.lease_until = RUNNING, now, now + ttl
                started[row.task_id] = row.lease_until
            return started

    def permit_usage(self) -> list[PermitUsage]:
        with self._lock:
            return memory_permits.usage(self.tables, self._enter())

    def renew(self, holder: str, leases: Sequence[LeaseKey], ttl: float
              ) -> tuple[set[str], set[str]]:
        """No row locks here: nothing is ever ``busy``."""
        with self._lock:
            now = self._enter()
            rows = self._live(holder, leases, now)
            for row in rows:
                row.lease_until = now + ttl
            return {row.task_id for row in rows}, set()

    def lease_of(self, holder: str, task_id: str, epoch: int, token: str
                 ) -> tuple[str, float] | None:
        with self._lock:
            rows = self._live(holder, [(task_id, epoch, token)], self._enter())
            return None if not rows or rows[0].lease_until is None else (
                rows[0].state, rows[0].lease_until)

    # -- complete, release ------------------------------------------------------------------
    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        """Two completions of one task id are applied in turn (see the SQL store's)."""
        with self._lock:
            now = self._enter()
            out: dict[str, str] = {}
            for batch in rounds(completions, lambda c: c.task_id):
                answers: dict[str, str] = {}
                applied: list[Completion] = []
                for c in batch:
                    row = self.tables.claims.get(c.task_id)
                    if (row is not None and row.epoch == c.epoch and row.token == c.token
                            and row.state in LIVE_STATES):
                        row.state, row.outcome, row.error = OUTCOME_STATE[c.outcome], \
                            c.outcome, c.error
                        row.token = row.lease_until = None
                        row.finished_at = None if row.state == OPEN else now
                        answers[c.task_id] = "applied"
                        applied.append(c)
                    else:
                        answers[c.task_id] = self._stale(holder, c, row, now)
                records = [(c.task_id, c.result) for c in applied if c.result is not None]
                memory_results.write_fenced(self.tables, now, [r for _, r in records])
                counts = memory_results.count_parts(self.tables, now, records)
                if counted is not None:
                    counted.update(counts)
                for task_id, answer in answers.items():
                    if ANSWER_RANK[answer] > ANSWER_RANK.get(out.get(task_id, ""), -1):
                        out[task_id] = answer
            return out

    def _stale(self, holder: str, c: Completion, row: ClaimRow | None, now: float) -> str:
        if row is not None and row.epoch == c.epoch and row.state == OUTCOME_STATE[c.outcome]:
            return "duplicate"
        self.tables.evidence.append(EvidenceRow(c.task_id, c.epoch, holder, c.outcome,
                                                c.error, now, c.returned))
        return "evidence"

    def release(self, holder: str, leases: Sequence[LeaseKey], *,
                never_ran: bool = False) -> int:
        with self._lock:
            now = self._enter()
            rows = self._held(holder, leases, LIVE_STATES if never_ran else (RESERVED,))
            for row in rows:
                row.lease_until, row.state, row.started_at = now, RESERVED, None
            return len(rows)

    # -- retention and listings -----------------------------------------------------------------
    def purge_finished(self, older_than: float, limit: int = 500,
                       budget: float | None = None) -> int:
        return drain(lambda: self._purge_batch(older_than, limit), budget)

    def _purge_batch(self, older_than: float, limit: int) -> Batch:
        with self._lock:
            now = self._enter()
            tables = self.tables
            old = [task_id for task_id, row in tables.claims.items()
                   if row.state in FINISHED_STATES and row.finished_at is not None
                   and row.finished_at < now - older_than][:limit]
            for task_id in old:
                del tables.claims[task_id]
            stale = [e for e in tables.evidence if e.recorded_at < now - older_than][:limit]
            tables.evidence = [e for e in tables.evidence if e not in stale]
            counts = (len(old), len(stale), memory_permits.purge(tables, now, older_than, limit),
                      memory_results.purge_expired(tables, now, limit))
            return len(old), max(counts) >= limit

    def retention_lag(self, older_than: float) -> float:
        with self._lock:
            now = self._enter()
            times = [row.finished_at for row in self.tables.claims.values()
                     if row.state in FINISHED_STATES and row.finished_at is not None]
            return max(0.0, now - older_than - min(times, default=now))

    def list_claims(self, states: Sequence[str] | None = None, limit: int = 1000
                    ) -> list[ClaimInfo]:
        with self._lock:
            now = self._enter()
            rows = [row for row in reversed(self.tables.claims.values())
                    if not states or row.state in states]
            rows.sort(key=lambda row: row.created_at, reverse=True)
            return [claim_info(r, now) for r in rows[:limit]]

    def claim_counts(self) -> dict[str, int]:
        with self._lock:
            now = self._enter()
            counts: dict[str, int] = {}
            for row in self.tables.claims.values():
                counts[row.state] = counts.get(row.state, 0) + 1
            counts["expired"] = sum(1 for row in self.tables.claims.values()
                                    if row.state in LIVE_STATES and _expired(row, now))
            return counts
