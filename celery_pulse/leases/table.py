"""The local lease table: which leases this worker holds, and their transitions.

Every thread of the keeper reads and changes the table under its one lock: the event
loop adds claims and marks them handed to the pool, the committers mark them running,
the renewer and the watchdog lose them. A claim's local deadline is ``sent_at(last
successful grant or renewal) + ttl - margin`` on the monotonic clock; past it the claim
is lost even if the store cannot be reached (:meth:`ClaimTable.lose`).

The count of claims waiting for a pool process (:meth:`ClaimTable.unstarted`) is kept
on every transition: the intake asks for it several times per task.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from celery_pulse.errors import PulseError
from celery_pulse.leases.claims import (
    LOST,
    RESERVED,
    RUNNING,
    Counters,
    LeaseListener,
    LocalClaim,
    dropped_unwritten,
)
from celery_pulse.store.base import Grant, LeaseKey, Refusal

#: The lease mechanism's log lines keep the logger they always had.
logger = logging.getLogger("celery_pulse.leases")


class ClaimTable:
    """This worker's leases, by task id (the newest attempt of each task)."""

    def __init__(self, *, ttl: float, margin: float, grace: float, listener: LeaseListener,
                 monotonic: Callable[[], float]) -> None:
        self.ttl = ttl
        self.margin = margin
        self.grace = grace
        self.listener = listener
        self.monotonic = monotonic
        self.claims: dict[str, LocalClaim] = {}
        #: Lost claims still running in a pool process whose table entry a newer grant of
        #: the same task took: still hard-stopped when they ignore LeaseLost.
        self._displaced: dict[LeaseKey, LocalClaim] = {}
        self._unstarted = 0
        #: Grants answered to the adapter and not added yet: at shutdown, those the event
        #: loop never took are released (they never ran, even those granted as running).
        self._unsettled: dict[str, Grant] = {}
        self.counters = Counters()
        self._lock = threading.RLock()

    def add(self, grant: Grant, sent_at: float, retries: int, scheduled: bool,
            start_in_background: bool = False, publication: str | None = None,
            message: Any = None) -> LocalClaim:
        old = self.get(grant.task_id)
        if old is not None and old.state != LOST:
            # Past its deadline (the intake lets only such a one be granted again): a
            # stale attempt that may still run. Lost now, so its body gets LeaseLost (and
            # a hard stop after the grace), not left running unseen once it is replaced.
            self.lose(old, f"superseded: this worker was granted epoch {grant.epoch}")
        claim = LocalClaim(grant.task_id, grant.epoch, grant.token,
                           sent_at + self.ttl - self.margin, retries,
                           state=RUNNING if grant.started else RESERVED, scheduled=scheduled,
                           counted=not scheduled,
                           start_in_background=start_in_background,
                           publication=publication, message=message,
                           attempts=grant.attempts)
        with self._lock:
            if self._unsettled.get(grant.task_id) == grant:
                del self._unsettled[grant.task_id]
            old = self.claims.get(claim.task_id)
            if old is not None:
                self._uncount(old)
                if old.state == LOST and old.pid is not None:
                    self._displaced[old.key] = old  # still due its hard stop
            self.claims[claim.task_id] = claim
            if claim.counted:
                self._unstarted += 1
        return claim

    def note_grants(self, answers: Sequence[Grant | Refusal | PulseError]) -> None:
        """Reservations answered to the adapter: unsettled until :meth:`add` takes them."""
        with self._lock:
            self._unsettled.update((g.task_id, g) for g in answers if isinstance(g, Grant))

    def unsettled(self) -> list[LeaseKey]:
        """Grants answered and never added (the loop stopped before it could take them)."""
        with self._lock:
            return [(g.task_id, g.epoch, g.token) for g in self._unsettled.values()]

    def get(self, task_id: str) -> LocalClaim | None:
        with self._lock:
            return self.claims.get(task_id)

    def attempts(self, task_id: str) -> list[LocalClaim]:
        """Every attempt of ``task_id`` this worker still holds or runs (lost ones too)."""
        with self._lock:
            return [c for c in (*self.claims.values(), *self._displaced.values())
                    if c.task_id == task_id]

    def snapshot(self, *, displaced: bool = False) -> list[LocalClaim]:
        """The claims now in the table (and, with ``displaced``, the displaced ones)."""
        with self._lock:
            if displaced:
                return [*self.claims.values(), *self._displaced.values()]
            return list(self.claims.values())

    def held(self) -> list[LocalClaim]:
        """The claims whose lease is held (reserved or running): what a renewal extends."""
        with self._lock:
            return [c for c in self.claims.values() if c.state in (RESERVED, RUNNING)]

    def forget(self, claim: LocalClaim) -> None:
        with self._lock:
            self._uncount(claim)
            if self.claims.get(claim.task_id) is claim:
                del self.claims[claim.task_id]
            self._displaced.pop(claim.key, None)

    def mark_running(self, claim: LocalClaim, sent_at: float | None = None) -> bool:
        """The store moved the claim to ``running``; False if it was lost meanwhile.

        ``sent_at``: when the start was sent (its grant extends the local deadline).
        """
        with self._lock:
            if claim.state != RESERVED:
                return False
            claim.state = RUNNING
            if sent_at is not None:
                claim.deadline = max(claim.deadline, sent_at + self.ttl - self.margin)
            return True

    def run_unrecorded(self, claim: LocalClaim) -> bool:
        """Count a reserved claim as running before its start is recorded."""
        with self._lock:
            if claim.state != RESERVED:
                return False
            claim.state = RUNNING
            return True

    def handed(self, claim: LocalClaim) -> None:
        """The claim's job went to the pool: it no longer waits for a process."""
        with self._lock:
            self._uncount(claim)
            claim.in_pool = True

    def _uncount(self, claim: LocalClaim) -> None:
        if claim.counted:
            claim.counted = False
            self._unstarted -= 1

    def unstarted(self) -> int:
        """Claims waiting for a pool process (prefetch accounting; ETA ones excluded):
        reservations, and starts folded into them or made ahead of the pool.

        A counter kept on every transition: this runs several times per task.
        """
        return self._unstarted

    def is_live(self, claim: LocalClaim) -> bool:
        return claim.state != LOST and self.monotonic() < claim.deadline

    def never_ran(self) -> list[LocalClaim]:
        """Reservations, and starts whose job never reached the pool: none of them ran.

        A job handed to the pool is not among them, even one no process was seen to
        accept: at a warm shutdown the loop that reads the children's acknowledgements
        and results has stopped, so "not seen" is not "not run" (a CI run caught a job
        released as never run that had run, and then ran again). Its lease expires and
        Recover decides by the task's policy. The exception is a job the pool dropped
        before writing it to any process (``dropped_by_pool``): Celery flushes those at
        shutdown and on a reconnect, expecting the broker to deliver them again (a CI
        run caught one such job left to expire into review, never having run).
        """
        with self._lock:
            return [c for c in self.claims.values() if c.state == RESERVED
                    or (c.state == RUNNING and (not c.in_pool or dropped_unwritten(c)))]

    def in_pool_unaccepted(self) -> list[LocalClaim]:
        """Running claims handed to the pool that no process accepted (nor the pool dropped)."""
        with self._lock:
            return [c for c in self.claims.values()
                    if c.state == RUNNING and c.in_pool and c.pid is None
                    and not dropped_unwritten(c)]

    def give_up(self, claims: Sequence[LocalClaim], why: str) -> None:
        """Mark never-run claims lost without telling anyone (they are being released)."""
        now = self.monotonic()
        for claim in claims:
            with self._lock:
                self._uncount(claim)
                claim.state = LOST
            claim.lost_at = now
            claim.lost_reason = why

    def lose(self, claim: LocalClaim, reason: str) -> None:
        """The lease ended here (deadline passed, not renewed, given up): tell the listener."""
        with self._lock:  # the renewer and the watchdog may race here
            if claim.state == LOST:
                return
            if self.claims.get(claim.task_id) is not claim:
                # Completed (forgotten) after the renewer's snapshot: its lease ended with
                # the completion, and its pid may run another task by now.
                return
            was = claim.state
            self._uncount(claim)
            claim.state = LOST
            claim.lost_at = self.monotonic()
        claim.lost_reason = reason
        self.counters.lost += 1
        # A task running in a pool process gets LeaseLost, and its process logs the one
        # WARNING line about it (who held it, who holds it now): this one is the detail.
        level = logging.INFO if was == RUNNING and claim.pid is not None else logging.WARNING
        logger.log(level, "pulse: lease lost for task %s epoch %d (%s, was %s)",
                   claim.task_id, claim.epoch, reason, was)
        # A lost reservation stays in the table (state LOST) so the pool drops it
        # instead of running it when its turn comes.
        self.listener.on_lost(claim)
