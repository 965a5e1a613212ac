"""Membership over MemoryStore with a fake clock: no threads, no sleeps.

One fake clock is both the store clock and Membership's monotonic clock, so the
test moves time by hand and calls ``tick()`` itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from celery_pulse.errors import NotRegistered
from celery_pulse.registry import Membership
from celery_pulse.store.base import Heartbeat, Registration
from celery_pulse.store.memory import MemoryStore
from tests.helpers.clock import FakeClock

TTL = 30.0
INTERVAL = 10.0
MARGIN = 2.0
WID = "w1@host"


class Recorder:
    """A MembershipListener that records every call."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None]] = []

    def on_fenced(self, reason: str) -> None:
        self.events.append(("fenced", reason))

    def on_resumed(self) -> None:
        self.events.append(("resumed", None))

    def on_identity_lost(self, reason: str) -> None:
        self.events.append(("lost", reason))

    def on_drain(self) -> None:
        self.events.append(("drain", None))

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


class RacingStore(MemoryStore):
    """Lets a newcomer register the name right after a heartbeat reports 'expired'."""

    newcomer: Registration | None = None

    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        try:
            return super().heartbeat(worker_id, token, ttl)
        except NotRegistered as exc:
            if exc.reason == NotRegistered.EXPIRED and self.newcomer is None:
                self.newcomer = super().register(worker_id, {"who": "newcomer"}, ttl)
            raise


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> MemoryStore:
    return MemoryStore(clock=clock)


@pytest.fixture
def listener() -> Recorder:
    return Recorder()


def make(store: MemoryStore, clock: FakeClock, listener: Recorder,
         labels: Mapping[str, Any] | None = None) -> Membership:
    return Membership(store, WID, labels or {"queues": ["celery"]}, ttl=TTL, interval=INTERVAL,
                      margin=MARGIN, listener=listener, monotonic=clock)


@pytest.fixture
def member(store: MemoryStore, clock: FakeClock, listener: Recorder) -> Iterator[Membership]:
    m = make(store, clock, listener)
    m.start(thread=False)
    yield m
    m.stop(deregister=False)


def token_in_store(store: MemoryStore) -> str:
    return store.tables.workers[WID].token


# -- start / heartbeat -------------------------------------------------------------
def test_start_registers(store: MemoryStore, clock: FakeClock, listener: Recorder) -> None:
    m = make(store, clock, listener, {"queues": ["a"]})
    reg = m.start(thread=False)
    assert m.state == Membership.ACTIVE
    assert not m.fenced
    assert reg.token == token_in_store(store)
    assert m.deadline == clock.now + TTL - MARGIN
    assert m.expires_in == TTL - MARGIN
    [info] = store.list_workers()
    assert info.worker_id == WID and info.alive and info.labels == {"queues": ["a"]}
    assert listener.events == []
    m.stop()


def test_start_fails_loudly_when_store_down(store: MemoryStore, clock: FakeClock,
                                            listener: Recorder) -> None:
    store.down = True
    m = make(store, clock, listener)
    with pytest.raises(Exception, match="down"):
        m.start(thread=False)
    assert m.state == Membership.STOPPED


def test_heartbeat_extends_deadline(member: Membership, store: MemoryStore,
                                    clock: FakeClock, listener: Recorder) -> None:
    token = member.registration.token if member.registration else ""
    first_deadline = member.deadline
    clock.advance(INTERVAL)
    assert member.tick() == INTERVAL
    assert member.deadline == first_deadline + INTERVAL
    assert store.tables.workers[WID].expires_at == clock.now + TTL
    # Well past the original deadline and store expiry, kept alive by heartbeats.
    for _ in range(10):
        clock.advance(INTERVAL)
        assert member.tick() == INTERVAL
    assert clock.now > first_deadline + TTL
    assert not member.fenced
    assert member.state == Membership.ACTIVE
    assert token_in_store(store) == token
    assert listener.events == []


# -- store outage ----------------------------------------------------------------
def test_store_down_no_fence_before_deadline(member: Membership, store: MemoryStore,
                                             clock: FakeClock, listener: Recorder) -> None:
    deadline = member.deadline
    store.down = True
    while clock.now + 1.0 < deadline:
        delay = member.tick()
        assert delay is not None and 0 < delay <= INTERVAL
        assert member.state == Membership.ACTIVE
        assert not member.fenced
        clock.advance(min(delay, deadline - clock.now - 0.5))
    assert listener.events == []
    assert member.failures > 0


def test_store_down_fences_past_deadline(member: Membership, store: MemoryStore,
                                         clock: FakeClock, listener: Recorder) -> None:
    deadline = member.deadline
    store.down = True
    clock.advance(INTERVAL)
    member.tick()
    assert listener.events == []
    clock.now = deadline
    assert member.fenced  # local deadline reached, even before the next tick
    delay = member.tick()
    assert delay is not None and delay > 0
    assert member.state == Membership.FENCED
    assert listener.names() == ["fenced"]
    # Still down: more ticks do not fence again.
    for _ in range(5):
        clock.advance(1.0)
        member.tick()
    assert listener.names() == ["fenced"]


def test_store_back_while_registration_alive_resumes(member: Membership, store: MemoryStore,
                                                     clock: FakeClock,
                                                     listener: Recorder) -> None:
    token = token_in_store(store)
    store.down = True
    clock.now = member.deadline + MARGIN / 2  # locally fenced, store row still alive
    member.tick()
    assert listener.names() == ["fenced"]
    assert store.tables.workers[WID].expires_at > clock.now
    store.down = False
    assert member.tick() == INTERVAL
    assert listener.names() == ["fenced", "resumed"]
    assert member.state == Membership.ACTIVE and not member.fenced
    assert token_in_store(store) == token  # same registration, not a new one
    assert member.deadline == clock.now + TTL - MARGIN


def test_store_back_after_expiry_reregisters(member: Membership, store: MemoryStore,
                                             clock: FakeClock, listener: Recorder) -> None:
    old = token_in_store(store)
    store.down = True
    clock.now = member.deadline + 0.1
    member.tick()
    assert listener.names() == ["fenced"]
    clock.advance(TTL)  # the store row has expired by the store clock
    member.tick()
    store.down = False
    assert member.tick() == INTERVAL
    assert listener.names() == ["fenced", "resumed"]
    new = token_in_store(store)
    assert new != old
    assert member.registration is not None and member.registration.token == new
    assert member.state == Membership.ACTIVE and not member.fenced
    with pytest.raises(NotRegistered):
        store.heartbeat(WID, old, TTL)
    # And the fresh registration is kept up.
    clock.advance(INTERVAL)
    assert member.tick() == INTERVAL
    assert token_in_store(store) == new


def test_expired_without_outage_fences_then_reregisters(member: Membership,
                                                        store: MemoryStore, clock: FakeClock,
                                                        listener: Recorder) -> None:
    """E.g. the process was paused longer than the TTL: heartbeat says 'expired'."""
    old = token_in_store(store)
    clock.advance(TTL + 1)
    assert member.tick() == INTERVAL
    assert listener.names() == ["fenced", "resumed"]
    assert listener.events[0][1] is not None and "expired" in listener.events[0][1]
    assert token_in_store(store) != old
    assert member.state == Membership.ACTIVE


def test_deregistered_by_someone_fences_then_reregisters(member: Membership,
                                                         store: MemoryStore,
                                                         listener: Recorder) -> None:
    assert store.deregister(WID, token_in_store(store))
    assert member.tick() == INTERVAL
    assert listener.names() == ["fenced", "resumed"]
    assert "missing" in (listener.events[0][1] or "")
    assert [w.worker_id for w in store.list_workers()] == [WID]


# -- identity lost -------------------------------------------------------------------
def test_replaced_by_another_process(member: Membership, store: MemoryStore, clock: FakeClock,
                                     listener: Recorder) -> None:
    newcomer = store.register(WID, {"who": "newcomer"}, TTL)
    clock.advance(INTERVAL)
    assert member.tick() is None
    assert listener.names() == ["lost"]
    assert member.state == Membership.LOST
    assert member.fenced
    assert member.tick() is None  # stays lost, no further callbacks
    member.stop()
    assert listener.names() == ["lost"]
    assert member.state == Membership.LOST
    # The newcomer's registration survives our stop().
    assert token_in_store(store) == newcomer.token
    assert store.heartbeat(WID, newcomer.token, TTL).expires_at == clock.now + TTL


def test_expired_name_taken_by_live_newcomer_is_not_stolen(member: Membership,
                                                           store: MemoryStore,
                                                           clock: FakeClock,
                                                           listener: Recorder) -> None:
    clock.advance(TTL + 1)  # our registration expires (we were paused)...
    newcomer = store.register(WID, {"who": "newcomer"}, TTL)  # ...and the name is reused
    assert member.tick() is None
    assert listener.names() == ["lost"]
    assert token_in_store(store) == newcomer.token
    assert store.tables.workers[WID].labels == {"who": "newcomer"}
    member.stop()
    assert token_in_store(store) == newcomer.token


def test_newcomer_racing_the_reregistration_is_not_stolen(clock: FakeClock,
                                                          listener: Recorder) -> None:
    """Heartbeat says 'expired', then a newcomer registers before we register again."""
    store = RacingStore(clock=clock)
    m = make(store, clock, listener)
    m.start(thread=False)
    clock.advance(TTL + 1)
    assert m.tick() is None
    assert store.newcomer is not None
    assert listener.names() == ["fenced", "lost"]
    assert m.state == Membership.LOST
    assert token_in_store(store) == store.newcomer.token
    assert store.tables.workers[WID].labels == {"who": "newcomer"}
    m.stop()
    assert token_in_store(store) == store.newcomer.token


def test_expired_name_of_a_dead_newcomer_is_taken_back(member: Membership, store: MemoryStore,
                                                       clock: FakeClock,
                                                       listener: Recorder) -> None:
    clock.advance(TTL + 1)
    newcomer = store.register(WID, {"who": "newcomer"}, 1.0)
    clock.advance(2.0)  # the newcomer died too; nobody live holds the name
    assert member.tick() == INTERVAL
    assert listener.names() == ["fenced", "resumed"]
    assert token_in_store(store) != newcomer.token
    assert member.registration is not None
    assert token_in_store(store) == member.registration.token


# -- draining ------------------------------------------------------------------------
def test_drain_flag_calls_on_drain_once(member: Membership, store: MemoryStore,
                                        clock: FakeClock, listener: Recorder) -> None:
    clock.advance(INTERVAL)
    member.tick()
    assert listener.events == [] and not member.draining
    store.tables.workers[WID].draining = True
    clock.advance(INTERVAL)
    assert member.tick() == INTERVAL
    assert listener.names() == ["drain"]
    assert member.draining
    for _ in range(3):
        clock.advance(INTERVAL)
        assert member.tick() == INTERVAL
    assert listener.names() == ["drain"]
    assert member.state == Membership.ACTIVE


# -- stop ------------------------------------------------------------------------------
def test_stop_deregisters(member: Membership, store: MemoryStore, listener: Recorder) -> None:
    assert [w.worker_id for w in store.list_workers()] == [WID]
    member.stop()
    assert store.list_workers() == []
    assert member.state == Membership.STOPPED
    assert member.fenced
    assert member.tick() is None
    assert listener.events == []


def test_stop_without_deregister_keeps_row(member: Membership, store: MemoryStore) -> None:
    member.stop(deregister=False)
    assert [w.worker_id for w in store.list_workers()] == [WID]
    assert member.state == Membership.STOPPED


def test_stop_with_store_down_does_not_raise(member: Membership, store: MemoryStore) -> None:
    store.down = True
    member.stop()
    assert member.state == Membership.STOPPED
    store.down = False
    assert [w.worker_id for w in store.list_workers()] == [WID]
