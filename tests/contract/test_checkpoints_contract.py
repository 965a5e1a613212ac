"""The checkpoint contract (issue 40), on every store: ``checkpoint`` and
``last_checkpoint`` of :class:`~celery_pulse.store.checkpoints.CheckpointStore`.

A checkpoint is written only under the attempt's live lease, kept only if newer than the
row's (a later epoch, or the same epoch and a higher sequence), read by a later attempt
with its epoch and store time, and purged with its claim.
"""

from __future__ import annotations

import pytest

from celery_pulse.store.base import NEEDS_REVIEW, RUNNING, SUCCEEDED, Completion, Store
from celery_pulse.store.checkpoints import (
    MAX_CHECKPOINT_BYTES,
    CheckpointTooLarge,
    CheckpointWrite,
    encode_checkpoint,
)
from celery_pulse.store.records import Grant
from tests.contract.test_claims_contract import TTL, W1, W2, claim, complete, grant, key, request
from tests.helpers.stores import other_handle


def write(g: Grant, seq: int, value: object, token: str | None = None) -> CheckpointWrite:
    return CheckpointWrite(g.task_id, g.epoch, g.token if token is None else token, seq,
                           encode_checkpoint(value))


def running(store: Store, holder: str = W1, ttl: float = TTL) -> Grant:
    g = grant(store, holder, request())
    assert store.start(holder, g.task_id, g.epoch, g.token, ttl) is not None
    return g


def test_checkpoints_a_holders_write_is_read_back_with_its_epoch_and_store_time(
        store: Store) -> None:
    g = running(store)
    assert store.last_checkpoint(g.task_id) is None  # none written yet
    before = store.now()
    assert store.checkpoint(W1, [write(g, 1, {"cursor": 50, "done": [1, 2]})]) == (
        {g.task_id}, set())
    got = store.last_checkpoint(g.task_id)
    assert got is not None
    assert got.value == {"cursor": 50, "done": [1, 2]}
    assert got.epoch == g.epoch
    assert before - 1 <= got.written_at <= store.now() + 1  # the store's clock wrote it
    assert got.size == len(encode_checkpoint({"cursor": 50, "done": [1, 2]}))
    assert claim(store, g.task_id).state == RUNNING  # the claim itself is unchanged


def test_checkpoints_only_the_newest_write_of_an_attempt_is_kept(store: Store) -> None:
    """Writes carried out of order (the renewal's late copy after the task's own newer
    one) never move the checkpoint back; in one call the highest sequence wins."""
    g = running(store)
    store.checkpoint(W1, [write(g, 3, "third"), write(g, 2, "second")])
    assert store.last_checkpoint(g.task_id).value == "third"  # type: ignore[union-attr]
    assert store.checkpoint(W1, [write(g, 1, "first")]) == ({g.task_id}, set())
    assert store.last_checkpoint(g.task_id).value == "third"  # type: ignore[union-attr]
    store.checkpoint(W1, [write(g, 4, "fourth")])
    assert store.last_checkpoint(g.task_id).value == "fourth"  # type: ignore[union-attr]


def test_checkpoints_a_stale_or_foreign_write_changes_nothing(store: Store) -> None:
    """A wrong token, another holder, a finished claim: nothing written, not held."""
    g = running(store)
    store.checkpoint(W1, [write(g, 1, "mine")])
    assert store.checkpoint(W1, [write(g, 2, "forged", token="0" * 32)]) == (set(), set())
    assert store.checkpoint(W2, [write(g, 3, "theirs")]) == (set(), set())
    assert complete(store, W1, g, SUCCEEDED) == "applied"
    assert store.checkpoint(W1, [write(g, 4, "after the end")]) == (set(), set())
    assert store.last_checkpoint(g.task_id).value == "mine"  # type: ignore[union-attr]


def test_checkpoints_an_expired_lease_writes_nothing(store: Store) -> None:
    """By the store's clock: a lease of 50 ms, polled until it ran out."""
    from celery_pulse.testing import wait_for

    g = grant(store, W1, request())
    assert store.start(W1, g.task_id, g.epoch, g.token, 0.05) is not None
    wait_for(lambda: (claim(store, g.task_id).lease_remaining or 0) <= 0, 10,
             "the lease to expire by the store clock")
    assert store.checkpoint(W1, [write(g, 1, "late")]) == (set(), set())
    assert store.last_checkpoint(g.task_id) is None


def test_checkpoints_survive_a_requeue_and_a_later_epoch_replaces_them(store: Store) -> None:
    """The next attempt (a requeue, here) reads the last one's checkpoint; its own first
    write, whatever its sequence, replaces it; the old attempt can no longer write."""
    req = request(publication="p1")
    g = grant(store, W1, req)
    store.start(W1, req.task_id, g.epoch, g.token, TTL)
    store.checkpoint(W1, [write(g, 7, {"cursor": 350})])
    (item,) = store.requeue(W1, [key(g)], publish_ttl=TTL)
    assert store.mark_published([(item.task_id, item.epoch, item.token or "")]) == 1
    again = grant(store, W2, req)
    assert again.epoch > g.epoch
    seen = store.last_checkpoint(req.task_id)
    assert seen is not None and (seen.value, seen.epoch) == ({"cursor": 350}, g.epoch)
    store.start(W2, req.task_id, again.epoch, again.token, TTL)
    assert store.checkpoint(W1, [write(g, 8, {"cursor": 400})]) == (set(), set())
    assert store.checkpoint(W2, [write(again, 1, {"cursor": 400})]) == ({req.task_id}, set())
    seen = store.last_checkpoint(req.task_id)
    assert seen is not None and (seen.value, seen.epoch) == ({"cursor": 400}, again.epoch)


@pytest.mark.parametrize("outcome", [SUCCEEDED, "failed"])
def test_checkpoints_a_new_publication_of_a_finished_task_starts_without_one(
        store: Store, outcome: str) -> None:
    """A finished task published again (a fixed task id, say) is a new run: the earlier
    run's checkpoint would make it skip work. A redelivery of the same publication that
    is refused changes nothing."""
    req = request(publication="p1")
    g = grant(store, W1, req)
    store.start(W1, req.task_id, g.epoch, g.token, TTL)
    store.checkpoint(W1, [write(g, 1, {"next": 1000})])
    assert complete(store, W1, g, outcome, None if outcome == SUCCEEDED else "boom") == "applied"
    store.reserve(W2, [request(req.task_id, publication="p1")], TTL)  # a redelivery: refused
    assert store.last_checkpoint(req.task_id) is not None
    again = grant(store, W2, request(req.task_id, publication="p2"))
    assert again.epoch > g.epoch and again.attempts == 1
    assert store.last_checkpoint(req.task_id) is None


def test_checkpoints_a_review_retry_resumes_from_the_lost_attempts_checkpoint(
        store: Store) -> None:
    """A task whose outcome nobody knew, retried by an operator: its next attempt reads
    how far the lost one got (the review shows it too)."""
    g = running(store)
    store.checkpoint(W1, [write(g, 3, {"next": 700})])
    assert store.complete(W1, [Completion(g.task_id, g.epoch, g.token, NEEDS_REVIEW,
                                          "can't tell")]) == {g.task_id: "applied"}
    (item,) = [i for i in store.list_review() if i.task_id == g.task_id]
    assert item.checkpoint_size == len(encode_checkpoint({"next": 700}))
    detail = store.claim_detail(g.task_id)
    assert detail is not None and detail.checkpoint is not None
    assert detail.checkpoint.value == {"next": 700}
    again = store.review_retry(g.task_id, "review:ops", TTL, "ops@host", None)
    assert store.mark_published([(g.task_id, again.epoch, again.token or "")]) == 1
    later = grant(store, W2, request(g.task_id))
    assert later.epoch > g.epoch
    seen = store.last_checkpoint(g.task_id)
    assert seen is not None and (seen.value, seen.epoch) == ({"next": 700}, g.epoch)


def test_checkpoints_are_purged_with_their_claim(store: Store) -> None:
    g = running(store)
    store.checkpoint(W1, [write(g, 1, "x")])
    complete(store, W1, g, SUCCEEDED)
    from celery_pulse.testing import wait_for

    wait_for(lambda: store.purge_finished(older_than=0.0) >= 1 or
             store.last_checkpoint(g.task_id) is None, 10, "the finished claim's purge")
    assert store.last_checkpoint(g.task_id) is None


def test_checkpoints_one_call_answers_each_lease_on_its_own(store: Store) -> None:
    mine, other = running(store), running(store, W2)
    with other_handle(store) as second:
        assert second.checkpoint(W1, [write(mine, 1, "a"), write(other, 1, "b")]) == (
            {mine.task_id}, set())
    assert store.last_checkpoint(other.task_id) is None


def test_checkpoints_one_call_writes_many_leases(store: Store) -> None:
    """A renewal carries every running task's checkpoint in one call."""
    grants = [running(store) for _ in range(5)]
    assert store.checkpoint(W1, [write(g, 1, {"n": i}) for i, g in enumerate(grants)]) == (
        {g.task_id for g in grants}, set())
    assert [store.last_checkpoint(g.task_id).value for g in grants] == [  # type: ignore[union-attr]
        {"n": i} for i in range(5)]


def test_checkpoints_a_value_too_large_or_not_json_is_refused_before_any_write() -> None:
    encode_checkpoint("x" * (MAX_CHECKPOINT_BYTES - 2))  # its quotes make it the limit
    with pytest.raises(CheckpointTooLarge, match="more than 65536"):
        encode_checkpoint("x" * MAX_CHECKPOINT_BYTES)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        encode_checkpoint({"when": object()})
    with pytest.raises(TypeError, match="JSON-serialisable"):
        encode_checkpoint(float("nan"))
