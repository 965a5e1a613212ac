"""Beat driven by hand: a fake clock, the memory store, ``tick()`` called by the test.

One fake clock is the store clock, the electors' monotonic clock and beat's wall
clock. Entries are plain :class:`Entry` objects (every ``PERIOD`` seconds); the
publish function records what it was asked to send, or raises on demand.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone

import pytest
from celery import Celery, schedules

from celery_pulse.beat import Beat, Entry, slot_task_id
from celery_pulse.bootsteps.schedules import next_due_function
from celery_pulse.leader import LeaderElector
from celery_pulse.store.base import LeaderGrant, Slot
from celery_pulse.store.memory import MemoryStore
from celery_pulse.store.memory.tables import SlotRow
from celery_pulse.testing import wait_for
from tests.helpers.clock import FakeClock
from tests.helpers.recording import Recorded

KEY = "beat"
TTL = 30.0
INTERVAL = 10.0
MARGIN = 2.0
PERIOD = 10.0


def every(period: float) -> Entry:
    return Entry("e", "proj.tick", '{"args": [], "kwargs": {}, "options": {}}',
                 lambda after: round(after + period, 3))


class Publisher:
    def __init__(self) -> None:
        self.sent: list[Slot] = []
        self.fail = 0

    def __call__(self, slot: Slot) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("broker down")
        self.sent.append(slot)

    def due(self) -> list[float]:
        return [s.due_at for s in self.sent]


class Node:
    """One process: an elector and its beat, sharing the store and the clock."""

    def __init__(self, store: Recorded, clock: FakeClock, holder: str, *,
                 entries: list[Entry] | None = None, catchup: str = "latest",
                 max_sleep: float = 1.0) -> None:
        self.publisher = Publisher()
        self.elector = LeaderElector(store, KEY, holder, ttl=TTL, interval=INTERVAL,
                                     margin=MARGIN, monotonic=clock, on_gained=self._gained)
        self.beat = Beat(store, self.elector, entries=lambda: entries or [every(PERIOD)],
                         publish=self.publisher, catchup=catchup, now=clock,
                         max_sleep=max_sleep)

    def _gained(self, grant: LeaderGrant) -> None:
        self.beat.on_gained(grant)

    def step(self) -> None:
        self.elector.tick()
        self.beat.tick()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000_000.0)


@pytest.fixture
def store(clock: FakeClock) -> Recorded:
    """The memory store on the fake clock, its calls recorded."""
    return Recorded(MemoryStore(clock), clock)


def as_slot(row: SlotRow) -> Slot:
    """The slot a recorded row holds (what a leader publishes)."""
    return Slot(row.entry, row.due_at, row.task_id, row.task, row.payload)


def test_new_entry_first_fires_one_period_after_it_was_seen(store: Recorded,
                                                           clock: FakeClock) -> None:
    a = Node(store, clock, "a")
    t0 = clock()
    a.step()
    assert a.publisher.sent == [] and store.tables.beat_state == {"e": t0}
    clock.advance(PERIOD - 0.01)
    a.step()
    assert a.publisher.sent == []
    clock.advance(0.01)
    a.step()
    assert a.publisher.due() == [t0 + PERIOD]


def test_each_due_slot_fires_once(store: Recorded, clock: FakeClock) -> None:
    a = Node(store, clock, "a")
    t0 = clock()
    a.step()
    for _ in range(30):  # ticks every 1 s for 30 s
        clock.advance(1.0)
        a.step()
        a.beat.tick()  # an extra tick at the same instant fires nothing more
    assert a.publisher.due() == [t0 + 10, t0 + 20, t0 + 30]
    assert len({s.task_id for s in a.publisher.sent}) == 3
    assert all(row.published_at is not None for row in store.tables.slots.values())
    assert a.beat.fired == 3


def test_catchup_latest_fires_only_the_most_recent_missed_slot(store: Recorded,
                                                               clock: FakeClock) -> None:
    a = Node(store, clock, "a", catchup="latest")
    t0 = clock()
    a.step()
    clock.advance(3.5 * PERIOD)
    a.step()
    assert a.publisher.due() == [t0 + 30]
    assert store.tables.beat_state["e"] == t0 + 30
    clock.advance(PERIOD)
    a.step()
    assert a.publisher.due() == [t0 + 30, t0 + 40]


def test_catchup_all_fires_every_missed_slot_in_order(store: Recorded, clock: FakeClock) -> None:
    a = Node(store, clock, "a", catchup="all")
    t0 = clock()
    a.step()
    clock.advance(3.5 * PERIOD)
    a.step()
    assert a.publisher.due() == [t0 + 10, t0 + 20, t0 + 30]
    assert store.tables.beat_state["e"] == t0 + 30
    a.step()
    assert len(a.publisher.sent) == 3


def test_failover_continues_from_last_run_without_double_or_gap(store: Recorded,
                                                                clock: FakeClock) -> None:
    a = Node(store, clock, "a", catchup="all")
    b = Node(store, clock, "b", catchup="all")
    t0 = clock()
    a.step()
    b.step()
    for _ in range(25):
        clock.advance(1.0)
        a.step()
        b.step()
    assert a.publisher.due() == [t0 + 10, t0 + 20] and b.publisher.sent == []
    # a dies; b campaigns every second and takes over once a's lease ran out.
    for _ in range(40):
        clock.advance(1.0)
        b.step()
    assert b.elector.is_leader
    due = a.publisher.due() + b.publisher.due()
    assert due == [t0 + 10 * i for i in range(1, len(due) + 1)]
    assert len({s.task_id for s in a.publisher.sent + b.publisher.sent}) == len(due)


def test_no_fire_when_not_leader(store: Recorded, clock: FakeClock) -> None:
    a = Node(store, clock, "a")
    b = Node(store, clock, "b")
    # Never campaigned: beat does not even look at the schedule.
    clock.advance(100)
    b.beat.tick()
    assert store.calls == []
    a.step()
    b.step()
    for _ in range(5):
        clock.advance(PERIOD)
        a.elector.tick()  # a keeps renewing: b never leads
        b.step()
        b.beat.tick()
    assert b.publisher.sent == [] and not b.elector.is_leader
    assert "fire_slot" not in store.calls


def test_no_fire_after_local_deadline_even_with_a_grant(store: Recorded,
                                                        clock: FakeClock) -> None:
    a = Node(store, clock, "a")
    a.step()
    store.down = True  # renewals fail from now on
    clock.now = a.elector.deadline  # the grant is still held, the deadline has passed
    assert a.elector.grant is not None
    store.down = False
    calls = len(store.calls)
    assert a.beat.tick() == a.beat.max_sleep
    assert a.publisher.sent == [] and len(store.calls) == calls


def test_store_fence_refuses_a_leader_whose_term_is_over(store: Recorded,
                                                         clock: FakeClock) -> None:
    """Beat believes it leads (before its local deadline) but the store term moved on."""
    a = Node(store, clock, "a")
    t0 = clock()
    a.step()
    clock.advance(PERIOD)
    store.tables.leaders[KEY].token = "someone-else"  # e.g. clock trouble: the store gave it away
    assert a.elector.is_leader
    a.beat.tick()
    assert a.publisher.sent == [] and store.tables.slots == {}
    assert store.tables.beat_state["e"] == t0  # last_run not advanced by a refused slot


def test_unpublished_slot_is_republished_after_gaining_with_the_same_task_id(
        store: Recorded, clock: FakeClock) -> None:
    a = Node(store, clock, "a")
    b = Node(store, clock, "b")
    t0 = clock()
    a.step()
    b.step()
    clock.advance(PERIOD)
    a.publisher.fail = 1  # recorded, then a "dies" before the message went out
    a.elector.tick()
    a.beat.tick()
    assert a.publisher.sent == []
    (row,) = store.tables.slots.values()
    assert row.published_at is None and row.leader_epoch == 1
    # b takes over after a's lease ran out, and sends the orphaned slot first.
    clock.advance(TTL)
    b.step()
    assert b.elector.is_leader and b.elector.epoch == 2
    assert b.publisher.sent[0] == as_slot(row)
    assert b.publisher.sent[0].task_id == slot_task_id("e", t0 + PERIOD)
    assert row.published_at is not None
    # The slot itself is not recorded again; the next one is b's own.
    assert [s.due_at for s in b.publisher.sent] == [t0 + PERIOD, t0 + 4 * PERIOD]
    assert store.tables.slots[("e", t0 + 4 * PERIOD)].leader_epoch == 2


def test_failed_publish_is_retried_by_the_same_leader(store: Recorded, clock: FakeClock) -> None:
    a = Node(store, clock, "a")
    a.step()
    clock.advance(PERIOD)
    a.publisher.fail = 1
    a.step()
    assert a.publisher.sent == []
    a.step()
    (row,) = store.tables.slots.values()
    assert a.publisher.sent == [as_slot(row)] and row.published_at is not None


def test_slot_task_ids_are_deterministic() -> None:
    tid = slot_task_id("e", 1_000_010.0)
    assert tid == slot_task_id("e", 1_000_010.0)
    assert uuid.UUID(tid).version == 5
    assert tid != slot_task_id("e", 1_000_020.0)
    assert tid != slot_task_id("f", 1_000_010.0)


def test_two_leaders_compute_the_same_slot_and_task_id(clock: FakeClock) -> None:
    """From the same last_run_at, any leader records the same (entry, due_at, task id)."""
    sent: list[Slot] = []
    for holder in ("a", "b"):
        store = Recorded(MemoryStore(clock), clock)
        store.tables.beat_state["e"] = 1_000_000.0
        node = Node(store, clock, holder)
        clock.now = 1_000_000.0 + PERIOD + 0.5
        node.step()
        sent += node.publisher.sent
    assert len(sent) == 2 and sent[0] == sent[1]
    assert sent[0].task_id == slot_task_id("e", 1_000_000.0 + PERIOD)


def test_gaining_leadership_wakes_a_sleeping_beat_thread(store: Recorded,
                                                         clock: FakeClock) -> None:
    """Planned handover is one leader interval: beat must not oversleep after on_gained."""
    other = LeaderElector(store, KEY, "other", ttl=TTL, interval=INTERVAL, margin=MARGIN,
                          monotonic=clock)
    other.tick()
    a = Node(store, clock, "a", max_sleep=30.0)  # real seconds for the thread's waits
    ticks: list[float] = []
    ticked = threading.Event()
    tick = a.beat.tick

    def counting_tick() -> float:
        ticks.append(clock())
        result = tick()
        if a.elector.is_leader:
            ticked.set()
        return result
    a.beat.tick = counting_tick  # type: ignore[method-assign]
    a.elector.tick()
    assert not a.elector.is_leader
    a.beat.start()
    try:
        # The thread's first tick is idle (not leader); then it sleeps up to 30 s.
        wait_for(lambda: ticks, 2.0, "the first beat tick")
        other.stop()
        a.elector.tick()
        assert a.elector.is_leader
        assert ticked.wait(2.0), "beat slept through on_gained"
    finally:
        started = time.monotonic()
        a.beat.stop()
    assert time.monotonic() - started < 2.0


def test_crontab_next_due_is_deterministic_and_strictly_later() -> None:
    app = Celery(set_as_current=False)
    cron = schedules.crontab(minute="*/5", app=app)
    next_due = next_due_function(cron)
    start = datetime(2024, 3, 1, 12, 3, 20, tzinfo=timezone.utc).timestamp()
    due = [next_due(start)]
    for _ in range(3):
        due.append(next_due(due[-1]))
    assert [datetime.fromtimestamp(d, timezone.utc).strftime("%H:%M:%S") for d in due] == [
        "12:05:00", "12:10:00", "12:15:00", "12:20:00"]
    assert next_due(start) == due[0]  # same input, same slot
    assert cron.nowfun is None  # the pinned "now" was restored


def test_catchup_latest_after_a_long_outage_fires_one_slot(store: Recorded,
                                                           clock: FakeClock) -> None:
    """More missed periods than MAX_CATCHUP: still only the most recent one fires."""
    a = Node(store, clock, "a", entries=[every(1.0)], catchup="latest")
    t0 = clock()
    a.step()
    clock.advance(2500.5)
    a.elector.tick()  # nobody else campaigned: the same term is renewed
    for _ in range(3):
        a.beat.tick()
    assert a.publisher.due() == [t0 + 2500]


def test_catchup_all_after_a_long_outage_fires_every_slot(store: Recorded,
                                                          clock: FakeClock) -> None:
    a = Node(store, clock, "a", entries=[every(1.0)], catchup="all")
    t0 = clock()
    a.step()
    clock.advance(2500.5)
    a.elector.tick()
    while a.beat.tick() <= 0:  # more than one batch: beat asks to be called again at once
        pass
    assert a.publisher.due() == [t0 + i for i in range(1, 2501)]


@pytest.mark.parametrize("period", [1e-9, 0.0004])
def test_interval_next_due_is_strictly_later_even_for_tiny_periods(period: float) -> None:
    from datetime import timedelta

    next_due = next_due_function(schedules.schedule(timedelta(seconds=period)))
    assert next_due(1_000_000.0) > 1_000_000.0


@pytest.mark.parametrize("every_s", [0.0, -1.0, float("nan"), float("inf"), 1e-9])
def test_dynamic_interval_rejects_bad_periods(every_s: float) -> None:
    from celery_pulse.bootsteps.schedules import schedule_from_row
    from celery_pulse.errors import InvalidConfig

    with pytest.raises(InvalidConfig, match="every"):
        schedule_from_row("interval", {"every": every_s})
