"""The rate-limit contract (issue 39): a :class:`Permit` with a ``window`` in
``ClaimStore.start_many``, on every store.

A start of a rate key is granted only while fewer than ``limit`` of the key's granted
starts are younger than ``window`` (the store's clock); each granted start counts for its
window whatever becomes of its claim, and a refused one stays ``reserved``, reported
waiting. Time passes for real here (short windows, then polling the store, never a sleep
standing in for it).
"""

from __future__ import annotations

import contextlib
import threading
import time

from celery_pulse.store.base import FAILED, RESERVED, RUNNING, Permit, Store
from celery_pulse.testing import wait_for
from tests.contract.test_claims_contract import W1, W2, claim, complete, grant, key, request
from tests.contract.test_permits_contract import needs, start, usage
from tests.helpers.stores import other_handle


def test_rates_at_most_limit_starts_per_window_and_then_more_once_it_passes(
        store: Store) -> None:
    """Limit 3 per 1 s: of five starts in one call three go, two wait; the key holds no
    concurrency (the three end, nothing is freed); once the window passes, two more go."""
    rate = Permit("rate:task:t", 3, 1.0)
    grants = [grant(store, W1, request()) for _ in range(5)]
    started, waiting = start(store, W1, grants, needs(grants, rate))
    assert set(started) == {g.task_id for g in grants[:3]}
    assert waiting == {g.task_id for g in grants[3:]}
    # Seen as a rate: its window, the starts in it, the waiters.
    assert usage(store) == {"rate:task:t": (3, 3, 2)}
    assert [u.window for u in store.permit_usage()] == [1.0]
    for g in grants[:3]:  # ended at once: a start counts for its window all the same
        assert complete(store, W1, g) == "applied"
    assert start(store, W1, grants[3:], needs(grants[3:], rate))[0] == {}
    assert claim(store, grants[3].task_id).state == RESERVED
    late = grants[3:]

    def later() -> bool:
        return bool(start(store, W1, late, needs(late, rate))[0])
    wait_for(later, 5, "the window to pass")
    assert claim(store, grants[3].task_id).state == RUNNING


def test_rates_a_granted_start_counts_even_when_its_claim_failed_at_once(
        store: Store) -> None:
    """Limit 1 per 60 s: the start's claim failing does not give the start back."""
    rate = Permit("rate:task:once", 1, 60.0)
    first, second = grant(store, W1, request()), grant(store, W1, request())
    assert set(start(store, W1, [first], needs([first], rate))[0]) == {first.task_id}
    assert complete(store, W1, first, FAILED, "boom") == "applied"
    assert start(store, W1, [second], needs([second], rate)) == ({}, {second.task_id})


def test_rates_and_concurrency_on_one_start_both_bind(store: Store) -> None:
    """A start needing a concurrency permit of 1 and a rate of 5/60 s: the second start
    waits for the permit (not the rate); the rate's count is only of granted starts."""
    permit, rate = Permit("task:both", 1), Permit("rate:task:both", 5, 60.0)
    first, second = grant(store, W1, request()), grant(store, W1, request())
    assert set(start(store, W1, [first], needs([first], permit, rate))[0]) == {first.task_id}
    assert start(store, W1, [second], needs([second], permit, rate)) == ({}, {second.task_id})
    assert complete(store, W1, first) == "applied"
    assert set(start(store, W1, [second], needs([second], permit, rate))[0]) == {
        second.task_id}
    assert usage(store)["task:both"][1:] == (1, 0)


def test_rates_concurrent_starts_on_many_stores_never_exceed_the_rate(store: Store) -> None:
    """Four workers with stores of their own start as fast as they can under 10 per
    0.5 s for 1.6 s: the starts the store granted, at the times it recorded (a claim's
    start time is the one its rate counts), never number more than 10 in any 0.5 s, and
    the window turned over."""
    limit, window, workers = 10, 0.5, 4
    rate = Permit("rate:task:race", limit, window)
    handles = contextlib.ExitStack()
    stores = [handles.enter_context(other_handle(store)) for _ in range(workers)]
    granted: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    until = time.monotonic() + 1.6

    def work(mine: Store, holder: str) -> None:
        try:
            g = grant(mine, holder, request())
            while time.monotonic() < until:
                if mine.start_many(holder, [key(g)], 30.0, {g.task_id: [rate]}, set()):
                    with lock:
                        granted.append(g.task_id)
                    g = grant(mine, holder, request())
                else:
                    time.sleep(0.002)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s, f"rater{i}@host"))
               for i, s in enumerate(stores)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        handles.close()
    assert errors == []
    times = sorted(float(claim(store, task_id).started_at or 0) for task_id in granted)
    most = max(sum(1 for t in times if s - window < t <= s) for s in times)
    assert len(times) >= 2 * limit, times  # the window turned over at least once
    assert most <= limit, f"{most} starts within {window}s under a limit of {limit}"


def test_rates_other_holders_share_the_key(store: Store) -> None:
    rate = Permit("rate:queue:q", 2, 60.0)
    mine = [grant(store, W1, request()) for _ in range(2)]
    theirs = grant(store, W2, request())
    assert len(start(store, W1, mine, needs(mine, rate))[0]) == 2
    assert start(store, W2, [theirs], needs([theirs], rate)) == ({}, {theirs.task_id})
