"""The lease keeper's local table: lost attempts stay fenced, warm shutdown gives back
what never ran. On the memory store: no database, no worker process."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from celery_pulse.errors import StoreUnavailable
from celery_pulse.leases import LOST, RUNNING, LeaseKeeper, LocalClaim
from celery_pulse.store.base import (
    Completion,
    Exchanged,
    Grant,
    Message,
    Permit,
    ReserveRequest,
)
from celery_pulse.store.memory import MemoryStore
from celery_pulse.testing import wait_for
from tests.helpers.clock import FakeClock

TTL = 30.0


class Listener:
    def __init__(self) -> None:
        self.lost: list[LocalClaim] = []
        self.hard_stopped: list[LocalClaim] = []

    def on_lost(self, claim: LocalClaim) -> None:
        self.lost.append(claim)

    def on_hard_stop(self, claim: LocalClaim) -> None:
        self.hard_stopped.append(claim)

    def on_renewed(self, claims: Sequence[LocalClaim]) -> None:
        pass


@pytest.fixture
def store() -> MemoryStore:
    """The memory store on the wall clock (the leases' store clock)."""
    return MemoryStore()


def reserve(store: MemoryStore, task_id: str, publication: str) -> Grant:
    message = Message(b"[[], {}, {}]", {"id": task_id}, {}, {}, "application/json", "utf-8")
    (grant,) = store.reserve("w1", [ReserveRequest(task_id, "t", message, "redispatch", 10, 0,
                                                   publication)], TTL)
    assert isinstance(grant, Grant)
    return grant


def test_a_newer_grant_of_the_task_still_hard_stops_the_lost_attempt(store: MemoryStore) -> None:
    clock, listener = FakeClock(1000.0), Listener()
    keeper = LeaseKeeper(store, "w1", ttl=TTL, interval=1, margin=1, grace=2,
                         listener=listener, monotonic=clock)
    old = keeper.add(reserve(store, "t1", "p1"), clock(), 0, False)
    old.pid = 4242  # running in a pool process
    keeper.lose(old, "taken over")
    store.release("w1", [old.key], never_ran=True)
    new = keeper.add(reserve(store, "t1", "p1"), clock(), 0, False)
    assert keeper.get("t1") is new
    clock.now += 3  # past the grace, and the old attempt ignored LeaseLost
    keeper.enforce_deadlines()
    assert listener.hard_stopped == [old]
    keeper.forget(old)  # its result came back: nothing left to stop
    assert keeper.get("t1") is new and keeper._displaced == {}


def test_a_newer_grant_of_the_task_loses_the_stale_attempt_not_yet_seen_lost(
        store: MemoryStore) -> None:
    """Paused past its deadline, the worker is handed the task's re-dispatched delivery
    before its watchdog ran: the attempt still running is lost (LeaseLost, hard stop)."""
    clock, listener = FakeClock(1000.0), Listener()
    keeper = LeaseKeeper(store, "w1", ttl=TTL, interval=1, margin=1, grace=2,
                         listener=listener, monotonic=clock)
    old = keeper.add(reserve(store, "t1", "p1"), clock(), 0, False)
    old.pid = 4242
    clock.now += TTL  # past its local deadline; no renewal, no watchdog yet
    store.release("w1", [old.key], never_ran=True)
    new = keeper.add(reserve(store, "t1", "p1"), clock(), 0, False)
    assert keeper.get("t1") is new and listener.lost == [old]
    assert old.state == LOST and "superseded" in old.lost_reason
    clock.now += 3
    keeper.enforce_deadlines()
    assert listener.hard_stopped == [old]


def test_warm_shutdown_never_releases_a_job_handed_to_the_pool(store: MemoryStore) -> None:
    """Accepted or not seen accepted: a job in the pool may have run, so it stays running.

    Only reservations, starts that never reached the pool and jobs the pool dropped
    unwritten are released as never run; the others' leases expire and Recover decides
    by the task's policy.
    """
    keeper = LeaseKeeper(store, "w1", ttl=TTL, interval=1, margin=1, grace=2,
                         listener=Listener())
    clock = keeper.monotonic
    handed, accepted, _, dropped = (keeper.add(reserve(store, t, "p"), clock(), 0, False)
                                    for t in ("a", "b", "c", "d"))
    for claim in (handed, accepted, dropped):
        assert store.start("w1", claim.task_id, claim.epoch, claim.token, TTL)
        keeper.mark_running(claim)
        keeper.handed(claim)
    accepted.pid = 4242
    handed.dropped_by_pool = lambda: False  # written to a process: it may run
    dropped.dropped_by_pool = lambda: True  # flushed by the pool before any process had it
    keeper.stop()
    states = {c.task_id: c.state for c in store.list_claims()}
    assert states == {"a": RUNNING, "b": RUNNING, "c": "reserved", "d": "reserved"}


class Spy:
    """The store, with each exchange recorded and the first one held until released."""

    def __init__(self, store: MemoryStore, fail_first: bool = False) -> None:
        self.store = store
        self.calls: list[tuple[list[str], list[str], list[str]]] = []
        self.go = threading.Event()
        self.entered = threading.Event()
        self.fail_first = fail_first

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest],
                 starts: Sequence[tuple[str, int, str]],
                 permits: Any = None) -> Exchanged:
        self.calls.append(([c.task_id for c in completions], [r.task_id for r in reserves],
                           [s[0] for s in starts]))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.go.wait(10)
            if self.fail_first:
                raise StoreUnavailable("the store went away")
        return self.store.exchange(holder, ttl, completions, reserves, starts)


def keeper_holding_done(spy: Spy) -> tuple[LeaseKeeper, LocalClaim]:
    """A keeper on ``spy`` holding the reserved claim ``done`` (not started yet)."""
    keeper = LeaseKeeper(spy, "w1", ttl=TTL, interval=1, margin=1, grace=2,  # type: ignore[arg-type]
                         listener=Listener())
    return keeper, keeper.add(reserve(spy.store, "done", "p"), keeper.monotonic(), 0, False)


def request(task_id: str) -> ReserveRequest:
    message = Message(b"[[], {}, {}]", {"id": task_id}, {}, {}, "application/json", "utf-8")
    return ReserveRequest(task_id, "t", message, "review", 10, 0, None)




def test_what_queues_up_during_an_exchange_goes_out_together_in_the_next(
        store: MemoryStore) -> None:
    """Completions, reservations and starts share one exchange (one round trip on
    PostgreSQL), however few of each: the group commit."""
    spy = Spy(store)
    keeper = LeaseKeeper(spy, "w1", ttl=TTL, interval=1, margin=1, grace=2,  # type: ignore[arg-type]
                         listener=Listener())
    done = keeper.add(reserve(store, "done", "p"), keeper.monotonic(), 0, False)
    waiting = keeper.add(reserve(store, "waiting", "p"), keeper.monotonic(), 0, False)
    answers: dict[str, Any] = {}
    keeper.start()
    try:
        keeper.submit_reserve(request("first"), lambda r, _sent: answers.update(first=r))
        assert spy.entered.wait(10)  # the first exchange is in flight
        keeper.submit_complete(done, "succeeded", None, lambda r, _c: answers.update(done=r))
        keeper.submit_start(waiting, lambda r: answers.update(waiting=r), urgent=False)
        keeper.submit_reserve(request("next"), lambda r, _sent: answers.update(next=r),
                              urgent=False)
        spy.go.set()
        wait_for(lambda: len(answers) == 4, 10, "every answer", interval=0.005)
    finally:
        spy.go.set()
        keeper.stop()
    assert spy.calls == [([], ["first"], []), (["done"], ["next"], ["waiting"])]
    assert answers["done"] == "applied" and answers["waiting"] is True
    assert isinstance(answers["first"], Grant) and isinstance(answers["next"], Grant)
    assert waiting.state == RUNNING


def test_a_store_whose_reservations_are_local_answers_one_at_once_beside_an_exchange(
        store: MemoryStore) -> None:
    """A gateway worker's reservation is its gateway's assignment, looked up in the
    worker: it is answered on the submitting thread, never queued behind an exchange
    in flight (which waits for the gateway), and no exchange carries it."""
    spy = Spy(store)
    spy.local_reservations = True
    keeper, done = keeper_holding_done(spy)
    answers: dict[str, Any] = {}
    keeper.start()
    try:
        keeper.submit_complete(done, "succeeded", None, lambda r, _c: answers.update(done=r))
        assert spy.entered.wait(10)  # the completion's exchange is in flight, held
        here = threading.get_ident()
        keeper.submit_reserve(request("new"), lambda r, _sent: answers.update(
            new=r, thread=threading.get_ident()), urgent=False)
        assert isinstance(answers["new"], Grant) and answers["thread"] == here
        assert "done" not in answers
        spy.go.set()
        wait_for(lambda: "done" in answers, 10, "the completion's answer", interval=0.005)
    finally:
        spy.go.set()
        keeper.stop()
    assert spy.calls == [(["done"], [], [])]


def test_a_failed_exchange_answers_its_reservations_and_keeps_its_completions(
        store: MemoryStore) -> None:
    spy = Spy(store, fail_first=True)
    keeper, done = keeper_holding_done(spy)
    answers: dict[str, Any] = {}
    keeper.start()
    try:
        keeper.submit_complete(done, "succeeded", None, lambda r, _c: answers.update(done=r))
        keeper.submit_reserve(request("new"), lambda r, _sent: answers.update(new=r))
        assert spy.entered.wait(10)
        spy.go.set()
        wait_for(lambda: len(answers) == 2, 10, "both answers", interval=0.005)
    finally:
        spy.go.set()
        keeper.stop()
    # The reservation is answered with the outage at once (its delivery is retried); the
    # completion is sent again until the store takes it.
    assert isinstance(answers["new"], StoreUnavailable)
    assert answers["done"] == "applied"
    assert spy.calls[0] == (["done"], ["new"], []) and spy.calls[1][0] == ["done"]
    assert {c.task_id: c.state for c in store.list_claims()}["done"] == "succeeded"


def test_warm_shutdown_releases_grants_the_event_loop_never_took(store: MemoryStore) -> None:
    """A reservation answered after the consumer's loop stopped never ran, even one
    granted as running (its start folded in): it is released, not left to expire into
    review."""
    keeper = LeaseKeeper(store, "w1", ttl=TTL, interval=1, margin=1, grace=2,
                         listener=Listener())
    answered: list[Any] = []
    keeper.start()
    keeper.submit_reserve(dataclasses.replace(request("late"), start=True),
                          lambda result, _sent: answered.append(result))  # never added
    wait_for(lambda: answered, 10, "the grant", interval=0.005)
    assert isinstance(answered[0], Grant) and answered[0].started
    keeper.stop()
    (info,) = store.list_claims()
    assert info.state == "reserved" and info.lease_remaining is not None
    assert info.lease_remaining <= 0  # expired now: Recover re-publishes it at once


def test_a_claim_completed_during_a_renewal_is_not_lost(store: MemoryStore) -> None:
    """The renewer snapshots the held claims, then renews: a task that completes in
    between is no longer granted, but it was never lost (and its pid may already run the
    next task: no LeaseLost signal may go to it)."""
    listener = Listener()
    keeper = LeaseKeeper(store, "w1", ttl=TTL, interval=1, margin=1, grace=2,
                         listener=listener)
    claim = keeper.add(reserve(store, "t1", "p1"), time.monotonic(), 0, False)
    assert set(store.start_many("w1", [claim.key], TTL)) == {"t1"}
    keeper.mark_running(claim)
    claim.pid = 4242
    real_renew = store.renew

    def renew_after_completion(holder: str, leases: Sequence[tuple[str, int, str]],
                               ttl: float) -> Any:
        keeper.forget(claim)  # what submit_complete does first
        store.complete("w1", [Completion(claim.task_id, claim.epoch, claim.token, "succeeded",
                                         None)])
        return real_renew(holder, leases, ttl)

    store.renew = renew_after_completion  # type: ignore[method-assign]
    keeper.renew_once()
    assert listener.lost == [] and claim.state == RUNNING
    assert keeper.counters.lost == 0


class FailingPermits:
    """The store, failing every exchange that carries starts needing permits."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.calls: list[tuple[list[str], list[str], list[str]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[tuple[str, int, str]],
                 permits: Any = None) -> Exchanged:
        self.calls.append(([c.task_id for c in completions], [r.task_id for r in reserves],
                           [s[0] for s in starts]))
        if permits:
            raise StoreUnavailable("contended permit key")
        return self.store.exchange(holder, ttl, completions, reserves, starts, permits)


def test_a_failing_limited_start_fails_nothing_else_in_its_batch(store: MemoryStore) -> None:
    """Starts that need permits go to the store apart from the batch's other ops: their
    failure (a fault-suite run saw one fail thousands of times) answers them alone."""
    spy = FailingPermits(store)
    keeper = LeaseKeeper(spy, "w1", ttl=TTL, interval=1, margin=1, grace=2,  # type: ignore[arg-type]
                         listener=Listener())
    done = keeper.add(reserve(store, "done", "p"), keeper.monotonic(), 0, False)
    plain = keeper.add(reserve(store, "plain", "p"), keeper.monotonic(), 0, False)
    limited = keeper.add(reserve(store, "limited", "p"), keeper.monotonic(), 0, False)
    limited.permits = (Permit("k", 1),)
    answers: dict[str, Any] = {}
    keeper.submit_complete(done, "succeeded", None, lambda r, _c: answers.update(done=r))
    keeper.submit_start(plain, lambda r: answers.update(plain=r), urgent=False)
    keeper.submit_start(limited, lambda r: answers.update(limited=r), urgent=False)
    keeper.submit_reserve(request("new"), lambda r, _sent: answers.update(new=r))
    keeper.start()
    try:
        wait_for(lambda: len(answers) == 4, 10, "every answer", interval=0.005)
    finally:
        keeper.stop()
    assert spy.calls[:2] == [(["done"], ["new"], ["plain"]), ([], [], ["limited"])]
    assert answers["done"] == "applied" and answers["plain"] is True
    assert isinstance(answers["new"], Grant)
    assert isinstance(answers["limited"], StoreUnavailable)
