"""The Recover and review contract (``RecoverStore`` in ``celery_pulse.store.contracts``).

Each test runs on every store (``store``: memory, SQLite, PostgreSQL, MariaDB; the store
is in the test id).
Expiry is by the store clock: the tests grant short leases and poll the store until
they have run out, never sleep a fixed time.
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Sequence

import pytest

from celery_pulse.errors import InvalidConfig, NotFound
from celery_pulse.store.base import (
    FAILED,
    NEEDS_REVIEW,
    OPEN,
    RESERVED,
    RUNNING,
    SUCCEEDED,
    ClaimInfo,
    Completion,
    Grant,
    Message,
    Recovered,
    Refusal,
    ReserveRequest,
    Store,
)
from celery_pulse.testing import wait_for
from tests.helpers.stores import other_handle, review_audit

HOLDER = "w1@host"
SCANNER = "w2@host"
SHORT = 0.05  # seconds: a lease that is expired by the time the test polls
LONG = 60.0
#: How long a test waits for something the store clock decides.
WAIT = 15.0


# -- helpers ---------------------------------------------------------------------------
def celery_message(task_id: str, name: str = "proj.tasks.charge", queue: str = "billing"
                   ) -> Message:
    """A message shaped like Celery's task protocol 2 (what a worker would store)."""
    body = json.dumps([[42], {"amount": 10}, {"callbacks": None, "errbacks": None,
                                              "chain": None, "chord": None}]).encode()
    headers = {"lang": "py", "task": name, "id": task_id, "root_id": task_id,
               "parent_id": None, "group": None, "retries": 0, "eta": None, "expires": None,
               "argsrepr": "(42,)", "kwargsrepr": "{'amount': 10}", "origin": "gen1@host",
               "ignore_result": False}
    properties = {"correlation_id": task_id, "reply_to": str(uuid.uuid5(uuid.NAMESPACE_URL, task_id)),
                  "delivery_mode": 2, "priority": 0, "content_type": "application/json",
                  "content_encoding": "utf-8"}
    return Message(body, headers, properties, {"exchange": queue, "routing_key": queue},
                   "application/json", "utf-8")


def request(task_id: str, *, policy: str = "redispatch", max_attempts: int = 5
            ) -> ReserveRequest:
    return ReserveRequest(task_id, "proj.tasks.charge", celery_message(task_id), policy,
                          max_attempts)


def new_id() -> str:
    return str(uuid.uuid4())


def reserve(store: Store, task_id: str, *, ttl: float = LONG, holder: str = HOLDER,
            policy: str = "redispatch", max_attempts: int = 5) -> Grant:
    (grant,) = store.reserve(holder, [request(task_id, policy=policy,
                                              max_attempts=max_attempts)], ttl)
    assert isinstance(grant, Grant), grant
    return grant


def started(store: Store, task_id: str, *, ttl: float = SHORT, policy: str = "redispatch",
            max_attempts: int = 5) -> Grant:
    """A running claim whose lease lasts ``ttl``."""
    grant = reserve(store, task_id, policy=policy, max_attempts=max_attempts)
    assert store.start(HOLDER, task_id, grant.epoch, grant.token, ttl) is not None
    return grant


def claim(store: Store, task_id: str) -> ClaimInfo:
    found = [c for c in store.list_claims(limit=10_000) if c.task_id == task_id]
    assert len(found) == 1, found
    return found[0]


def wait_expired(store: Store, task_ids: Sequence[str]) -> None:
    """Until every lease of ``task_ids`` has run out by the store clock."""
    wanted = set(task_ids)

    def expired() -> bool:
        rows = [c for c in store.list_claims(limit=10_000) if c.task_id in wanted]
        return len(rows) == len(wanted) and all(
            c.lease_remaining is not None and c.lease_remaining <= 0 for c in rows)
    wait_for(expired, timeout=WAIT, what=f"{len(wanted)} lease(s) to expire by the store clock")


def audit(store: Store) -> list[tuple[str, str, str | None, str | None, str]]:
    return review_audit(store)


def only(items: list[Recovered]) -> Recovered:
    assert len(items) == 1, items
    return items[0]


# -- takeover verdicts ---------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["redispatch", "review"])
def test_expired_reservation_reopens_under_a_new_epoch_and_token(store: Store,
                                                                 policy: str) -> None:
    """Never started: safe to re-dispatch whatever the task's policy."""
    tid = new_id()
    grant = reserve(store, tid, ttl=SHORT, policy=policy)
    wait_expired(store, [tid])

    item = only(store.recover(SCANNER, 10, LONG))
    assert (item.task_id, item.state, item.was, item.epoch) == (tid, OPEN, RESERVED, 2)
    assert item.holder == HOLDER  # the holder whose lease ran out, not the scanner
    assert item.token and item.token != grant.token
    assert item.message == celery_message(tid)  # byte-exact, ready to re-publish
    assert item.task_name == "proj.tasks.charge" and item.attempts == 1
    row = claim(store, tid)
    assert (row.state, row.holder, row.epoch, row.attempts) == (OPEN, SCANNER, 2, 1)
    assert row.lease_remaining is not None and LONG - 10 < row.lease_remaining <= LONG
    # The old credential is dead for every operation.
    assert store.start(HOLDER, tid, grant.epoch, grant.token, LONG) is None
    assert store.renew(HOLDER, [(tid, grant.epoch, grant.token)], LONG) == (set(), set())
    assert store.complete(HOLDER, [Completion(tid, grant.epoch, grant.token, SUCCEEDED)]
                              ) == {tid: "evidence"}
    # Under its publish lease, no other scan takes it.
    assert store.recover("w3@host", 10, LONG) == []


def test_expired_running_redispatch_claim_reopens(store: Store) -> None:
    tid = new_id()
    grant = started(store, tid, policy="redispatch")
    wait_expired(store, [tid])
    item = only(store.recover(SCANNER, 10, LONG))
    assert (item.state, item.was, item.epoch) == (OPEN, RUNNING, grant.epoch + 1)
    assert item.holder == HOLDER
    assert item.token and item.token != grant.token
    assert claim(store, tid).state == OPEN


def test_expired_running_review_claim_needs_review(store: Store) -> None:
    tid = new_id()
    grant = started(store, tid, policy="review")
    wait_expired(store, [tid])
    item = only(store.recover(SCANNER, 10, LONG))
    assert (item.state, item.was, item.epoch, item.token) == (NEEDS_REVIEW, RUNNING, 2, None)
    assert item.holder == HOLDER  # who lost it (Flower's task-failed is sent as this host)
    row = claim(store, tid)
    assert (row.state, row.epoch, row.lease_remaining, row.outcome) == (NEEDS_REVIEW, 2, None,
                                                                        "unknown")
    (listed,) = store.list_review()
    assert (listed.task_id, listed.task_name, listed.last_holder, listed.epoch) == (
        tid, "proj.tasks.charge", HOLDER, 2)
    assert "(42,)" in listed.args_summary and "amount" in listed.args_summary
    # Taken once only; a late delivery is refused as terminal; the stale holder's
    # completion is evidence, not the outcome.
    assert store.recover("w3@host", 10, LONG) == []
    (refusal,) = store.reserve("w3@host", [request(tid, policy="review")], LONG)
    assert isinstance(refusal, Refusal) and refusal.reason == "terminal"
    assert store.complete(HOLDER, [Completion(tid, grant.epoch, grant.token, SUCCEEDED)]
                              ) == {tid: "evidence"}
    assert claim(store, tid).state == NEEDS_REVIEW


@pytest.mark.parametrize("was", [RESERVED, RUNNING])
def test_exhausted_budget_fails(store: Store, was: str) -> None:
    tid = new_id()
    if was == RUNNING:
        started(store, tid, policy="redispatch", max_attempts=1)
    else:
        reserve(store, tid, ttl=SHORT, max_attempts=1)
    wait_expired(store, [tid])
    item = only(store.recover(SCANNER, 10, LONG))
    assert (item.state, item.was, item.epoch, item.token) == (FAILED, was, 2, None)
    assert item.holder == HOLDER
    row = claim(store, tid)
    assert (row.state, row.outcome, row.lease_remaining) == (FAILED, "exhausted", None)
    assert row.finished_at is not None
    assert store.recover(SCANNER, 10, LONG) == []


def test_unexpired_and_finished_claims_are_untouched(store: Store) -> None:
    live_reserved, live_running, done, expired = new_id(), new_id(), new_id(), new_id()
    reserve(store, live_reserved)
    started(store, live_running, ttl=LONG)
    g = reserve(store, done, ttl=SHORT)
    assert store.complete(HOLDER, [Completion(done, g.epoch, g.token, SUCCEEDED)]
                              ) == {done: "applied"}
    reserve(store, expired, ttl=SHORT)
    before = {t: claim(store, t) for t in (live_reserved, live_running, done)}
    wait_expired(store, [expired])

    assert [i.task_id for i in store.recover(SCANNER, 10, LONG)] == [expired]
    for tid, old in before.items():
        new = claim(store, tid)
        assert (new.state, new.holder, new.epoch, new.attempts) == (
            old.state, old.holder, old.epoch, old.attempts), tid


def test_batch_limits_each_scan(store: Store) -> None:
    ids = [new_id() for _ in range(5)]
    store.reserve(HOLDER, [request(t) for t in ids], SHORT)
    wait_expired(store, ids)
    first = store.recover(SCANNER, 3, LONG)
    second = store.recover(SCANNER, 3, LONG)
    assert len(first) == 3 and len(second) == 2
    assert {i.task_id for i in first + second} == set(ids)


# -- concurrency -----------------------------------------------------------------------------
def test_two_concurrent_scanners_never_take_the_same_claim(store: Store) -> None:
    ids = [new_id() for _ in range(100)]
    grants = store.reserve(HOLDER, [request(t) for t in ids], SHORT)
    assert all(isinstance(g, Grant) for g in grants)
    wait_expired(store, ids)

    handles = contextlib.ExitStack()
    stores = [handles.enter_context(other_handle(store)) for _ in range(2)]
    barrier = threading.Barrier(2)
    taken: list[list[Recovered]] = [[], []]
    errors: list[BaseException] = []

    def scan(n: int) -> None:
        try:
            barrier.wait(timeout=10)
            while batch := stores[n].recover(f"scanner-{n}", 7, LONG):
                taken[n].extend(batch)
        except BaseException as exc:  # reported below, in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=scan, args=(n,)) for n in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        handles.close()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    a, b = ({i.task_id for i in part} for part in taken)
    assert len(a) == len(taken[0]) and len(b) == len(taken[1])  # no task twice in one scanner
    assert a.isdisjoint(b)
    assert a | b == set(ids)
    assert {(i.epoch, i.state) for part in taken for i in part} == {(2, OPEN)}
    assert {claim(store, t).epoch for t in ids} == {2}
    print(f"\nscanner split: {len(a)} / {len(b)}")


# -- publish lease -----------------------------------------------------------------------------
def test_open_claim_with_expired_publish_lease_is_taken_again(store: Store) -> None:
    """The scanner died between taking the claim and publishing: the next scan retries."""
    tid = new_id()
    reserve(store, tid, ttl=SHORT)
    wait_expired(store, [tid])
    first = only(store.recover(SCANNER, 10, SHORT))
    wait_expired(store, [tid])
    second = only(store.recover("w3@host", 10, LONG))
    assert (second.task_id, second.state, second.was) == (tid, OPEN, OPEN)
    assert (first.holder, second.holder) == (HOLDER, SCANNER)  # the dead scanner held it
    assert second.epoch == first.epoch + 1 and second.token != first.token
    assert second.message == first.message
    assert claim(store, tid).holder == "w3@host"
    # The dead scanner's late confirmation does not count; the live one's does.
    assert first.token is not None and second.token is not None
    assert store.mark_published([(tid, first.epoch, first.token)]) == 0
    assert claim(store, tid).lease_remaining is not None
    assert store.mark_published([(tid, second.epoch, second.token)]) == 1


def test_mark_published_clears_the_lease(store: Store) -> None:
    tid = new_id()
    reserve(store, tid, ttl=SHORT)
    wait_expired(store, [tid])
    t0 = store.now()
    item = only(store.recover(SCANNER, 10, SHORT))
    assert item.token is not None
    assert store.mark_published([(tid, item.epoch, "not-the-token")]) == 0
    assert store.mark_published([(tid, item.epoch, item.token)]) == 1
    assert store.mark_published([(tid, item.epoch, item.token)]) == 0  # token is gone
    row = claim(store, tid)
    assert (row.state, row.holder, row.lease_remaining, row.epoch) == (OPEN, None, None, 2)
    # Past the moment the publish lease would have run out, no scan takes it...
    wait_for(lambda: store.now() > t0 + 10 * SHORT, timeout=WAIT, what="the store clock to move on")
    assert store.recover("w3@host", 10, LONG) == []
    assert store.claim_counts().get("expired", 0) == 0
    # ...and the re-published delivery reserves it under the next epoch.
    grant = reserve(store, tid, holder="w3@host")
    assert (grant.epoch, grant.attempts) == (3, 2)


def test_mark_published_after_the_redelivery_was_reserved_changes_nothing(
        store: Store) -> None:
    """The re-published message can be reserved before the scanner confirms the publish."""
    tid = new_id()
    reserve(store, tid, ttl=SHORT)
    wait_expired(store, [tid])
    item = only(store.recover(SCANNER, 10, LONG))
    grant = reserve(store, tid, holder="w3@host")
    assert grant.epoch == item.epoch + 1
    assert item.token is not None
    assert store.mark_published([(tid, item.epoch, item.token)]) == 0
    row = claim(store, tid)
    assert (row.state, row.holder, row.epoch) == (RESERVED, "w3@host", grant.epoch)
    assert row.lease_remaining is not None and row.lease_remaining > 0
    assert store.start("w3@host", tid, grant.epoch, grant.token, LONG) is not None


# -- review ------------------------------------------------------------------------------------
def needs_review(store: Store) -> str:
    tid = new_id()
    started(store, tid, policy="review")
    wait_expired(store, [tid])
    assert only(store.recover(SCANNER, 10, LONG)).state == NEEDS_REVIEW
    return tid


def test_review_retry_reopens_once_and_is_audited(store: Store) -> None:
    tid = needs_review(store)
    item = store.review_retry(tid, "review:ops", LONG, "ops@host", "checked: not applied")
    assert (item.task_id, item.state, item.was, item.epoch) == (tid, OPEN, NEEDS_REVIEW, 3)
    assert item.token and item.message == celery_message(tid)
    assert store.list_review() == []
    with pytest.raises(NotFound):
        store.review_retry(tid, "review:ops", LONG, "ops@host", None)  # already re-opened
    assert item.token is not None
    assert store.mark_published([(tid, item.epoch, item.token)]) == 1
    grant = reserve(store, tid, holder="w3@host", policy="review")
    assert grant.epoch == 4
    assert audit(store) == [(tid, "retry", None, "checked: not applied", "ops@host")]


def test_review_retry_of_an_exhausted_task_grants_one_more_attempt(store: Store) -> None:
    tid = new_id()
    reserve(store, tid, ttl=SHORT, max_attempts=1)
    wait_expired(store, [tid])
    assert only(store.recover(SCANNER, 10, LONG)).state == FAILED
    item = store.review_retry(tid, "review:ops", LONG, "ops@host", None)
    assert item.token is not None
    store.mark_published([(tid, item.epoch, item.token)])
    grant = reserve(store, tid, holder="w3@host")
    assert grant.attempts == 2
    row = claim(store, tid)
    assert (row.state, row.attempts, row.max_attempts) == (RESERVED, 2, 2)


@pytest.mark.parametrize("outcome", [SUCCEEDED, FAILED])
def test_review_resolve_closes_and_is_audited(store: Store, outcome: str) -> None:
    tid = needs_review(store)
    store.review_resolve(tid, outcome, "ops@host", "refunded by hand")
    row = claim(store, tid)
    assert (row.state, row.outcome) == (outcome, outcome)
    assert row.finished_at is not None
    assert store.list_review() == []
    assert audit(store) == [(tid, "resolve", outcome, "refunded by hand", "ops@host")]
    with pytest.raises(NotFound):
        store.review_resolve(tid, outcome, "ops@host", None)
    (refusal,) = store.reserve("w3@host", [request(tid)], LONG)
    assert isinstance(refusal, Refusal) and refusal.reason == "terminal"


def test_review_rejects_unknown_tasks_and_outcomes(store: Store) -> None:
    live = new_id()
    reserve(store, live)
    with pytest.raises(NotFound):
        store.review_retry(live, "review:ops", LONG, "ops@host", None)
    with pytest.raises(NotFound):
        store.review_resolve(live, SUCCEEDED, "ops@host", None)
    with pytest.raises(NotFound):
        store.review_resolve(new_id(), FAILED, "ops@host", None)
    tid = needs_review(store)
    with pytest.raises(InvalidConfig):
        store.review_resolve(tid, "maybe", "ops@host", None)
    assert claim(store, tid).state == NEEDS_REVIEW
    assert claim(store, live).state == RESERVED
    assert audit(store) == []
