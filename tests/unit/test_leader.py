"""LeaderElector driven by hand: a fake clock, the memory store, ``tick()`` called by the test.

One fake clock is both the store clock and the elector's monotonic clock; the test
moves it explicitly. Only the first test starts the real thread (to see that the
first attempt does not wait for an interval).
"""

from __future__ import annotations

import threading
import time

import pytest

from celery_pulse.leader import LeaderElector
from celery_pulse.store.base import LeaderGrant
from celery_pulse.store.memory import MemoryStore
from tests.helpers.clock import FakeClock
from tests.helpers.recording import Recorded

KEY = "beat"
TTL = 30.0
INTERVAL = 10.0
MARGIN = 2.0


class Events:
    """Records on_gained / on_lost calls of one elector."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.gained = threading.Event()

    def on_gained(self, grant: LeaderGrant) -> None:
        self.log.append(("gained", grant.epoch))
        self.gained.set()

    def on_lost(self, grant: LeaderGrant) -> None:
        self.log.append(("lost", grant.epoch))


def elector(store: Recorded, clock: FakeClock, holder: str, events: Events | None = None,
            **kwargs: float) -> LeaderElector:
    events = events or Events()
    params = {"ttl": TTL, "interval": INTERVAL, "margin": MARGIN, **kwargs}
    return LeaderElector(store, KEY, holder, ttl=params["ttl"], interval=params["interval"],
                         margin=params["margin"], on_gained=events.on_gained,
                         on_lost=events.on_lost, monotonic=clock)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> Recorded:
    """The memory store on the fake clock, its calls recorded."""
    return Recorded(MemoryStore(clock), clock)


def test_interval_must_be_shorter_than_ttl(store: Recorded, clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="shorter"):
        elector(store, clock, "a", ttl=10.0, interval=10.0)


def test_first_attempt_is_immediate_and_stop_is_prompt(store: Recorded, clock: FakeClock) -> None:
    # A 100 s interval (real seconds for the thread's waits): only an immediate first
    # attempt can make us leader within the 2 s we wait.
    events = Events()
    e = elector(store, clock, "a", events, ttl=300.0, interval=100.0)
    e.start()
    try:
        assert events.gained.wait(2.0), "no leadership within 2 s of start()"
        assert e.is_leader and e.epoch == 1
        token = e.grant.token if e.grant else None
    finally:
        started = time.monotonic()
        e.stop()
    assert time.monotonic() - started < 2.0, "stop() waited for the interval"
    assert not e.is_leader
    assert store.releases == [(KEY, token)]


def test_deadline_counts_from_when_the_request_was_sent(store: Recorded,
                                                       clock: FakeClock) -> None:
    e = elector(store, clock, "a")
    sent = clock()
    store.latency = 5.0  # the answer comes back 5 s after we asked
    e.tick()
    assert e.is_leader
    assert e.deadline == pytest.approx(sent + TTL - MARGIN)
    # ... which is before the store's own expiry by at least the margin.
    assert e.grant is not None and e.deadline <= e.grant.lease_until - MARGIN
    clock.now = e.deadline - 0.001
    assert e.is_leader
    clock.now = e.deadline
    assert not e.is_leader and e.epoch is None


def test_renewal_keeps_the_term_and_moves_the_deadline(store: Recorded, clock: FakeClock) -> None:
    events = Events()
    e = elector(store, clock, "a", events)
    e.tick()
    first = e.grant
    assert first is not None
    for _ in range(5):
        clock.advance(INTERVAL)
        e.tick()
        assert e.grant is not None
        assert (e.grant.token, e.grant.epoch) == (first.token, first.epoch)
        assert e.deadline == pytest.approx(clock() + TTL - MARGIN)
    assert events.log == [("gained", 1)]


def test_not_leader_after_local_deadline_without_successful_renewal(
        store: Recorded, clock: FakeClock) -> None:
    events = Events()
    a = elector(store, clock, "a", events)
    a.tick()
    grant = a.grant
    assert grant is not None and a.is_leader
    store.down = True
    # Failed renewals before the deadline: still leader (the store lease still holds).
    for _ in range(2):
        clock.advance(INTERVAL)
        a.tick()
        assert a.is_leader
    assert events.log == [("gained", 1)]
    clock.now = a.deadline
    # The property turns false at the deadline by itself, before any further tick.
    assert not a.is_leader and a.epoch is None
    # At that moment the store has not yet given the lease to anyone: no overlap.
    store.down = False
    assert store.try_acquire(KEY, "b", TTL) is None
    store.down = True
    a.tick()
    assert events.log == [("gained", 1), ("lost", 1)]
    a.tick()  # no second on_lost
    assert events.log == [("gained", 1), ("lost", 1)]
    # The store comes back: a new campaign succeeds and is reported as gained again.
    store.down = False
    clock.advance(TTL)
    a.tick()
    assert a.is_leader and events.log[-1] == ("gained", 2)


def test_on_gained_and_on_lost_follow_role_changes(store: Recorded, clock: FakeClock) -> None:
    ea, eb = Events(), Events()
    a, b = elector(store, clock, "a", ea), elector(store, clock, "b", eb)
    a.tick()
    b.tick()
    assert a.is_leader and not b.is_leader
    assert ea.log == [("gained", 1)] and eb.log == []
    # a stops renewing (paused); its store lease runs out; b takes over.
    clock.advance(TTL)
    b.tick()
    assert b.is_leader and b.epoch == 2 and eb.log == [("gained", 2)]
    assert not a.is_leader
    a.tick()  # a wakes up and learns it lost
    assert ea.log == [("gained", 1), ("lost", 1)]
    assert a.grant is None and not a.is_leader and a.since is None
    assert b.is_leader


def test_stop_releases_and_does_not_fire_on_lost(store: Recorded, clock: FakeClock) -> None:
    ea, eb = Events(), Events()
    a, b = elector(store, clock, "a", ea), elector(store, clock, "b", eb)
    a.tick()
    b.tick()
    token = a.grant.token if a.grant else None
    a.stop()
    assert ea.log == [("gained", 1)]  # no on_lost for a planned stop
    assert store.releases == [(KEY, token)]
    assert not a.is_leader
    info = store.get_leader(KEY)
    assert info is not None and not info.alive
    # The next candidate takes over at its next attempt, without waiting for the TTL.
    b.tick()
    assert b.is_leader and eb.log == [("gained", 2)]
    # A stopped elector never campaigns again.
    calls = len(store.calls)
    a.tick()
    assert len(store.calls) == calls


def test_stop_when_not_leader_releases_nothing(store: Recorded, clock: FakeClock) -> None:
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    a.tick()
    b.tick()
    b.stop()
    assert store.releases == []
    assert a.is_leader and store.get_leader(KEY) is not None


def test_stale_leader_renewal_never_extends_a_newer_term(store: Recorded,
                                                         clock: FakeClock) -> None:
    ea, eb = Events(), Events()
    a, b = elector(store, clock, "a", ea), elector(store, clock, "b", eb)
    a.tick()
    old = a.grant
    assert old is not None
    clock.advance(TTL + 1)  # a is paused past its lease
    b.tick()
    newer = store.tables.leaders[KEY]
    before = (newer.holder, newer.token, newer.epoch, newer.lease_until)
    clock.advance(1.0)
    a.tick()  # a's renewal carries its old token
    assert (newer.holder, newer.token, newer.epoch, newer.lease_until) == before
    assert store.try_acquire(KEY, "a", TTL, token=old.token) is None
    assert (newer.holder, newer.token, newer.epoch, newer.lease_until) == before
    assert not a.is_leader and ea.log == [("gained", 1), ("lost", 1)]
    assert b.is_leader
    # Once b's term is over, a's old token still renews nothing: a gets a new term.
    clock.advance(TTL + 1)
    a.tick()
    assert a.grant is not None and a.grant.epoch == 3 and a.grant.token != old.token
    assert ea.log[-1] == ("gained", 3)


def test_term_change_reports_lost_then_gained(store: Recorded, clock: FakeClock) -> None:
    """Our old term ended behind our back and we got a new one in the same attempt."""
    ea = Events()
    a, b = elector(store, clock, "a", ea), elector(store, clock, "b")
    a.tick()
    clock.advance(TTL + 1)
    b.tick()
    clock.advance(TTL + 1)  # b dies; its lease runs out before a's next attempt
    a.tick()
    assert ea.log == [("gained", 1), ("lost", 1), ("gained", 3)]
    assert a.is_leader and a.epoch == 3


def test_lease_expired_but_not_taken_is_renewed_in_the_same_term(store: Recorded,
                                                                 clock: FakeClock) -> None:
    ea = Events()
    a = elector(store, clock, "a", ea)
    a.tick()
    clock.advance(TTL + 5)
    assert not a.is_leader
    a.tick()  # nobody else campaigned: our token is still current
    assert a.is_leader and a.epoch == 1
    assert ea.log == [("gained", 1)]


def test_worker_elector_leads_with_a_short_leader_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Celery

    from celery_pulse.bootsteps.runtime import PulseWorker
    from celery_pulse.pool import child
    from celery_pulse.settings import Settings

    monkeypatch.setattr(child, "_context", child._context)  # restored after the test
    settings = Settings.from_conf({"pulse_store_url": "sqlite:///never-opened.sqlite3",
                                   "pulse_leader_ttl": 1.0, "pulse_leader_interval": 0.3})
    store = MemoryStore(FakeClock())
    pulse = PulseWorker(Celery(set_as_current=False), "w@host", 1, settings, store)
    assert pulse.elector is not None
    pulse.elector.tick()  # real monotonic clock, as in the worker
    assert pulse.elector.grant is not None, "the store granted the lease"
    assert pulse.elector.is_leader, "granted a 1 s lease, yet not leader even for a moment"
