"""A tiny in-memory LeaderStore + BeatStore for the unit tests (no database).

It follows the contract docstrings of :mod:`celery_pulse.store.base` literally,
with a fake clock as the store clock, and records every call so a test can see
what the mechanism asked for. ``down = True`` makes every call raise
:class:`StoreUnavailable`; ``latency`` moves the clock during ``try_acquire`` (the
answer arrives later than the request was sent).
"""

from __future__ import annotations

import dataclasses
import itertools

from celery_pulse.errors import StoreUnavailable
from celery_pulse.store.base import (
    BeatStore,
    LeaderGrant,
    LeaderInfo,
    LeaderStore,
    ScheduleRow,
    Slot,
)


class FakeClock:
    """A clock that only moves when told to (store clock, monotonic and wall clock)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclasses.dataclass
class Term:
    holder: str
    token: str
    epoch: int
    lease_until: float
    acquired_at: float


@dataclasses.dataclass
class SlotRow:
    slot: Slot
    leader_epoch: int
    published: bool = False


class FakeStore(LeaderStore, BeatStore):
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.down = False
        self.latency = 0.0
        self.terms: dict[str, Term] = {}
        self.slots: dict[tuple[str, float], SlotRow] = {}
        self.state: dict[str, float] = {}
        self.schedule: dict[str, ScheduleRow] = {}
        self.calls: list[str] = []
        self.releases: list[tuple[str, str]] = []
        self._tokens = itertools.count(1)

    def now(self) -> float:
        """The store clock (beat judges due slots by it)."""
        return self.clock.now

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if self.down:
            raise StoreUnavailable(f"store unavailable during {name}: fake outage")

    # -- LeaderStore ------------------------------------------------------------------
    def try_acquire(self, key: str, holder: str, ttl: float, token: str | None = None
                    ) -> LeaderGrant | None:
        self._enter("try_acquire")
        self.clock.advance(self.latency)
        now = self.clock()
        term = self.terms.get(key)
        if term is not None and token is not None and term.token == token:
            term.lease_until = now + ttl  # renewal: same token and epoch
        elif term is None or term.lease_until <= now:
            epoch = 1 if term is None else term.epoch + 1
            term = Term(holder, f"tok{next(self._tokens):04d}", epoch, now + ttl, now)
            self.terms[key] = term
        else:
            return None
        return LeaderGrant(key, term.holder, term.token, term.epoch, term.lease_until)

    def release_leader(self, key: str, token: str) -> bool:
        self._enter("release_leader")
        self.releases.append((key, token))
        term = self.terms.get(key)
        if term is None or term.token != token:
            return False
        term.lease_until = self.clock()
        return True

    def get_leader(self, key: str) -> LeaderInfo | None:
        self._enter("get_leader")
        term = self.terms.get(key)
        if term is None:
            return None
        remaining = term.lease_until - self.clock()
        return LeaderInfo(key, term.holder, term.epoch, remaining > 0, remaining,
                          term.acquired_at)

    # -- BeatStore --------------------------------------------------------------------
    def last_run(self) -> dict[str, float]:
        self._enter("last_run")
        return dict(self.state)

    def init_last_run(self, entry: str, at: float) -> float:
        self._enter("init_last_run")
        return self.state.setdefault(entry, at)

    def fire_slot(self, key: str, token: str, epoch: int, slot: Slot) -> bool:
        self._enter("fire_slot")
        term = self.terms.get(key)
        if term is None or term.token != token or term.epoch != epoch \
                or term.lease_until <= self.clock():
            return False
        self.state[slot.entry] = max(self.state.get(slot.entry, slot.due_at), slot.due_at)
        if (slot.entry, slot.due_at) in self.slots:
            return False
        self.slots[(slot.entry, slot.due_at)] = SlotRow(slot, epoch)
        return True

    def mark_slot_published(self, entry: str, due_at: float) -> None:
        self._enter("mark_slot_published")
        self.slots[(entry, due_at)].published = True

    def unpublished_slots(self, limit: int = 100) -> list[Slot]:
        self._enter("unpublished_slots")
        rows = sorted((r for r in self.slots.values() if not r.published),
                      key=lambda r: r.slot.due_at)
        return [r.slot for r in rows[:limit]]

    def list_schedule(self) -> list[ScheduleRow]:
        self._enter("list_schedule")
        return [self.schedule[name] for name in sorted(self.schedule)]

    def put_schedule(self, row: ScheduleRow) -> None:
        self._enter("put_schedule")
        self.schedule[row.name] = dataclasses.replace(row, updated_at=self.clock())

    def remove_schedule(self, name: str) -> bool:
        self._enter("remove_schedule")
        return self.schedule.pop(name, None) is not None

    def set_schedule_enabled(self, name: str, enabled: bool) -> bool:
        self._enter("set_schedule_enabled")
        row = self.schedule.get(name)
        if row is None:
            return False
        self.schedule[name] = dataclasses.replace(row, enabled=enabled, updated_at=self.clock())
        return True
