"""What every part of the memory store shares: its tables, its lock and its clock.

One re-entrant lock serialises every call, so each call is atomic as the SQL store's
statements are; the clock is the store clock (a test passes one it moves by hand), read
once per call, as a statement reads ``now`` once. ``down = True`` makes every call raise
:class:`~celery_pulse.errors.StoreUnavailable`, as a store that went away.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from celery_pulse.errors import StoreUnavailable
from celery_pulse.store.memory.tables import ClaimRow, Tables
from celery_pulse.store.records import LIVE_STATES, ClaimInfo, LeaseKey


def claim_info(r: ClaimRow, now: float) -> ClaimInfo:
    """A claim row as the contract shows it, by the store clock ``now``."""
    return ClaimInfo(r.task_id, r.task_name, r.state, r.holder, r.epoch, r.attempts,
                     r.max_attempts, r.policy,
                     None if r.lease_until is None else r.lease_until - now,
                     r.created_at, r.started_at, r.finished_at, r.outcome, r.error, r.queue,
                     r.checkpoint_at, None if r.checkpoint is None else len(r.checkpoint))


class MemoryCore:
    """The state of one memory store; the contract parts are mixins over it."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.tables = Tables()
        #: Set to True to simulate an outage: every call raises StoreUnavailable.
        self.down = False
        self._lock = threading.RLock()

    def _enter(self) -> float:
        """The store clock now, for the call about to run (under the lock)."""
        if self.down:
            raise StoreUnavailable("memory store is down")
        return self.clock()

    def _held(self, holder: str, leases: Sequence[LeaseKey], states: Sequence[str]
              ) -> list[ClaimRow]:
        """The claims ``leases`` name, each once, whose (epoch, token) are current,
        ``holder`` holds and whose state is one of ``states``."""
        out: dict[str, ClaimRow] = {}
        for task_id, epoch, token in leases:
            row = self.tables.claims.get(task_id)
            if (row is not None and row.holder == holder and row.epoch == epoch
                    and row.token == token and row.state in states):
                out[task_id] = row
        return list(out.values())

    def _live(self, holder: str, leases: Sequence[LeaseKey], now: float,
              states: Sequence[str] = LIVE_STATES) -> list[ClaimRow]:
        """:meth:`_held`, and the lease not expired by the store clock."""
        return [row for row in self._held(holder, leases, states)
                if row.lease_until is not None and row.lease_until > now]
