"""An in-memory :class:`~celery_pulse.store.contracts.Store` for fast tests of the mechanism.

It implements every part of the contract (registry, claims with permits and fenced
results, recover and review, leader and beat, gateway credentials) by the rules the
contract states, and the contract suite (``tests/contract``) runs on it as on every SQL
store. Its ``clock`` is the store clock: a test passes one it moves by hand. Its tables
(:attr:`MemoryStore.tables`) mirror the SQL tables, for a test to read.

The parts, one module each: :mod:`.registry`, :mod:`.claims` (with :mod:`.permits` and
:mod:`.results`), :mod:`.recover`, :mod:`.leader`, :mod:`.monitor` (operators' reads);
what they share is :mod:`.core` and :mod:`.tables`. No Celery, no SQL.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from celery_pulse.store.contracts import Store
from celery_pulse.store.gateway_state import MemoryGatewayState
from celery_pulse.store.memory.checkpoints import MemoryCheckpoints
from celery_pulse.store.memory.claims import MemoryClaims
from celery_pulse.store.memory.credentials import MemoryCredentials
from celery_pulse.store.memory.leader import MemoryLeader
from celery_pulse.store.memory.monitor import MemoryViews
from celery_pulse.store.memory.recover import MemoryRecover
from celery_pulse.store.memory.registry import MemoryRegistry
from celery_pulse.store.records import LIVE_STATES

__all__ = ["MemoryStore"]


class MemoryStore(MemoryViews, MemoryRegistry, MemoryClaims, MemoryRecover, MemoryLeader,
                  MemoryCheckpoints, Store):
    """Dictionary-backed store; ``clock`` is the store clock (default: ``time.time``)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)

    @functools.cached_property
    def credentials(self) -> MemoryCredentials:
        """The lease gateway's credentials, on the store clock."""
        return MemoryCredentials(clock=self.clock)

    @functools.cached_property
    def gateway_state(self) -> MemoryGatewayState:
        """The lease gateway's sessions and attempts, on the store clock."""
        return MemoryGatewayState(clock=self.clock, live=self._held_state)

    def _held_state(self, task_id: str, epoch: int, holder: str | None) -> str | None:
        """The state of a claim ``holder`` (None: anyone) still holds under ``epoch``, by
        the store clock."""
        with self._lock:
            row = self.tables.claims.get(task_id)
            now = self.clock()
            if (row is None or (holder is not None and row.holder != holder) or row.epoch != epoch
                    or row.state not in LIVE_STATES or row.lease_until is None
                    or row.lease_until <= now):
                return None
            return row.state
