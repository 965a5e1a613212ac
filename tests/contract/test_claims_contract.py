"""The task-claims contract (see ``celery_pulse.store.contracts.ClaimStore``), on every store.

Each test runs once per store (``[memory]``, ``[sqlite]``, ``[postgres]``, ``[mariadb]``);
the few about SQL itself (``lease.fenced`` on a connection, row locks) on the SQL stores.
"Expired" is always decided by the store clock: tests that need an expiry use a short
TTL and poll with a deadline, never compare their own clock with a stored timestamp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_pulse.errors import InvalidConfig, LeaseLost
from celery_pulse.lease import Lease
from celery_pulse.store.base import (
    FAILED,
    NEEDS_REVIEW,
    OPEN,
    RESERVED,
    RETRY,
    REVOKED,
    RUNNING,
    SUCCEEDED,
    ClaimInfo,
    Completion,
    Grant,
    Message,
    Refusal,
    ReserveRequest,
    ResultRecord,
    Store,
)
from celery_pulse.store.records import LOST_TOKEN
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.fence import make_fencer
from celery_pulse.store.sql.tables import claims
from celery_pulse.testing import wait_for
from tests.helpers.stores import claim_row, evidence_rows, other_handle, result_value

TTL = 30.0
W1, W2 = "w1@host", "w2@host"
#: Not valid UTF-8 on purpose: the message must be stored byte-exact.
BODY = b'[["a", 1], {}, {}]\xff\x00\xfe'


# -- helpers ---------------------------------------------------------------------------
def request(task_id: str | None = None, *, max_attempts: int = 10, retries: int = 0,
            policy: str = "redispatch", body: bytes = BODY,
            publication: str | None = None) -> ReserveRequest:
    task_id = task_id or uuid.uuid4().hex
    message = Message(body, {"id": task_id, "task": "proj.add", "retries": retries},
                      {"correlation_id": task_id, "reply_to": "r-1", "priority": 0},
                      {"exchange": "", "routing_key": "celery"},
                      "application/json", "utf-8")
    return ReserveRequest(task_id, "proj.add", message, policy, max_attempts, retries,
                          publication)


def grant(store: Store, holder: str, req: ReserveRequest, ttl: float = TTL) -> Grant:
    (result,) = store.reserve(holder, [req], ttl)
    assert isinstance(result, Grant), result
    return result


def refusal(store: Store, holder: str, req: ReserveRequest, ttl: float = TTL) -> Refusal:
    (result,) = store.reserve(holder, [req], ttl)
    assert isinstance(result, Refusal), result
    return result


def key(g: Grant) -> tuple[str, int, str]:
    return (g.task_id, g.epoch, g.token)


def claim(store: Store, task_id: str) -> ClaimInfo:
    found = [c for c in store.list_claims() if c.task_id == task_id]
    assert len(found) == 1, found
    return found[0]


def row(store: Store, task_id: str) -> Any:
    """The claim's row as the store keeps it (see :func:`tests.helpers.stores.claim_row`)."""
    return claim_row(store, task_id)


def expired(store: Store, task_id: str) -> bool:
    remaining = claim(store, task_id).lease_remaining
    return remaining is not None and remaining <= 0


def complete(store: Store, holder: str, g: Grant, outcome: str = SUCCEEDED,
             error: str | None = None) -> str:
    result = store.complete(holder, [Completion(g.task_id, g.epoch, g.token, outcome, error)])
    return result[g.task_id]


# -- reserve -----------------------------------------------------------------------------
def test_reserve_grants_epoch_1_and_stores_the_message_byte_exact(store: Store) -> None:
    req = request()
    g = grant(store, W1, req)
    assert (g.epoch, g.attempts) == (1, 1)
    assert len(g.token) >= 32 and g.token not in repr(g)  # 128 bits of hex, masked in repr
    info = claim(store, req.task_id)
    assert (info.state, info.holder, info.epoch, info.task_name) == (RESERVED, W1, 1, "proj.add")
    assert info.lease_remaining is not None and TTL - 5 < info.lease_remaining <= TTL
    stored = row(store, req.task_id)
    assert bytes(stored.body) == BODY
    assert stored.token == g.token
    assert (stored.content_type, stored.content_encoding) == ("application/json", "utf-8")
    assert json.loads(stored.headers)["id"] == req.task_id
    assert json.loads(stored.properties)["reply_to"] == "r-1"
    assert json.loads(stored.delivery_info)["routing_key"] == "celery"


def test_tokens_are_fresh_per_grant(store: Store) -> None:
    tokens = {grant(store, W1, request()).token for _ in range(20)}
    assert len(tokens) == 20


def test_second_holder_is_refused_taken(store: Store) -> None:
    req = request()
    g = grant(store, W1, req)
    r = refusal(store, W2, req)
    assert (r.reason, r.state, r.holder, r.epoch) == ("taken", RESERVED, W1, 1)
    assert row(store, req.task_id).token == g.token  # untouched


def test_a_live_lease_is_not_granted_again_even_to_its_holder(store: Store) -> None:
    """One holder never holds two live grants of one task (two deliveries in flight)."""
    req = request()
    first = grant(store, W1, req)
    r = refusal(store, W1, req)
    assert (r.reason, r.state, r.holder, r.epoch) == ("taken", RESERVED, W1, 1)
    assert store.renew(W1, [key(first)], TTL) == ({req.task_id}, set())
    # Released (expired now), the same holder may take it under a new epoch; the old
    # credential no longer renews.
    store.release(W1, [key(first)])
    again = grant(store, W1, req)
    assert (again.epoch, again.attempts) == (2, 2)
    assert again.token != first.token
    assert store.renew(W1, [key(first)], TTL) == (set(), set())


def test_same_id_twice_in_one_batch_is_granted_once(store: Store) -> None:
    req = request()
    results = store.reserve(W1, [req, req], TTL)
    assert isinstance(results[0], Grant) and isinstance(results[1], Refusal)
    assert results[1].reason == "taken"


def test_a_batch_mixes_grants_and_refusals(store: Store) -> None:
    held = request()
    grant(store, W2, held)
    fresh = [request() for _ in range(5)]
    results = store.reserve(W1, [fresh[0], held, *fresh[1:]], TTL)
    assert [type(r).__name__ for r in results] == ["Grant", "Refusal", *["Grant"] * 4]
    assert [r.task_id for r in results] == [fresh[0].task_id, held.task_id,
                                           *(f.task_id for f in fresh[1:])]


def test_finished_claim_is_refused_terminal(store: Store) -> None:
    req = request()
    g = grant(store, W1, req)
    assert complete(store, W1, g) == "applied"
    for holder in (W1, W2):
        r = refusal(store, holder, req)
        assert (r.reason, r.state) == ("terminal", SUCCEEDED)
    info = claim(store, req.task_id)
    assert (info.state, info.epoch, info.attempts) == (SUCCEEDED, 1, 1)


def test_exhausted_budget_fails_the_claim(store: Store) -> None:
    req = request(max_attempts=2)
    store.release(W1, [key(grant(store, W1, req))])
    second = grant(store, W1, req)
    assert second.attempts == 2
    store.release(W1, [key(second)])
    wait_for(lambda: expired(store, req.task_id), what="the release to expire the lease")
    r = refusal(store, W2, req)
    assert r.reason == "exhausted"
    info = claim(store, req.task_id)
    assert (info.state, info.attempts, info.holder) == (FAILED, 2, W1)
    assert info.lease_remaining is None
    assert info.error and "exhausted" in info.error
    # From now on it is simply finished.
    assert refusal(store, W2, req).reason == "terminal"


def test_running_review_claim_is_not_regranted_even_to_its_holder(store: Store) -> None:
    req = request(policy="review")
    g = grant(store, W1, req)
    assert store.start(W1, req.task_id, g.epoch, g.token, TTL) is not None
    assert refusal(store, W1, req).reason == "taken"
    assert refusal(store, W2, req).reason == "taken"
    assert claim(store, req.task_id).state == RUNNING


# -- publications: a redelivery is a duplicate, a new publication of the id runs again ----
def test_redelivery_of_a_finished_publication_is_refused(store: Store) -> None:
    req = request(publication="p1")
    complete(store, W1, grant(store, W1, req))
    r = refusal(store, W2, req)
    assert (r.reason, r.state, r.publication) == ("terminal", SUCCEEDED, "p1")


@pytest.mark.parametrize("outcome", [SUCCEEDED, FAILED, REVOKED])
def test_new_publication_of_a_finished_task_runs_again(store: Store, outcome: str) -> None:
    first = request(publication="p1", max_attempts=1)
    complete(store, W1, grant(store, W1, first), outcome)
    again = grant(store, W2, request(first.task_id, publication="p2", max_attempts=1))
    assert (again.epoch, again.attempts) == (2, 1)  # a new publication has its own budget
    info = claim(store, first.task_id)
    assert (info.state, info.holder, info.outcome) == (RESERVED, W2, None)
    # ... and now p2 is the claim's publication: p1 again is a new one, p2 a duplicate.
    assert refusal(store, W1, request(first.task_id, publication="p2")).reason == "taken"


def test_new_publication_waits_while_the_previous_run_is_live(store: Store) -> None:
    req = request(publication="p1")
    g = grant(store, W1, req)
    store.start(W1, req.task_id, g.epoch, g.token, TTL)
    r = refusal(store, W1, request(req.task_id, publication="p2"))
    assert (r.reason, r.state, r.publication) == ("taken", RUNNING, "p1")
    complete(store, W1, g)
    assert grant(store, W1, request(req.task_id, publication="p2")).epoch == 2


def test_new_publication_does_not_reopen_a_task_in_review(store: Store) -> None:
    req = request(policy="review", publication="p1")
    g = grant(store, W1, req, ttl=0.3)
    store.start(W1, req.task_id, g.epoch, g.token, 0.3)
    wait_for(lambda: store.recover("scanner", 10, TTL), what="Recover to take it over")
    assert claim(store, req.task_id).state == NEEDS_REVIEW
    r = refusal(store, W2, request(req.task_id, publication="p2"))
    assert (r.reason, r.state) == ("terminal", NEEDS_REVIEW)


def test_messages_without_a_publication_are_told_apart_by_task_id_only(store: Store) -> None:
    req = request()
    complete(store, W1, grant(store, W1, req))
    assert refusal(store, W2, req).reason == "terminal"


def test_revoked_claim_is_terminal_and_purged(store: Store) -> None:
    req = request()
    assert complete(store, W1, grant(store, W1, req), REVOKED) == "applied"
    info = claim(store, req.task_id)
    assert (info.state, info.outcome, info.lease_remaining) == (REVOKED, REVOKED, None)
    assert refusal(store, W2, req).reason == "terminal"
    assert store.purge_finished(older_than=-1) == 1


# -- requeue (Celery's Reject(requeue=True) and friends) ---------------------------------------
def test_requeue_opens_the_claim_under_a_publish_lease_and_keeps_the_budget(
        store: Store) -> None:
    req = request(max_attempts=2, publication="p1")
    g = grant(store, W1, req)
    store.start(W1, req.task_id, g.epoch, g.token, TTL)
    (item,) = store.requeue(W1, [key(g)], publish_ttl=TTL)
    assert (item.state, item.was, item.epoch) == (OPEN, RUNNING, 2)
    assert item.message.body == BODY  # what goes back to the broker, byte-exact
    info = claim(store, req.task_id)
    assert (info.state, info.holder, info.epoch) == (OPEN, W1, 2)
    assert info.lease_remaining is not None and info.lease_remaining > 0  # the publish lease
    # The old credential is dead; the requeue is not repeated.
    assert store.requeue(W1, [key(g)], publish_ttl=TTL) == []
    assert complete(store, W1, g) == "evidence"
    assert store.mark_published([(item.task_id, item.epoch, item.token or "")]) == 1
    again = grant(store, W2, req)  # the requeued delivery: the same publication
    assert (again.epoch, again.attempts) == (3, 2)


def test_a_requeue_never_published_is_taken_over_by_recover(store: Store) -> None:
    req = request()
    g = grant(store, W1, req)
    assert len(store.requeue(W1, [key(g)], publish_ttl=0.2)) == 1
    # The requeuing worker died before publishing: once its publish lease expires,
    # Recover takes the claim again and publishes it.
    taken = wait_for(lambda: store.recover("scanner", 10, TTL), what="Recover's takeover")
    assert [(t.task_id, t.state, t.epoch) for t in taken] == [(req.task_id, OPEN, 3)]


def test_requeue_leaves_other_holders_and_lost_leases_alone(store: Store) -> None:
    mine, theirs = request(), request()
    g_mine = grant(store, W1, mine, ttl=0.2)
    g_theirs = grant(store, W2, theirs)
    wait_for(lambda: expired(store, mine.task_id), what="the lease to expire")
    assert store.requeue(W1, [key(g_mine), key(g_theirs)], publish_ttl=TTL) == []
    assert claim(store, theirs.task_id).state == RESERVED


# -- start -------------------------------------------------------------------------------
def test_start_only_from_a_live_reservation_with_the_right_credential(store: Store) -> None:
    req = request()
    g = grant(store, W1, req)
    assert store.start(W1, req.task_id, g.epoch, "0" * 32, TTL) is None
    assert store.start(W1, req.task_id, g.epoch + 1, g.token, TTL) is None
    assert store.start(W2, req.task_id, g.epoch, g.token, TTL) is None
    assert claim(store, req.task_id).state == RESERVED
    until = store.start(W1, req.task_id, g.epoch, g.token, TTL)
    assert until is not None and until > store.now()
    info = claim(store, req.task_id)
    assert info.state == RUNNING and info.started_at is not None
    assert store.start(W1, req.task_id, g.epoch, g.token, TTL) is None  # already running


def test_a_reservation_with_start_is_granted_running_in_one_statement(
        store: Store) -> None:
    folded, plain = request(policy="review"), request(policy="review")
    first, second = store.reserve(W1, [dataclasses.replace(folded, start=True), plain], TTL)
    assert isinstance(first, Grant) and first.started
    assert isinstance(second, Grant) and not second.started
    info = claim(store, folded.task_id)
    assert info.state == RUNNING and info.started_at is not None
    assert claim(store, plain.task_id).state == RESERVED
    # Already running: a start of it is refused, a renewal and a completion are not.
    assert store.start(W1, folded.task_id, first.epoch, first.token, TTL) is None
    assert store.renew(W1, [key(first)], TTL)[0] == {folded.task_id}
    assert complete(store, W1, first) == "applied"
    assert claim(store, folded.task_id).state == SUCCEEDED


def test_a_started_grant_over_an_expired_reservation_is_running_again(
        store: Store) -> None:
    req = request(policy="review")
    old = grant(store, W1, req, ttl=0.3)
    wait_for(lambda: expired(store, req.task_id), what="the reservation to expire")
    (new,) = store.reserve(W2, [dataclasses.replace(req, start=True)], TTL)
    assert isinstance(new, Grant) and new.started and new.epoch == old.epoch + 1
    assert claim(store, req.task_id).state == RUNNING
    # A live running claim is never granted again, not even to its own holder.
    assert refusal(store, W1, req).reason == "taken"


def test_a_folded_start_that_never_reached_a_pool_process_is_released(
        store: Store) -> None:
    (g,) = store.reserve(W1, [dataclasses.replace(request(), start=True)], TTL)
    assert isinstance(g, Grant) and g.started
    assert store.release(W1, [key(g)]) == 0  # running: only as never run
    assert store.release(W1, [key(g)], never_ran=True) == 1
    info = claim(store, g.task_id)
    assert info.state == RESERVED and info.started_at is None and expired(store, g.task_id)


def test_an_exchange_answers_as_the_three_calls_in_order(store: Store) -> None:
    """Completions first (a retry re-opens the claim its next delivery needs), then
    reservations, then starts: one exchange, the same answers as the separate calls."""
    retried, waiting, gone = (grant(store, W1, request()) for _ in range(3))
    fresh = request()
    again = request(retried.task_id, retries=1)
    store.release(W1, [key(gone)])
    grant(store, W2, request(gone.task_id))  # taken over: this completion is stale
    done = store.exchange(
        W1, TTL, [Completion(retried.task_id, retried.epoch, retried.token, RETRY),
                  Completion(gone.task_id, gone.epoch, gone.token, SUCCEEDED)],
        [again, dataclasses.replace(fresh, start=True)], [key(waiting)])
    assert done.completed == {retried.task_id: "applied", gone.task_id: "evidence"}
    regrant, folded = done.reserved
    assert isinstance(regrant, Grant) and regrant.epoch == retried.epoch + 1
    assert isinstance(folded, Grant) and folded.started
    assert set(done.started) == {waiting.task_id}
    assert [claim(store, t).state for t in (retried.task_id, fresh.task_id,
                                                  waiting.task_id)] == [RESERVED, RUNNING,
                                                                        RUNNING]
    assert len(evidence_rows(store, gone.task_id)) == 1


def test_an_exchange_with_a_task_twice_decides_each_copy_in_turn(store: Store) -> None:
    req = request()
    done = store.exchange(W1, TTL, [], [req, req], [])
    first, second = done.reserved
    assert isinstance(first, Grant)
    assert isinstance(second, Refusal) and second.reason == "taken"


def test_an_empty_exchange_does_nothing(store: Store) -> None:
    done = store.exchange(W1, TTL, [], [], [])
    assert (dict(done.completed), list(done.reserved), dict(done.started)) == ({}, [], {})


def test_start_refused_once_the_reservation_expired(store: Store) -> None:
    req = request()
    g = grant(store, W1, req, ttl=0.3)
    wait_for(lambda: expired(store, req.task_id), what="the reservation to expire")
    assert store.start(W1, req.task_id, g.epoch, g.token, TTL) is None
    assert claim(store, req.task_id).state == RESERVED


def test_start_refused_after_a_takeover(store: Store) -> None:
    req = request()
    old = grant(store, W1, req)
    store.release(W1, [key(old)])
    grant(store, W2, req)
    assert store.start(W1, req.task_id, old.epoch, old.token, TTL) is None


# -- renew -------------------------------------------------------------------------------
def test_renew_checks_holder_token_and_epoch(store: Store) -> None:
    good, wrong_token, wrong_epoch = (grant(store, W1, request()) for _ in range(3))
    running = grant(store, W1, request())
    assert store.start(W1, running.task_id, running.epoch, running.token, TTL)
    other = grant(store, W2, request())
    before = claim(store, good.task_id).lease_remaining
    renewed, busy = store.renew(W1, [
        key(good), (wrong_token.task_id, wrong_token.epoch, "f" * 32),
        (wrong_epoch.task_id, wrong_epoch.epoch + 1, wrong_epoch.token), key(running),
        key(other)], 120.0)
    assert renewed == {good.task_id, running.task_id}
    assert busy == set()
    after = claim(store, good.task_id).lease_remaining
    assert before is not None and after is not None and after > before + 60
    # Leases not renewed keep their old expiry; the other holder's lease is untouched.
    assert (claim(store, wrong_token.task_id).lease_remaining or 0) <= TTL
    assert (claim(store, other.task_id).lease_remaining or 0) <= TTL


def test_renew_in_one_call_covers_many_leases(store: Store) -> None:
    grants = [grant(store, W1, request()) for _ in range(50)]
    renewed, _ = store.renew(W1, [key(g) for g in grants], TTL)
    assert renewed == {g.task_id for g in grants}


def test_lease_expires_by_store_clock(store: Store) -> None:
    req = request()
    g = grant(store, W1, req, ttl=0.3)
    # Live now: another holder is refused (unless this very slow machine took > 0.3 s).
    first = store.reserve(W2, [req], TTL)[0]
    if isinstance(first, Grant):
        pytest.skip("the store took longer than the 0.3 s TTL between two statements")
    assert first.reason == "taken"
    taken = wait_for(lambda: next(iter(
        r for r in store.reserve(W2, [req], TTL) if isinstance(r, Grant)), None),
        timeout=10, what="the 0.3 s lease to expire by the store clock")
    assert (taken.epoch, taken.attempts) == (2, 2)
    # The expired lease can no longer be renewed by its old holder.
    assert store.renew(W1, [key(g)], TTL) == (set(), set())
    assert claim(store, req.task_id).holder == W2


def test_expired_lease_is_not_renewed(store: Store) -> None:
    req = request()
    g = grant(store, W1, req, ttl=0.3)
    wait_for(lambda: expired(store, req.task_id), what="the lease to expire")
    assert store.renew(W1, [key(g)], TTL) == (set(), set())
    assert expired(store, req.task_id)


# -- complete ----------------------------------------------------------------------------
def test_complete_records_outcome_and_error(store: Store) -> None:
    ok, bad = grant(store, W1, request()), grant(store, W1, request())
    assert store.start(W1, ok.task_id, ok.epoch, ok.token, TTL)
    result = store.complete(W1, [
        Completion(ok.task_id, ok.epoch, ok.token, SUCCEEDED),
        Completion(bad.task_id, bad.epoch, bad.token, FAILED, "ValueError('boom')")])
    assert result == {ok.task_id: "applied", bad.task_id: "applied"}
    done, failed = claim(store, ok.task_id), claim(store, bad.task_id)
    assert (done.state, done.outcome, done.lease_remaining) == (SUCCEEDED, SUCCEEDED, None)
    assert done.finished_at is not None and done.error is None
    assert (failed.state, failed.error) == (FAILED, "ValueError('boom')")
    assert row(store, ok.task_id).token is None  # the credential is gone


def test_repeated_completion_is_a_duplicate(store: Store) -> None:
    g = grant(store, W1, request())
    assert complete(store, W1, g) == "applied"
    assert complete(store, W1, g) == "duplicate"
    assert evidence_rows(store, g.task_id) == []
    assert claim(store, g.task_id).state == SUCCEEDED


def test_stale_completion_is_evidence_only(store: Store) -> None:
    req = request()
    stale = grant(store, W1, req)
    assert store.release(W1, [key(stale)]) == 1
    current = grant(store, W2, req)
    assert current.epoch == 2
    assert complete(store, W1, stale, FAILED, "late") == "evidence"
    info = claim(store, req.task_id)
    assert (info.state, info.holder, info.epoch, info.outcome) == (RESERVED, W2, 2, None)
    assert row(store, req.task_id).token == current.token
    (ev,) = evidence_rows(store, req.task_id)
    assert (ev.epoch, ev.holder, ev.outcome, ev.error) == (1, W1, FAILED, "late")
    # The current holder still completes normally; the stale one never overrides it.
    assert complete(store, W2, current) == "applied"
    assert complete(store, W1, stale, FAILED, "later") == "evidence"
    info = claim(store, req.task_id)
    assert (info.state, info.epoch) == (SUCCEEDED, 2)
    assert len(evidence_rows(store, req.task_id)) == 2


def test_a_late_outcome_is_kept_with_its_result_however_the_claim_stands(store: Store
                                                                         ) -> None:
    """Every late outcome is kept with its result: one the store found stale (taken
    over), and one its holder sends under LOST_TOKEN because it lost the lease locally,
    while the store still holds the claim for it (never applied: the claim stays
    running, its lease and token untouched)."""
    taken, held = request(), request()
    stale = grant(store, W1, taken)
    assert store.release(W1, [key(stale)]) == 1
    grant(store, W2, taken)
    mine = grant(store, W1, held)
    assert store.start(W1, mine.task_id, mine.epoch, mine.token, TTL)
    answers = store.complete(W1, [
        Completion(stale.task_id, stale.epoch, stale.token, SUCCEEDED, returned="'charged'"),
        Completion(mine.task_id, mine.epoch, LOST_TOKEN, SUCCEEDED, returned="42")])
    assert answers == {taken.task_id: "evidence", held.task_id: "evidence"}
    (ev,) = evidence_rows(store, taken.task_id)
    assert (ev.epoch, ev.holder, ev.outcome, ev.result) == (1, W1, SUCCEEDED, "'charged'")
    (ev,) = evidence_rows(store, held.task_id)
    assert (ev.epoch, ev.outcome, ev.error, ev.result) == (1, SUCCEEDED, None, "42")
    info = claim(store, held.task_id)
    assert (info.state, info.holder, info.epoch, info.outcome) == (RUNNING, W1, 1, None)
    assert row(store, held.task_id).token == mine.token
    detail = store.claim_detail(held.task_id)
    assert detail is not None and [e.result for e in detail.evidence] == ["42"]


def test_retry_completion_opens_the_claim_for_the_next_delivery(store: Store) -> None:
    req = request()
    g = grant(store, W1, req)
    assert store.start(W1, req.task_id, g.epoch, g.token, TTL)
    assert complete(store, W1, g, RETRY) == "applied"
    info = claim(store, req.task_id)
    assert (info.state, info.lease_remaining, info.finished_at) == (OPEN, None, None)
    retried = grant(store, W2, request(req.task_id, retries=1))
    assert (retried.epoch, retried.attempts) == (2, 2)
    assert claim(store, req.task_id).state == RESERVED
    assert row(store, req.task_id).retries == 1


# -- release and purge ---------------------------------------------------------------------
def test_release_expires_a_reservation_for_another_holder(store: Store) -> None:
    req = request()
    g = grant(store, W1, req)
    assert refusal(store, W2, req).reason == "taken"
    assert store.release(W2, [key(g)]) == 0  # only the holder may release
    assert store.release(W1, [(g.task_id, g.epoch, "0" * 32)]) == 0  # with its token
    assert store.release(W1, [key(g)]) == 1
    assert expired(store, req.task_id)
    taken = grant(store, W2, req)
    assert taken.epoch == 2


def test_release_leaves_running_claims_alone(store: Store) -> None:
    g = grant(store, W1, request())
    assert store.start(W1, g.task_id, g.epoch, g.token, TTL)
    assert store.release(W1, [key(g)]) == 0
    info = claim(store, g.task_id)
    assert info.state == RUNNING and (info.lease_remaining or 0) > 0


def test_release_of_a_start_that_never_reached_a_pool_process(store: Store) -> None:
    g = grant(store, W1, request())
    assert store.start(W1, g.task_id, g.epoch, g.token, TTL)
    assert store.release(W2, [key(g)], never_ran=True) == 0  # only the holder
    assert store.release(W1, [key(g)], never_ran=True) == 1
    info = claim(store, g.task_id)
    assert info.state == RESERVED and info.started_at is None
    assert expired(store, g.task_id)  # Recover re-publishes it: it never ran


def test_purge_removes_only_old_finished_claims(store: Store) -> None:
    done, failed, live = (grant(store, W1, request()) for _ in range(3))
    assert complete(store, W1, done) == "applied"
    assert complete(store, W1, failed, FAILED, "x") == "applied"
    assert store.purge_finished(older_than=3600) == 0
    assert {c.task_id for c in store.list_claims()} >= {done.task_id, failed.task_id}
    wait_for(lambda: store.purge_finished(older_than=0.05) == 2 or
               not {done.task_id, failed.task_id} & {c.task_id for c in store.list_claims()},
               what="finished claims to be purged")
    ids = {c.task_id for c in store.list_claims()}
    assert done.task_id not in ids and failed.task_id not in ids
    assert live.task_id in ids


def test_purge_works_in_bounded_batches(store: Store) -> None:
    grants = [grant(store, W1, request()) for _ in range(7)]
    store.complete(W1, [Completion(g.task_id, g.epoch, g.token, SUCCEEDED) for g in grants])
    wait_for(lambda: store.now() - max(
        c.finished_at or 0 for c in store.list_claims()) > 0.1, what="time to pass")
    # A budget of 0 is one batch: at most ``limit`` rows a statement.
    assert store.purge_finished(older_than=0.05, limit=3, budget=0) == 3
    assert store.purge_finished(older_than=0.05, limit=3, budget=0) == 3
    assert store.purge_finished(older_than=0.05, limit=3, budget=0) == 1
    assert store.list_claims() == []


def finished_at(store: Store, task_ids: set[str]) -> list[float]:
    return [c.finished_at or 0.0 for c in store.list_claims() if c.task_id in task_ids]


def test_one_purge_pass_keeps_up_with_any_backlog(store: Store) -> None:
    """Three batches' worth of finished claims (and their evidence) past retention go in
    one pass; claims inside retention, live ones and ``needs_review`` ones stay."""
    limit = 4
    old: set[str] = set()
    for _ in range(3 * limit):
        req = request()
        stale = grant(store, W1, req)
        assert store.release(W1, [key(stale)]) == 1
        current = grant(store, W2, req)
        assert complete(store, W1, stale, FAILED, "late") == "evidence"
        assert complete(store, W2, current) == "applied"
        old.add(req.task_id)
    review = [grant(store, W1, request()) for _ in range(2)]
    store.complete(W1, [Completion(g.task_id, g.epoch, g.token, NEEDS_REVIEW, "E") for g in review])
    oldest_kept = max(finished_at(store, old))
    wait_for(lambda: store.now() - oldest_kept > 2.0, what="time to pass")
    recent = [grant(store, W1, request()) for _ in range(2)]
    store.complete(W1, [Completion(g.task_id, g.epoch, g.token, SUCCEEDED) for g in recent])
    live = grant(store, W1, request())
    # Retention half-way between the old claims and the recent ones.
    older_than = store.now() - (oldest_kept + min(finished_at(store, {g.task_id for g in recent}))) / 2
    assert store.retention_lag(older_than) > 0
    assert store.purge_finished(older_than=older_than, limit=limit) == 3 * limit
    left = {c.task_id: c.state for c in store.list_claims()}
    assert not old & set(left)
    assert all(evidence_rows(store, task_id) == [] for task_id in old)
    assert {g.task_id for g in review} | {g.task_id for g in recent} | {live.task_id} == set(left)
    assert {left[g.task_id] for g in review} == {NEEDS_REVIEW}
    assert store.retention_lag(older_than) == 0.0


def test_claim_counts(store: Store) -> None:
    _, b, c = (grant(store, W1, request()) for _ in range(3))
    assert store.start(W1, b.task_id, b.epoch, b.token, TTL)
    complete(store, W1, c)
    grant(store, W1, request(), ttl=0.2)
    wait_for(lambda: store.claim_counts().get("expired") == 1, what="one expired claim")
    counts = store.claim_counts()
    assert counts[RESERVED] == 2 and counts[RUNNING] == 1 and counts[SUCCEEDED] == 1


# -- lease.fenced(conn) on the store's database ------------------------------------------
def _store_url(store: SqlStore) -> str:
    return store.engine.url.render_as_string(hide_password=False)


@contextlib.contextmanager
def _probe(store: SqlStore) -> Iterator[tuple[sa.Engine, sa.Table]]:
    engine = sa.create_engine(_store_url(store))
    table = sa.Table("fence_probe", sa.MetaData(), sa.Column("task_id", sa.String(64)),
                     sa.Column("epoch", sa.Integer), sa.Column("note", sa.String(32)))
    table.create(engine)
    try:
        yield engine, table
    finally:
        table.drop(engine)
        engine.dispose()


def _lease(store: SqlStore, g: Grant, holder: str = W1) -> Lease:
    far = time.monotonic() + 3600
    return Lease(g.task_id, g.epoch, g.token, holder, read_deadline=lambda: (far, False),
                 fencer=make_fencer(_store_url(store), TTL), initial_deadline=far)


def _notes(engine: sa.Engine, table: sa.Table) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        return [(r.epoch, r.note) for r in conn.execute(sa.select(table.c.epoch, table.c.note))]


def test_fenced_write_commits_only_while_the_epoch_holds(sql_store: SqlStore) -> None:
    """SQL only: ``lease.fenced`` guards a transaction on the store's own database."""
    req = request()
    g = grant(sql_store, W1, req)
    assert sql_store.start(W1, g.task_id, g.epoch, g.token, TTL)
    lease = _lease(sql_store, g)
    with _probe(sql_store) as (engine, table):
        with engine.connect() as conn, lease.fenced(conn):
            conn.execute(table.insert().values(task_id=g.task_id, epoch=g.epoch, note="held"))
        # A takeover (as Recover would do it): new epoch and token, by the store clock.
        now = Dialect(sql_store.engine.dialect.name).now()
        with sql_store.engine.begin() as conn:
            moved = conn.execute(sa.update(claims).where(claims.c.task_id == g.task_id).values(
                epoch=claims.c.epoch + 1, holder="thief", token="x" * 32,
                lease_until=now + 60)).rowcount
        assert moved == 1
        with pytest.raises(LeaseLost), engine.connect() as conn, lease.fenced(conn):
            conn.execute(table.insert().values(task_id=g.task_id, epoch=g.epoch, note="stale"))
        assert lease.lost
        assert _notes(engine, table) == [(1, "held")]
        assert claim(sql_store, g.task_id).holder == "thief"


def test_fenced_write_rolls_back_when_the_lease_ends_inside_the_block(sql_store: SqlStore) -> None:
    """SQL only: ``lease.fenced`` guards a transaction on the store's own database."""
    g = grant(sql_store, W1, request())
    assert sql_store.start(W1, g.task_id, g.epoch, g.token, TTL)
    lost = False
    far = time.monotonic() + 3600
    lease = Lease(g.task_id, g.epoch, g.token, W1, read_deadline=lambda: (far, lost),
                  fencer=make_fencer(_store_url(sql_store), TTL), initial_deadline=far)
    with _probe(sql_store) as (engine, table):
        with pytest.raises(LeaseLost), engine.connect() as conn, lease.fenced(conn):
            conn.execute(table.insert().values(task_id=g.task_id, epoch=g.epoch, note="x"))
            lost = True  # the worker revoked the lease while the block ran
        assert _notes(engine, table) == []


def test_fenced_write_accepted_on_a_live_reservation_whose_start_is_not_recorded_yet(
        sql_store: SqlStore) -> None:
    """SQL only: ``lease.fenced`` guards a transaction on the store's own database."""
    # Tasks Recover re-dispatches anyway (acks_late, idempotent) start before their
    # start is recorded: the fence is the token and epoch, not the state.
    g = grant(sql_store, W1, request())
    lease = _lease(sql_store, g)
    with _probe(sql_store) as (engine, table):
        with engine.connect() as conn, lease.fenced(conn):
            conn.execute(table.insert().values(task_id=g.task_id, epoch=g.epoch, note="x"))
        assert _notes(engine, table) == [(g.epoch, "x")]
    other = _lease(sql_store, dataclasses.replace(g, token="0" * 32))
    with _probe(sql_store) as (engine, table):
        with pytest.raises(LeaseLost), engine.connect() as conn, other.fenced(conn):
            conn.execute(table.insert().values(task_id=g.task_id, epoch=g.epoch, note="y"))
        assert _notes(engine, table) == []


def test_start_many_moves_only_live_reservations_of_the_holder(store: Store) -> None:
    ok, stale, other = (grant(store, W1, request()) for _ in range(3))
    mine_elsewhere = grant(store, W2, request())
    started = store.start_many(W1, [(ok.task_id, ok.epoch, ok.token),
                                        (stale.task_id, stale.epoch + 1, stale.token),
                                        (other.task_id, other.epoch, "0" * 32),
                                        (mine_elsewhere.task_id, mine_elsewhere.epoch,
                                         mine_elsewhere.token)], TTL)
    assert set(started) == {ok.task_id}
    assert started[ok.task_id] > store.now()
    states = {c.task_id: c.state for c in store.list_claims()}
    assert states[ok.task_id] == RUNNING
    assert states[stale.task_id] == states[other.task_id] == RESERVED
    assert states[mine_elsewhere.task_id] == RESERVED


def test_fenced_rejects_another_database_and_open_transactions(
        sql_store: SqlStore, tmp_path: Any) -> None:
    """SQL only: ``lease.fenced`` guards a transaction on the store's own database."""
    g = grant(sql_store, W1, request())
    assert sql_store.start(W1, g.task_id, g.epoch, g.token, TTL)
    lease = _lease(sql_store, g)
    other = sa.create_engine(f"sqlite:///{tmp_path / 'other.sqlite3'}")
    with pytest.raises(InvalidConfig), other.connect() as conn, lease.fenced(conn):
        pass
    other.dispose()
    engine = sa.create_engine(_store_url(sql_store))
    with engine.connect() as conn:
        conn.execute(sa.select(1))  # autobegins a transaction
        with pytest.raises(InvalidConfig), lease.fenced(conn):
            pass
    engine.dispose()


def test_renew_skips_a_row_held_by_a_fenced_transaction_as_busy(server_store: SqlStore) -> None:
    """PostgreSQL, MariaDB: a lease whose row another transaction holds is reported
    ``busy``: still valid, not extended, and the renewal does not wait for the lock.
    (SQLite locks the whole database: there are no row locks to skip.)"""
    sql_store = server_store
    held, free = grant(sql_store, W1, request()), grant(sql_store, W1, request())
    before = row(sql_store, held.task_id).lease_until
    with sql_store.engine.connect() as locker:
        locker.execute(sa.select(claims.c.task_id).where(claims.c.task_id == held.task_id)
                       .with_for_update())
        started = time.monotonic()
        renewed, busy = sql_store.renew(W1, [key(held), key(free)], 120.0)
        assert time.monotonic() - started < 2.0
        assert (renewed, busy) == ({free.task_id}, {held.task_id})
        locker.rollback()
    assert row(sql_store, held.task_id).lease_until == before


def test_a_fenced_block_left_idle_past_the_ttl_loses_its_transaction(
        server_store: SqlStore) -> None:
    """PostgreSQL, MariaDB: a holder paused inside ``lease.fenced`` never pins the claim
    row (the transaction timeouts are server settings)."""
    sql_store = server_store
    g = grant(sql_store, W1, request())
    assert sql_store.start(W1, g.task_id, g.epoch, g.token, TTL)
    ttl = 0.5
    far = time.monotonic() + 3600
    lease = Lease(g.task_id, g.epoch, g.token, W1, read_deadline=lambda: (far, False),
                  fencer=make_fencer(_store_url(sql_store), ttl), initial_deadline=far)
    with _probe(sql_store) as (engine, table):
        with pytest.raises(sa.exc.DBAPIError), engine.connect() as conn, lease.fenced(conn):
            conn.execute(table.insert().values(task_id=g.task_id, epoch=g.epoch, note="x"))
            # Another session can take the row once the idle transaction is gone.
            with sql_store.engine.begin() as other:
                other.exec_driver_sql("SET LOCAL lock_timeout = '5s'"
                                      if sql_store.dialect.is_postgres
                                      else "SET SESSION innodb_lock_wait_timeout = 5")
                taken = other.execute(sa.update(claims).where(claims.c.task_id == g.task_id)
                                      .values(holder="thief")).rowcount
            assert taken == 1
            conn.execute(table.insert().values(task_id=g.task_id, epoch=g.epoch, note="y"))
        assert _notes(engine, table) == []


# -- concurrency ---------------------------------------------------------------------------
def test_workers_racing_for_the_same_new_tasks_each_get_a_task_once(store: Store) -> None:
    """Four workers (own connections) reserve the same 40 never-seen task ids at once, each
    in its own order: every id is granted to exactly one of them, the rest are refused
    ``taken``, and nobody sees an error. On MySQL/MariaDB this is where duplicate-key
    races and deadlocks happen: they must be retried, never surfaced."""
    import random
    import threading

    ids = [uuid.uuid4().hex for _ in range(40)]
    holders = [f"racer{i}@host" for i in range(4)]
    handles = contextlib.ExitStack()
    stores = [handles.enter_context(other_handle(store)) for _ in holders]
    barrier = threading.Barrier(len(holders))
    results: dict[str, list[Grant | Refusal]] = {}
    errors: list[BaseException] = []

    def race(store: Store, holder: str) -> None:
        order = ids[:]
        random.Random(holder).shuffle(order)
        try:
            barrier.wait()
            got: list[Grant | Refusal] = []
            for i in range(0, len(order), 8):  # batches, as the keeper sends them
                got += store.reserve(holder, [request(t) for t in order[i:i + 8]], TTL)
            results[holder] = got
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=race, args=(s, h)) for s, h in zip(stores, holders,
                                                                          strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    handles.close()
    assert errors == []
    granted: dict[str, list[str]] = {}
    for holder, answers in results.items():
        for answer in answers:
            if isinstance(answer, Grant):
                granted.setdefault(answer.task_id, []).append(holder)
            else:
                assert answer.reason == "taken", answer
    assert sorted(granted) == sorted(ids)
    assert all(len(h) == 1 for h in granted.values()), granted
    for task_id, (holder,) in granted.items():
        info = claim(store, task_id)
        assert (info.holder, info.epoch, info.state) == (holder, 1, RESERVED)


# -- what the lease gateway needs (issue 18) ---------------------------------------------
def test_lease_of_reports_a_live_lease_without_extending_it(store: Store) -> None:
    g = grant(store, W1, request())
    state, until = store.lease_of(W1, *key(g)) or ("", 0.0)
    assert state == RESERVED and until == pytest.approx(g.lease_until)
    assert store.lease_of(W1, *key(g)) == (state, until)  # nothing moved
    started = store.start(W1, *key(g), TTL)
    assert store.lease_of(W1, *key(g)) == (RUNNING, pytest.approx(started))
    # Another holder, another epoch, another token: not this lease.
    assert store.lease_of(W2, *key(g)) is None
    assert store.lease_of(W1, g.task_id, g.epoch + 1, g.token) is None
    assert store.lease_of(W1, g.task_id, g.epoch, "0" * 32) is None
    store.complete(W1, [Completion(g.task_id, g.epoch, g.token, SUCCEEDED)])
    assert store.lease_of(W1, *key(g)) is None


def test_lease_of_an_expired_lease_is_none(store: Store) -> None:
    g = grant(store, W1, request(), ttl=0.2)
    wait_for(lambda: store.lease_of(W1, *key(g)) is None, what="the lease to expire")


def test_a_holder_that_cant_tell_what_happened_sends_the_task_to_review(
        store: Store) -> None:
    g = grant(store, W1, request(policy="redispatch"))
    assert store.start(W1, *key(g), TTL) is not None
    done = Completion(g.task_id, g.epoch, g.token, NEEDS_REVIEW, "E_TIMEOUT")
    assert store.complete(W1, [done]) == {g.task_id: "applied"}
    c = claim(store, g.task_id)
    assert (c.state, c.outcome, c.error) == (NEEDS_REVIEW, NEEDS_REVIEW, "E_TIMEOUT")
    assert [r.task_id for r in store.list_review()] == [g.task_id]
    assert store.complete(W1, [done]) == {g.task_id: "duplicate"}
    # Nobody re-runs it until a human decides, whatever its policy.
    assert isinstance(store.reserve(W2, [request(g.task_id)], TTL)[0], Refusal)


# -- results a completion writes (the pulse:// backend's rows) ------------------------------
def test_a_completion_writes_its_result_and_counts_its_part_only_if_it_applies(
        store: Store) -> None:
    """An applied completion writes its result and adds its part to the counter, in its
    own transaction; a stale or repeated one writes and counts nothing. (The backend
    that reads them is SQL's: test_results_contract.py.)"""
    def part(g: Grant, value: bytes) -> Completion:
        record = ResultRecord(f"result-{g.task_id}", value, "SUCCESS", 3600.0, "SUCCESS",
                              counter="chord-g1", counter_note=b"the callback")
        return Completion(g.task_id, g.epoch, g.token, SUCCEEDED, None, record)

    first, second, stale = (grant(store, W1, request()) for _ in range(3))
    store.release(W1, [key(stale)])
    grant(store, W2, request(stale.task_id))  # taken over: W1's attempt is stale
    counted: dict[str, tuple[int, str]] = {}
    answers = store.complete(W1, [part(first, b"1"), part(second, b"2"), part(stale, b"0")],
                             counted)
    assert answers[stale.task_id] == "evidence"
    ordered = sorted([first.task_id, second.task_id])
    assert {t: c for t, (c, _) in counted.items()} == {ordered[0]: 1, ordered[1]: 2}
    (nonce,) = {n for _, n in counted.values()}
    assert len(nonce) == 32
    assert result_value(store, f"result-{first.task_id}") == b"1"
    assert result_value(store, f"result-{stale.task_id}") is None
    assert result_value(store, "chord-g1") == b"the callback"
    again: dict[str, tuple[int, str]] = {}
    assert store.complete(W1, [part(first, b"again")], again) == {first.task_id: "duplicate"}
    assert again == {} and result_value(store, f"result-{first.task_id}") == b"1"
