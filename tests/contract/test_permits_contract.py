"""The concurrency-permits contract (issue 19): ``ClaimStore.start_many``'s ``permits``,
``Exchanged.waiting`` and ``ClaimStore.permit_usage``, on every store.

A start that needs a permit moves to ``running`` only while fewer than ``limit`` claims
(any holder) hold its key running; one that finds no room stays ``reserved``, lease
unchanged, and is reported waiting. A claim gives its permits back exactly once, by the
statement that ends its run under the epoch that took them. Expiry is by the store
clock: short leases, then polling the store (``wait_for``), never a sleep in its place.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Mapping, Sequence

import pytest
import sqlalchemy as sa

from celery_pulse.errors import StoreUnavailable
from celery_pulse.store.base import (
    FAILED,
    OPEN,
    RESERVED,
    RUNNING,
    SUCCEEDED,
    Completion,
    Grant,
    Permit,
    PermitUsage,
    Store,
)
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.testing import wait_for
from tests.contract.test_claims_contract import (
    TTL,
    W1,
    W2,
    claim,
    complete,
    expired,
    grant,
    key,
    request,
    row,
)
from tests.helpers.stores import other_handle

#: The TTL starts are given: far from the reservations' TTL, so a lease a start
#: moved is told apart from one it left unchanged.
RUN_TTL = 120.0
SHORT = 0.3


# -- helpers -----------------------------------------------------------------------------
def start(store: Store, holder: str, grants: Sequence[Grant],
          permits: Mapping[str, Sequence[Permit]] | None, ttl: float = RUN_TTL
          ) -> tuple[dict[str, float], set[str]]:
    """``start_many`` of ``grants`` in that order: (started, waiting)."""
    waiting: set[str] = set()
    started = store.start_many(holder, [key(g) for g in grants], ttl, permits, waiting)
    return started, waiting


def needs(grants: Sequence[Grant], *permits: Permit) -> dict[str, list[Permit]]:
    return {g.task_id: list(permits) for g in grants}


def running(store: Store, holder: str, permits: Sequence[Permit], ttl: float = RUN_TTL
            ) -> Grant:
    """A fresh claim of ``holder``, started with ``permits``."""
    g = grant(store, holder, request())
    started, waiting = start(store, holder, [g], needs([g], *permits), ttl)
    assert set(started) == {g.task_id} and waiting == set(), (started, waiting)
    return g


def usage(store: Store) -> dict[str, tuple[int, int, int]]:
    """``key -> (limit, running, waiting)``, checking the rows are ordered by key."""
    rows = store.permit_usage()
    assert [u.key for u in rows] == sorted(u.key for u in rows), rows
    return {u.key: (u.limit, u.running, u.waiting) for u in rows}


# -- within one call -----------------------------------------------------------------------
def test_permits_limit_holds_within_one_call_in_the_order_given(store: Store) -> None:
    """Five starts needing a permit of limit 2 in one call: the first two given start
    (not the first two reserved), the other three wait reserved, their leases untouched."""
    grants = [grant(store, W1, request()) for _ in range(5)]
    order = grants[::-1]
    before = {g.task_id: row(store, g.task_id).lease_until for g in grants}
    started, waiting = start(store, W1, order, needs(order, Permit("k", 2)))
    assert set(started) == {order[0].task_id, order[1].task_id}
    assert waiting == {g.task_id for g in order[2:]}
    for g in order[:2]:
        info = claim(store, g.task_id)
        assert info.state == RUNNING and (info.lease_remaining or 0) > TTL
    for g in order[2:]:
        assert claim(store, g.task_id).state == RESERVED
        assert row(store, g.task_id).lease_until == before[g.task_id]
    assert store.permit_usage() == [PermitUsage("k", 2, 2, 3)]
    # A waiting claim that ends is no longer waiting.
    assert complete(store, W1, order[2], FAILED, "gave up") == "applied"
    assert usage(store) == {"k": (2, 2, 2)}


# -- what gives a permit back, and what does not ----------------------------------------------
def test_permits_an_applied_completion_gives_back_and_a_duplicate_nothing(
        store: Store) -> None:
    """The completion that ends the run frees the permit once; sent again (``duplicate``)
    it frees nothing, or a third claim would run next to the second."""
    hot = Permit("k", 1)
    first = running(store, W1, [hot])
    second, third = grant(store, W1, request()), grant(store, W1, request())
    assert start(store, W1, [second], needs([second], hot)) == ({}, {second.task_id})
    assert complete(store, W1, first) == "applied"
    started, waiting = start(store, W1, [second], needs([second], hot))
    assert set(started) == {second.task_id} and waiting == set()
    assert usage(store) == {"k": (1, 1, 0)}  # started: no longer waiting
    assert complete(store, W1, first) == "duplicate"
    assert usage(store) == {"k": (1, 1, 0)}
    assert start(store, W1, [third], needs([third], hot)) == ({}, {third.task_id})
    assert usage(store) == {"k": (1, 1, 1)}


def test_permits_recover_takeover_gives_back_and_a_stale_completion_nothing(
        store: Store) -> None:
    """An expired run taken over by Recover frees its permit; its holder's late
    completion is ``evidence`` and frees nothing: were it freed twice, the fourth start
    below would run as a third claim under a limit of 2."""
    hot = Permit("k", 2)
    lost = running(store, W1, [hot], ttl=SHORT)
    running(store, W1, [hot])
    third, fourth = grant(store, W2, request()), grant(store, W2, request())
    wait_for(lambda: expired(store, lost.task_id), what="the short run to expire")
    taken = wait_for(lambda: store.recover("scanner", 10, TTL), what="Recover's takeover")
    assert [(t.task_id, t.state, t.was) for t in taken] == [(lost.task_id, OPEN, RUNNING)]
    assert usage(store) == {"k": (2, 1, 0)}
    started, _ = start(store, W2, [third], needs([third], hot))
    assert set(started) == {third.task_id}
    assert complete(store, W1, lost) == "evidence"
    assert usage(store) == {"k": (2, 2, 0)}
    assert start(store, W2, [fourth], needs([fourth], hot)) == ({}, {fourth.task_id})
    assert claim(store, fourth.task_id).state == RESERVED


@pytest.mark.parametrize("how", ["release_never_ran", "requeue"])
def test_permits_release_never_ran_and_requeue_give_back(store: Store,
                                                            how: str) -> None:
    """A start that never reached a pool process, and Celery's requeue, end the run:
    the permit goes to the claim waiting for it."""
    hot = Permit("k", 1)
    first = running(store, W1, [hot])
    second = grant(store, W1, request())
    assert start(store, W1, [second], needs([second], hot)) == ({}, {second.task_id})
    if how == "release_never_ran":
        assert store.release(W1, [key(first)], never_ran=True) == 1
        assert claim(store, first.task_id).state == RESERVED
    else:
        assert len(store.requeue(W1, [key(first)], publish_ttl=TTL)) == 1
        assert claim(store, first.task_id).state == OPEN
    assert usage(store) == {"k": (1, 0, 1)}
    started, waiting = start(store, W1, [second], needs([second], hot))
    assert set(started) == {second.task_id} and waiting == set()
    assert usage(store) == {"k": (1, 1, 0)}


def test_permits_a_new_reservation_of_an_expired_redispatch_run_gives_back(
        store: Store) -> None:
    """Expiry alone frees nothing (the run may still be going); the reservation that
    takes the expired ``redispatch`` run under a new epoch ends it, and frees the permit."""
    hot = Permit("k", 1)
    lost = running(store, W1, [hot], ttl=SHORT)
    other = grant(store, W2, request())
    wait_for(lambda: expired(store, lost.task_id), what="the short run to expire")
    assert start(store, W2, [other], needs([other], hot)) == ({}, {other.task_id})
    again = grant(store, W2, request(lost.task_id))
    assert again.epoch == lost.epoch + 1
    assert claim(store, lost.task_id).state == RESERVED
    assert usage(store) == {"k": (1, 0, 1)}
    started, _ = start(store, W2, [other], needs([other], hot))
    assert set(started) == {other.task_id}
    assert complete(store, W1, lost) == "evidence"
    assert usage(store) == {"k": (1, 1, 0)}


# -- several permits, several holders ----------------------------------------------------------
def test_permits_a_start_needing_two_waits_until_both_have_room(store: Store) -> None:
    """Key A full: the start waits although B has room, and takes no B permit meanwhile
    (another claim still gets B's only one). It runs once both are free."""
    a, b = Permit("a", 1), Permit("b", 1)
    holds_a = running(store, W1, [a])
    both, only_b = grant(store, W1, request()), grant(store, W1, request())
    assert start(store, W1, [both], needs([both], a, b)) == ({}, {both.task_id})
    assert usage(store) == {"a": (1, 1, 1), "b": (1, 0, 0)}
    started, _ = start(store, W1, [only_b], needs([only_b], b))
    assert set(started) == {only_b.task_id}
    assert complete(store, W1, holds_a) == "applied"
    # Now A has room and B has none: still waiting, for B this time.
    assert start(store, W1, [both], needs([both], a, b)) == ({}, {both.task_id})
    assert usage(store) == {"a": (1, 0, 0), "b": (1, 1, 1)}
    assert complete(store, W1, only_b) == "applied"
    started, waiting = start(store, W1, [both], needs([both], a, b))
    assert set(started) == {both.task_id} and waiting == set()
    assert usage(store) == {"a": (1, 1, 0), "b": (1, 1, 0)}


def test_permits_of_different_holders_count_together(store: Store) -> None:
    """The limit is cluster-wide: W1's two runs fill a limit of 2 for W2 as well."""
    hot = Permit("k", 2)
    mine = [running(store, W1, [hot]) for _ in range(2)]
    theirs = grant(store, W2, request())
    assert start(store, W2, [theirs], needs([theirs], hot)) == ({}, {theirs.task_id})
    assert complete(store, W1, mine[0]) == "applied"
    started, _ = start(store, W2, [theirs], needs([theirs], hot))
    assert set(started) == {theirs.task_id}
    assert usage(store) == {"k": (2, 2, 0)}


# -- exchange ------------------------------------------------------------------------------
def test_permits_an_exchange_completion_frees_the_one_its_start_takes(store: Store) -> None:
    """Completions come before starts in one exchange: the permit the completion gives
    back is the one the start takes (without the completion, the start waits)."""
    hot = Permit("k", 1)
    first = running(store, W1, [hot])
    second = grant(store, W1, request())
    permits = needs([second], hot)
    alone = store.exchange(W1, TTL, [], [], [key(second)], permits)
    assert (dict(alone.started), alone.waiting) == ({}, frozenset({second.task_id}))
    done = store.exchange(
        W1, TTL, [Completion(first.task_id, first.epoch, first.token, SUCCEEDED)], [],
        [key(second)], permits)
    assert done.completed == {first.task_id: "applied"}
    assert set(done.started) == {second.task_id} and done.waiting == frozenset()
    assert claim(store, second.task_id).state == RUNNING
    assert usage(store) == {"k": (1, 1, 0)}


# -- without permits -------------------------------------------------------------------------
def test_permits_none_given_behave_as_before(store: Store) -> None:
    """No ``permits`` (or none for this lease): every live reservation starts, nothing
    waits, nothing is counted, even while a key is full."""
    grants = [grant(store, W1, request()) for _ in range(3)]
    started, waiting = start(store, W1, grants, None)
    assert set(started) == {g.task_id for g in grants} and waiting == set()
    assert store.permit_usage() == []
    done = store.exchange(W1, TTL, [], [], [key(grant(store, W1, request()))])
    assert len(done.started) == 1 and done.waiting == frozenset()
    assert store.permit_usage() == []
    # A key that is full does not hold back a start that does not ask for it.
    hot = Permit("k", 1)
    running(store, W1, [hot])
    free = grant(store, W1, request())
    started, waiting = start(store, W1, [free], {uuid.uuid4().hex: [hot]})
    assert set(started) == {free.task_id} and waiting == set()
    assert usage(store) == {"k": (1, 1, 0)}


# -- concurrency ---------------------------------------------------------------------------------
def test_permits_concurrent_starts_on_many_stores_never_exceed_the_limit(store: Store) -> None:
    """Six workers, each with its own store (own connections), start claims needing a
    permit of limit 3 as fast as they can. Counted in Python between a start's answer
    and the completion being sent (so never more than the store holds), at most 3 run
    at once, and 3 do (else the test proves nothing)."""
    limit, workers, rounds = 3, 6, 25
    hot = Permit("hot", limit)
    handles = contextlib.ExitStack()
    stores = [handles.enter_context(other_handle(store)) for _ in range(workers)]
    lock = threading.Condition()
    now = [0]
    peak = [0]
    refusals = [0]
    errors: list[BaseException] = []
    barrier = threading.Barrier(workers)

    def work(store: Store, holder: str) -> None:
        try:
            barrier.wait()
            for _ in range(rounds):
                g = grant(store, holder, request())
                deadline = time.monotonic() + 20
                while True:
                    waiting: set[str] = set()
                    started = store.start_many(holder, [key(g)], TTL, {g.task_id: [hot]},
                                               waiting)
                    if g.task_id in started:
                        break
                    assert waiting == {g.task_id}, (started, waiting)
                    with lock:
                        refusals[0] += 1
                    assert time.monotonic() < deadline, "never got a permit"
                    time.sleep(0.002)
                with lock:
                    now[0] += 1
                    peak[0] = max(peak[0], now[0])
                    lock.notify_all()
                    # Until the limit was reached once (at most 250 ms): runs overlap
                    # whatever the store's speed.
                    lock.wait_for(lambda: peak[0] >= limit, timeout=0.25)
                time.sleep(0.01)  # the task's work
                with lock:
                    now[0] -= 1
                assert complete(store, holder, g) == "applied"
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(s, f"racer{i}@host"))
               for i, s in enumerate(stores)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    finally:
        handles.close()
    assert errors == []
    assert peak[0] <= limit, f"{peak[0]} ran at once under a limit of {limit}"
    assert peak[0] == limit, f"only {peak[0]} ran at once: the limit was never reached"
    assert refusals[0] > 0  # starts did contend for the permit
    assert usage(store) == {"hot": (limit, 0, 0)}


def test_permits_a_waiter_started_without_them_holds_none(store: Store) -> None:
    """Only a start that took the permit holds it: a waiting claim that some other path
    starts without permits (a worker that doesn't declare the limit) counts for nothing,
    so the key's holders stay exact."""
    k = Permit("k", 1)
    first = running(store, W1, [k])
    g = grant(store, W1, request())
    assert start(store, W1, [g], needs([g], k)) == ({}, {g.task_id})
    started, _ = start(store, W1, [g], None)
    assert set(started) == {g.task_id}
    assert usage(store) == {"k": (1, 1, 0)}
    complete(store, W1, first, SUCCEEDED)
    assert usage(store) == {"k": (1, 0, 0)}
    running(store, W2, [k])  # the key is free: g took no permit


def test_permits_signals_reach_other_stores_and_a_cut_connection_is_unavailable(
        sql_store: SqlStore) -> None:
    """SQL only: PostgreSQL's NOTIFY between two workers' stores; elsewhere there are none
    (waiters poll). A listener whose connection the server cut reports the store unavailable (the
    signal thread backs off and says so), not a raw driver error."""
    sender_ctx = sql_store.permit_signals()
    if not sql_store.dialect.is_postgres:
        assert sender_ctx is None
        return
    other = open_store(sql_store.engine.url.render_as_string(hide_password=False),
                       check_schema=False)
    try:
        listener_ctx = other.permit_signals()
        assert sender_ctx is not None and listener_ctx is not None
        with sender_ctx as sender, listener_ctx as listener:
            sender.send(["k1", "k2"])
            got: set[str] = set()
            deadline = time.monotonic() + 10
            while got != {"k1", "k2"} and time.monotonic() < deadline:
                got |= listener.receive(1.0)
            assert got == {"k1", "k2"}
            pid = listener._conn.info.backend_pid  # type: ignore[attr-defined]
            with sql_store.engine.connect() as conn:
                conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            with pytest.raises(StoreUnavailable):
                listener.receive(5.0)
    finally:
        other.close()
