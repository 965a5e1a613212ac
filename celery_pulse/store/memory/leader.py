"""Leader election and beat's exactly-once slots in memory (``LeaderStore``, ``BeatStore``).

A term is a row per key: a new term gets a fresh token and ``epoch + 1``; a renewal
(the current token) keeps both. A slot is recorded only while its term is live by the
store clock, and once per ``(entry, due_at)`` whatever term asks.
"""

from __future__ import annotations

import dataclasses

from celery_pulse.store.leader_contracts import BeatStore, LeaderStore
from celery_pulse.store.memory.core import MemoryCore
from celery_pulse.store.memory.tables import LeaderRow, SlotRow, new_token
from celery_pulse.store.records import LeaderGrant, LeaderInfo, ScheduleRow, Slot


class MemoryLeader(MemoryCore, LeaderStore, BeatStore):
    """``LeaderStore`` and ``BeatStore`` on the memory store's tables."""

    # -- leader election ------------------------------------------------------------------
    def try_acquire(self, key: str, holder: str, ttl: float, token: str | None = None
                    ) -> LeaderGrant | None:
        with self._lock:
            now = self._enter()
            row = self.tables.leaders.get(key)
            if row is None:
                row = LeaderRow(holder, new_token(), 1, now + ttl, now)
                self.tables.leaders[key] = row
            elif token is not None and row.token == token:
                row.holder, row.lease_until = holder, now + ttl
            elif row.lease_until <= now:
                row.holder, row.token, row.lease_until, row.acquired_at = (
                    holder, new_token(), now + ttl, now)
                row.epoch += 1
            else:
                return None
            return LeaderGrant(key, row.holder, row.token, row.epoch, row.lease_until)

    def release_leader(self, key: str, token: str) -> bool:
        with self._lock:
            now = self._enter()
            row = self.tables.leaders.get(key)
            if row is None or row.token != token:
                return False
            row.lease_until = now
            return True

    def get_leader(self, key: str) -> LeaderInfo | None:
        with self._lock:
            now = self._enter()
            row = self.tables.leaders.get(key)
            if row is None:
                return None
            remaining = row.lease_until - now
            return LeaderInfo(key, row.holder, row.epoch, remaining > 0, remaining,
                              row.acquired_at)

    # -- beat ------------------------------------------------------------------------------
    def last_run(self) -> dict[str, float]:
        with self._lock:
            self._enter()
            return dict(self.tables.beat_state)

    def init_last_run(self, entry: str, at: float) -> float:
        with self._lock:
            self._enter()
            return self.tables.beat_state.setdefault(entry, at)

    def fire_slot(self, key: str, token: str, epoch: int, slot: Slot) -> bool:
        with self._lock:
            now = self._enter()
            term = self.tables.leaders.get(key)
            if term is None or term.token != token or term.epoch != epoch \
                    or term.lease_until <= now:
                return False
            at = (slot.entry, slot.due_at)
            inserted = at not in self.tables.slots
            if inserted:
                self.tables.slots[at] = SlotRow(slot.entry, slot.due_at, slot.task_id,
                                                slot.task, slot.payload, epoch, now)
            state = self.tables.beat_state
            state[slot.entry] = max(state.get(slot.entry, slot.due_at), slot.due_at)
            return inserted

    def mark_slot_published(self, entry: str, due_at: float) -> None:
        with self._lock:
            now = self._enter()
            row = self.tables.slots.get((entry, due_at))
            if row is not None:
                row.published_at = now

    def unpublished_slots(self, limit: int = 100) -> list[Slot]:
        with self._lock:
            self._enter()
            rows = sorted((r for r in self.tables.slots.values() if r.published_at is None),
                          key=lambda r: r.due_at)
            return [Slot(r.entry, r.due_at, r.task_id, r.task, r.payload) for r in rows[:limit]]

    def list_schedule(self) -> list[ScheduleRow]:
        with self._lock:
            self._enter()
            return [row for _, row in sorted(self.tables.schedule.items())]

    def put_schedule(self, row: ScheduleRow) -> None:
        with self._lock:
            now = self._enter()
            self.tables.schedule[row.name] = dataclasses.replace(row, updated_at=now)

    def remove_schedule(self, name: str) -> bool:
        with self._lock:
            self._enter()
            return self.tables.schedule.pop(name, None) is not None

    def set_schedule_enabled(self, name: str, enabled: bool) -> bool:
        with self._lock:
            now = self._enter()
            row = self.tables.schedule.get(name)
            if row is None:
                return False
            self.tables.schedule[name] = dataclasses.replace(row, enabled=enabled,
                                                             updated_at=now)
            return True
