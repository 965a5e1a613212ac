"""Worker membership in memory (the contract is ``RegistryStore``).

A registration is a row per worker id under a token minted at each register; a drain
request is kept apart from it, so it outlives the worker's restarts until undone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_pulse.errors import NotRegistered
from celery_pulse.store.contracts import RegistryStore
from celery_pulse.store.memory.core import MemoryCore
from celery_pulse.store.memory.tables import WorkerRow, new_token
from celery_pulse.store.records import Heartbeat, Registration, WorkerInfo


class MemoryRegistry(MemoryCore, RegistryStore):
    """``RegistryStore`` on the memory store's tables."""

    def now(self) -> float:
        return self._enter()

    def check_schema(self) -> None:
        self._enter()

    def register(self, worker_id: str, labels: Mapping[str, Any], ttl: float, *,
                 replace_live: bool = True) -> Registration:
        with self._lock:
            now = self._enter()
            old = self.tables.workers.get(worker_id)
            if old is not None and not replace_live and old.expires_at > now:
                raise NotRegistered(f"{worker_id}: another process registered this name",
                                    reason=NotRegistered.REPLACED)
            row = WorkerRow(new_token(), dict(labels), now, now, now + ttl,
                            draining=worker_id in self.tables.drains)
            self.tables.workers[worker_id] = row
            return Registration(worker_id, row.token, row.expires_at, row.draining)

    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        with self._lock:
            now = self._enter()
            row = self.tables.workers.get(worker_id)
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
            self._enter()
            row = self.tables.workers.get(worker_id)
            if row is None or row.token != token:
                return False
            del self.tables.workers[worker_id]
            return True

    def set_drain(self, worker_id: str, draining: bool, who: str) -> None:
        with self._lock:
            self._enter()
            if draining:
                self.tables.drains.add(worker_id)
            else:
                self.tables.drains.discard(worker_id)
            row = self.tables.workers.get(worker_id)
            if row is not None:
                row.draining = draining

    def list_workers(self) -> list[WorkerInfo]:
        with self._lock:
            now = self._enter()
            return [WorkerInfo(wid, dict(r.labels), r.registered_at, r.last_heartbeat,
                               r.expires_at, r.expires_at > now, r.expires_at - now, r.draining)
                    for wid, r in sorted(self.tables.workers.items())]
