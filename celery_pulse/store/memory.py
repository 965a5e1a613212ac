"""An in-memory :class:`Store` for fast unit tests of the mechanism.

It follows the same contract as the SQL store (the contract suite runs on both),
with the "store clock" supplied by the caller so tests can move time by hand.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery_pulse.errors import NotRegistered, StoreUnavailable
from celery_pulse.store.base import Heartbeat, Registration, RegistryStore, WorkerInfo


@dataclasses.dataclass(slots=True)
class _Worker:
    token: str
    labels: dict[str, Any]
    registered_at: float
    last_heartbeat: float
    expires_at: float
    draining: bool = False


class MemoryStore(RegistryStore):
    """Dictionary-backed store; ``clock`` is the store clock (default: ``time.time``)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._drains: set[str] = set()
        #: Set to True to simulate an outage: every call raises StoreUnavailable.
        self.down = False

    def _check(self) -> float:
        if self.down:
            raise StoreUnavailable("memory store is down")
        return self._clock()

    def now(self) -> float:
        return self._check()

    def check_schema(self) -> None:
        self._check()

    def register(self, worker_id: str, labels: Mapping[str, Any], ttl: float, *,
                 replace_live: bool = True) -> Registration:
        with self._lock:
            now = self._check()
            old = self._workers.get(worker_id)
            if old is not None and not replace_live and old.expires_at > now:
                raise NotRegistered(f"{worker_id}: another process registered this name",
                                    reason=NotRegistered.REPLACED)
            row = _Worker(secrets.token_hex(16), dict(labels), now, now, now + ttl,
                          draining=worker_id in self._drains)
            self._workers[worker_id] = row
            return Registration(worker_id, row.token, row.expires_at, row.draining)

    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        with self._lock:
            now = self._check()
            row = self._workers.get(worker_id)
            if row is None:
                raise NotRegistered(f"{worker_id}: not registered", reason=NotRegistered.MISSING)
            alive = row.expires_at > now
            if row.token != token:
                reason = NotRegistered.REPLACED if alive else NotRegistered.EXPIRED
                raise NotRegistered(f"{worker_id}: registration {reason}", reason=reason)
            if not alive:
                raise NotRegistered(f"{worker_id}: registration expired",
                                    reason=NotRegistered.EXPIRED)
            row.expires_at = now + ttl
            row.last_heartbeat = now
            return Heartbeat(row.expires_at, row.draining)

    def deregister(self, worker_id: str, token: str) -> bool:
        with self._lock:
            self._check()
            row = self._workers.get(worker_id)
            if row is None or row.token != token:
                return False
            del self._workers[worker_id]
            return True

    def set_drain(self, worker_id: str, draining: bool, who: str) -> None:
        with self._lock:
            self._check()
            if draining:
                self._drains.add(worker_id)
            else:
                self._drains.discard(worker_id)
            row = self._workers.get(worker_id)
            if row is not None:
                row.draining = draining

    def list_workers(self) -> list[WorkerInfo]:
        with self._lock:
            now = self._check()
            return [WorkerInfo(wid, dict(r.labels), r.registered_at, r.last_heartbeat,
                               r.expires_at, r.expires_at > now, r.expires_at - now, r.draining)
                    for wid, r in sorted(self._workers.items())]
