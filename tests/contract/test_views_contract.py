"""What operators read of the store (``find_claims``, ``claim_detail``, ``list_review``,
``oldest_review_since``, ``permit_usage``) and the review decisions on a claim that moved
on (``Moved``), on every store (``store``: memory, SQLite, PostgreSQL, MariaDB).

Expiry is by the store clock: the tests grant short leases and poll the store until
they have run out, never sleep a fixed time.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from celery_pulse.errors import InvalidConfig, Moved, NotFound
from celery_pulse.store.base import (
    FAILED,
    NEEDS_REVIEW,
    OPEN,
    RESERVED,
    RUNNING,
    SUCCEEDED,
    Completion,
    Grant,
    Permit,
    ReserveRequest,
    Store,
)
from celery_pulse.store.pages import ClaimDetail, ClaimQuery
from celery_pulse.store.records import ClaimInfo
from tests.contract.test_recover_contract import celery_message, wait_expired

HOLDER, OTHER, SCANNER = "w1@host", "w2@host", "review:bob@host"
SHORT, LONG = 0.05, 60.0
NAME = "proj.tasks.charge"


def new_id() -> str:
    return str(uuid.uuid4())


def req(task_id: str, *, name: str = NAME, queue: str = "billing", policy: str = "redispatch",
        max_attempts: int = 5) -> ReserveRequest:
    return ReserveRequest(task_id, name, celery_message(task_id, name, queue), policy,
                          max_attempts)


def reserve(store: Store, *requests: ReserveRequest, holder: str = HOLDER,
            ttl: float = LONG) -> list[Grant]:
    grants = store.reserve(holder, list(requests), ttl)
    assert all(isinstance(g, Grant) for g in grants), grants
    return [g for g in grants if isinstance(g, Grant)]


def every_page(store: Store, query: ClaimQuery) -> list[list[ClaimInfo]]:
    """Every page of ``query``, following the cursors to the end."""
    pages = []
    while True:
        page = store.find_claims(query)
        pages.append(page.rows)
        if page.next is None:
            return pages
        query = ClaimQuery(query.states, query.queue, query.task_name, query.worker,
                           query.limit, page.next)


def frozen(store: Store, task_id: str) -> tuple[ClaimDetail, float | None]:
    """The claim's detail without the lease's remainder (it moves with the clock), and
    the lease's end, to within a second."""
    detail = store.claim_detail(task_id)
    assert detail is not None
    remaining = detail.claim.lease_remaining
    until = None if remaining is None else store.now() + remaining
    return dataclasses.replace(detail, claim=dataclasses.replace(
        detail.claim, lease_remaining=None)), until


def in_review(store: Store, *, policy: str = "review", queue: str = "billing",
              name: str = NAME) -> str:
    """A claim Recover moved to needs_review: started by HOLDER at epoch 1, lease lost."""
    tid = new_id()
    (g,) = reserve(store, req(tid, policy=policy, queue=queue, name=name))
    assert store.start(HOLDER, tid, g.epoch, g.token, SHORT) is not None
    wait_expired(store, [tid])
    (item,) = store.recover("w3@host", 10, LONG)
    assert item.state == NEEDS_REVIEW
    return tid


# -- pages ---------------------------------------------------------------------------------
def test_find_claims_filters_by_state_queue_task_name_and_worker_with_totals(
        store: Store) -> None:
    a, b, c, d, e = (new_id() for _ in range(5))
    reserve(store, req(a, queue="billing"), req(b, queue="mail", name="proj.tasks.send"))
    (gc,) = reserve(store, req(c, queue="mail"), holder=OTHER)
    (gd,) = reserve(store, req(d, queue="billing", name="proj.tasks.send"), holder=OTHER)
    reserve(store, req(e, queue="billing"))
    assert store.start(OTHER, c, gc.epoch, gc.token, LONG) is not None
    assert store.complete(OTHER, [Completion(d, gd.epoch, gd.token, SUCCEEDED)]) == {
        d: "applied"}

    def ids(query: ClaimQuery) -> set[str]:
        page = store.find_claims(query)
        assert page.total == len(page.rows) and page.next is None
        return {row.task_id for row in page.rows}

    assert ids(ClaimQuery()) == {a, b, c, d, e}
    assert ids(ClaimQuery(states=(RESERVED,))) == {a, b, e}
    assert ids(ClaimQuery(states=(RUNNING, SUCCEEDED))) == {c, d}
    assert ids(ClaimQuery(queue="mail")) == {b, c}
    assert ids(ClaimQuery(task_name="proj.tasks.send")) == {b, d}
    assert ids(ClaimQuery(worker=OTHER)) == {c, d}
    assert ids(ClaimQuery(states=(RESERVED,), queue="billing", worker=HOLDER)) == {a, e}
    assert ids(ClaimQuery(queue="nowhere")) == set()
    row = next(r for r in store.find_claims(ClaimQuery(states=(RUNNING,))).rows)
    assert (row.task_id, row.queue, row.holder, row.state) == (c, "mail", OTHER, RUNNING)
    assert row.lease_remaining is not None and 0 < row.lease_remaining <= LONG


def test_the_queue_is_kept_at_every_reservation(store: Store) -> None:
    """A first reservation, a re-grant of an expired one (MySQL's other statement), and
    the hot path's exchange (PostgreSQL's pipeline) all keep the delivery's routing key."""
    first, again, exchanged = new_id(), new_id(), new_id()
    reserve(store, req(first, queue="billing"))
    reserve(store, req(again, queue="billing"), ttl=SHORT)
    wait_expired(store, [again])
    reserve(store, req(again, queue="mail"), holder=OTHER)
    done = store.exchange(HOLDER, LONG, [], [req(exchanged, queue="reports")], [])
    assert isinstance(done.reserved[0], Grant)
    queues = {r.task_id: r.queue for r in store.find_claims(ClaimQuery()).rows}
    assert queues == {first: "billing", again: "mail", exchanged: "reports"}
    assert [r.task_id for r in store.find_claims(ClaimQuery(queue="mail")).rows] == [again]


def test_find_claims_pages_visit_every_row_once_newest_first(store: Store) -> None:
    """Three batches (one ``created_at`` each): the task id breaks the ties."""
    batches = [[new_id() for _ in range(n)] for n in (9, 7, 7)]
    for batch in batches:
        reserve(store, *(req(t, queue="mail" if i % 2 else "billing")
                         for i, t in enumerate(batch)))
    every = {t for batch in batches for t in batch}
    pages = every_page(store, ClaimQuery(limit=5))
    assert [len(p) for p in pages] == [5, 5, 5, 5, 3]
    rows = [row for page in pages for row in page]
    assert len(rows) == len(every) and {r.task_id for r in rows} == every
    keys = [(r.created_at, r.task_id) for r in rows]
    assert keys == sorted(keys, reverse=True)
    assert all(store.find_claims(ClaimQuery(limit=5)).total == 23 for _ in range(2))
    # The same under a filter, the total counting every page.
    mail = {t for batch in batches for i, t in enumerate(batch) if i % 2}
    filtered = every_page(store, ClaimQuery(queue="mail", limit=3))
    assert [r.task_id for p in filtered for r in p] == [r.task_id for r in rows
                                                        if r.task_id in mail]
    assert store.find_claims(ClaimQuery(queue="mail", limit=3)).total == len(mail)


def test_find_claims_cursor_is_stable_while_claims_arrive(store: Store) -> None:
    old = [new_id() for _ in range(6)]
    reserve(store, *(req(t) for t in old))
    first = store.find_claims(ClaimQuery(limit=4))
    reserve(store, *(req(new_id()) for _ in range(3)))  # newer: before the first page
    rest = every_page(store, ClaimQuery(limit=4, after=first.next))
    seen = [r.task_id for r in first.rows] + [r.task_id for p in rest for r in p]
    assert sorted(seen) == sorted(old) and len(seen) == len(set(seen))


def test_find_claims_rejects_bad_input_naming_the_valid_values(store: Store) -> None:
    with pytest.raises(InvalidConfig, match="valid states are reserved, running, open, "
                                            "succeeded, failed, needs_review, revoked"):
        store.find_claims(ClaimQuery(states=("done",)))
    for limit in (0, 501):
        with pytest.raises(InvalidConfig, match="limit must be an integer from 1 to 500"):
            store.find_claims(ClaimQuery(limit=limit))
    with pytest.raises(InvalidConfig, match="invalid page cursor"):
        store.find_claims(ClaimQuery(after="not-a-cursor"))


def test_claim_detail_shows_evidence_reviews_and_the_message(store: Store) -> None:
    tid = new_id()
    (g,) = reserve(store, req(tid, max_attempts=1), ttl=SHORT)
    wait_expired(store, [tid])
    (failed,) = store.recover(SCANNER, 10, LONG)
    assert failed.state == FAILED
    # The lost attempt reports late: kept as evidence.
    assert store.complete(HOLDER, [Completion(tid, g.epoch, g.token, SUCCEEDED)]) == {
        tid: "evidence"}
    store.review_retry(tid, SCANNER, LONG, "bob@host", "once more")
    detail = store.claim_detail(tid)
    assert detail is not None
    assert (detail.claim.task_id, detail.claim.state, detail.claim.queue) == (
        tid, OPEN, "billing")
    assert detail.retries == 0 and detail.args_summary == "(42,) {'amount': 10}"
    assert [(e.epoch, e.holder, e.outcome) for e in detail.evidence] == [
        (1, HOLDER, SUCCEEDED)]
    assert [(r.action, r.note, r.decided_by) for r in detail.reviews] == [
        ("retry", "once more", "bob@host")]
    assert store.claim_detail(new_id()) is None


# -- the review queue ----------------------------------------------------------------------
def test_review_item_moved_by_recover_says_why_and_since_when(store: Store) -> None:
    assert store.oldest_review_since() is None
    before = store.now()
    tid = in_review(store)
    after = store.now()
    (item,) = store.list_review()
    assert item.task_id == tid and item.epoch == 2
    assert item.reason == (f"holder {HOLDER} lost its lease at epoch 1 after it started; "
                           f"outcome unknown")
    assert item.entered_at is not None and before <= item.entered_at <= after
    assert store.oldest_review_since() == item.entered_at
    # Retention never takes a review item, however old its entry time.
    store.purge_finished(0.0)
    assert [i.task_id for i in store.list_review()] == [tid]


def test_review_item_a_completion_sent_there_gives_its_error(store: Store) -> None:
    tid = new_id()
    (g,) = reserve(store, req(tid))
    before = store.now()
    assert store.complete(HOLDER, [Completion(tid, g.epoch, g.token, NEEDS_REVIEW,
                                              "WorkerLostError: killed by signal 9")]) == {
        tid: "applied"}
    (item,) = store.list_review()
    assert item.reason == "WorkerLostError: killed by signal 9"
    assert item.entered_at is not None and item.entered_at >= before


def test_list_review_filters_and_lists_failed_claims_with_their_budget(store: Store) -> None:
    billing = in_review(store, queue="billing")
    mail = in_review(store, queue="mail", name="proj.tasks.send")
    exhausted = new_id()
    reserve(store, req(exhausted, max_attempts=1), ttl=SHORT)
    wait_expired(store, [exhausted])
    store.recover(SCANNER, 10, LONG)
    assert [i.task_id for i in store.list_review()] == [billing, mail]
    assert [i.task_id for i in store.list_review(query=ClaimQuery(queue="mail"))] == [mail]
    assert [i.task_id for i in store.list_review(
        query=ClaimQuery(task_name=NAME, worker=HOLDER))] == [billing]
    (failed,) = store.list_review(query=ClaimQuery(states=(FAILED,)))
    assert (failed.task_id, failed.reason) == (exhausted, "budget of 1 attempts exhausted")
    assert len(store.list_review(limit=1)) == 1
    with pytest.raises(InvalidConfig, match="valid states are needs_review, failed"):
        store.list_review(query=ClaimQuery(states=(RUNNING,)))


def test_review_retry_twice_says_it_moved_on_and_changes_nothing(store: Store) -> None:
    tid = in_review(store)
    store.review_retry(tid, SCANNER, LONG, "bob@host", None, expected_epoch=2)
    before, until = frozen(store, tid)
    with pytest.raises(Moved, match=rf"task {tid} is open at epoch 3 \(retried by bob@host "
                                    r"at \d{4}-\d\d-\d\dT[\d:]+Z\): nothing was changed"):
        store.review_retry(tid, SCANNER, LONG, "eve@host", None, expected_epoch=2)
    with pytest.raises(Moved):  # without an expected epoch too: open is not reviewable
        store.review_retry(tid, SCANNER, LONG, "eve@host", None)
    after, still = frozen(store, tid)
    assert after == before  # same state, epoch, holder, audit
    assert until is not None and still == pytest.approx(until, abs=1.0)  # same lease


def test_review_resolve_after_a_retry_says_it_moved_on(store: Store) -> None:
    tid = in_review(store)
    store.review_retry(tid, SCANNER, LONG, "bob@host", None)
    with pytest.raises(Moved, match=rf"task {tid} is open at epoch 3 \(retried by bob@host"):
        store.review_resolve(tid, SUCCEEDED, "eve@host", None, expected_epoch=2)
    assert [r.action for r in store.claim_detail(tid).reviews] == ["retry"]  # type: ignore[union-attr]
    store.review_resolve(in_review(store), FAILED, "bob@host", "refunded")
    (resolved,) = store.list_review(query=ClaimQuery(states=(FAILED,)))
    assert resolved.reason == "resolved by bob@host: refunded"  # failed: still retryable
    with pytest.raises(NotFound) as missing:
        store.review_resolve(new_id(), SUCCEEDED, "bob@host", None)
    assert not isinstance(missing.value, Moved)


def test_review_decision_on_another_epoch_says_it_moved_on(store: Store) -> None:
    tid = in_review(store)
    with pytest.raises(Moved, match=rf"task {tid} is needs_review at epoch 2: nothing"):
        store.review_resolve(tid, SUCCEEDED, "bob@host", None, expected_epoch=1)
    with pytest.raises(Moved, match=rf"task {tid} is needs_review at epoch 2: nothing"):
        store.review_retry(tid, SCANNER, LONG, "bob@host", None, expected_epoch=1)
    (item,) = store.list_review()
    assert item.epoch == 2 and store.claim_detail(tid).reviews == []  # type: ignore[union-attr]
    store.review_resolve(tid, SUCCEEDED, "bob@host", None, expected_epoch=2)
    assert store.list_review() == []


# -- permits -------------------------------------------------------------------------------
def test_permit_usage_names_when_the_oldest_waiter_began(store: Store) -> None:
    runner, first, second = new_id(), new_id(), new_id()
    permit = {"k": Permit("k", 1)}
    (g0,) = reserve(store, req(runner))
    assert set(store.start_many(HOLDER, [(runner, g0.epoch, g0.token)], LONG,
                                {runner: [permit["k"]]})) == {runner}
    (usage,) = store.permit_usage()
    assert usage.oldest_waiting_since is None
    (g1,) = reserve(store, req(first))
    (g2,) = reserve(store, req(second))
    info = {r.task_id: r for r in store.find_claims(ClaimQuery()).rows}
    waiting: set[str] = set()
    store.start_many(HOLDER, [(second, g2.epoch, g2.token), (first, g1.epoch, g1.token)], LONG,
                     {first: [permit["k"]], second: [permit["k"]]}, waiting)
    assert waiting == {first, second}
    (usage,) = store.permit_usage()
    assert (usage.running, usage.waiting) == (1, 2)
    assert usage.oldest_waiting_since == pytest.approx(info[first].created_at)
