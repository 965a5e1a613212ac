"""The table of exits (docs/concepts/leases.md) maps to one function each: how Celery ended
a request decides how its claim ends (``celery_pulse.worker.exits.RequestEnds``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from billiard.exceptions import Terminated
from celery.exceptions import Ignore, Reject, Retry

from celery_pulse.errors import LeaseLost
from celery_pulse.leases import LOST, LocalClaim
from celery_pulse.store.base import FAILED, RETRY, REVOKED, SUCCEEDED
from celery_pulse.worker.exits import RequestEnds


class _Worker:
    """What the exits touch, recording what they did."""

    def __init__(self) -> None:
        self.done: list[tuple[Any, ...]] = []
        self.keeper = SimpleNamespace(
            forget=lambda claim: self.done.append(("forget", claim.task_id)),
            submit_complete=lambda claim, outcome, error, callback: self.done.append(
                ("complete", claim.task_id, outcome, error)),
            submit_late=lambda claim, outcome, error: self.done.append(
                ("late", claim.task_id, outcome, error)),
            release_unstarted=lambda why: 0)
        self.ahead = SimpleNamespace(left=lambda claim: None)
        self.loop = SimpleNamespace(call=lambda fn, *args: fn(*args))
        self.waits = SimpleNamespace(freed=lambda keys: None)
        self.signals = SimpleNamespace(announce=lambda permits: None)
        self.table = SimpleNamespace(free=lambda slot: self.done.append(("free", slot)))
        self.chords = None
        self.recoverer = SimpleNamespace(
            requeue=lambda key: self.done.append(("requeue", key[0])))
        self.remote = False

    def claim_ended(self, task_id: str) -> None:
        pass

    def forget_deliveries(self) -> int:
        return 0

    def admit_waiting(self) -> None:
        pass


def _ends() -> tuple[RequestEnds, _Worker]:
    worker = _Worker()
    return RequestEnds(worker), worker  # type: ignore[arg-type]


def _claim(applied: bool = True) -> LocalClaim:
    claim = LocalClaim("t-1", 1, "token", deadline=1e12, slot=3 if applied else None)
    claim.applied = applied
    return claim


@pytest.mark.parametrize(("exc", "failed", "outcome", "error"), [
    (None, False, SUCCEEDED, None),
    (Retry(), True, RETRY, None),
    (Terminated(9), True, REVOKED, "revoked and terminated"),
    (Ignore(), True, SUCCEEDED, "ignored"),
    (ValueError("boom"), True, FAILED, "ValueError('boom')"),
    (Reject("no", requeue=False), True, FAILED, "reject requeue=False: no"),
])
def test_the_pools_result_ends_the_claim_by_what_the_attempt_did(
        exc: BaseException | None, failed: bool, outcome: str, error: str | None) -> None:
    ends, worker = _ends()
    ends.ran(_claim(), exc, failed)
    assert worker.done == [("free", 3), ("complete", "t-1", outcome, error)]


def test_a_lost_lease_records_nothing_as_ours() -> None:
    for state in ("running", LOST):
        claim = _claim()
        claim.state = state
        ends, worker = _ends()
        ends.ran(claim, LeaseLost("lost"), True)  # the attempt found out: nothing to keep
        assert worker.done == [("free", 3), ("forget", "t-1")]


@pytest.mark.parametrize(("exc", "failed", "outcome", "error"), [
    (None, False, SUCCEEDED, None),
    (ValueError("boom"), True, FAILED, "ValueError('boom')"),
    (Retry(), True, RETRY, None),
    (Terminated(9), True, REVOKED, "revoked and terminated"),
])
def test_a_body_that_ended_after_its_lease_was_lost_here_is_kept_as_evidence(
        exc: BaseException | None, failed: bool, outcome: str, error: str | None) -> None:
    """Lost locally first (the main process paused past its deadline): its late
    outcome goes to the store as evidence only, never as the claim's completion."""
    claim = _claim()
    claim.state = LOST
    ends, worker = _ends()
    ends.ran(claim, exc, failed)
    assert worker.done == [("late", "t-1", outcome, error), ("free", 3), ("forget", "t-1")]


def test_a_remote_workers_late_outcome_is_not_sent_as_evidence() -> None:
    """pulse.worker.v1 has no evidence-only finish (a finish under the attempt's token
    would be applied while the gateway still holds the lease): a remote worker sends
    nothing, and says so instead of "kept as evidence only"."""
    claim = _claim()
    claim.state = LOST
    ends, worker = _ends()
    worker.remote = True
    ends.ran(claim, None, False)
    assert worker.done == [("free", 3), ("forget", "t-1")]


def test_a_requeue_celery_decided_in_the_pool_goes_back_as_a_new_attempt() -> None:
    ends, worker = _ends()
    claim = _claim()
    ends.verdict(claim, "reject", requeue=True)
    assert worker.done == []  # remembered for the result
    ends.ran(claim, Reject("again", requeue=True), True)
    assert worker.done == [("free", 3), ("forget", "t-1"), ("requeue", "t-1")]


@pytest.mark.parametrize(("kind", "requeue", "done"), [
    ("ack", False, [("complete", "t-1", REVOKED, "revoked or expired before it ran")]),
    ("reject", False, [("complete", "t-1", FAILED, "rejected by Celery before it ran")]),
    ("reject", True, [("forget", "t-1"), ("requeue", "t-1")]),
])
def test_celerys_verdict_before_the_pool_ends_the_claim_now(
        kind: str, requeue: bool, done: list[tuple[Any, ...]]) -> None:
    ends, worker = _ends()
    ends.verdict(_claim(applied=False), kind, requeue)
    assert worker.done == done


def test_a_verdict_on_a_lost_claim_is_left_to_the_store() -> None:
    ends, worker = _ends()
    claim = _claim(applied=False)
    claim.state = LOST
    ends.verdict(claim, "ack", False)
    ends.verdict(claim, "reject", True)
    assert worker.done == []


class _Request:
    """What ``lost_attempt_stopped`` touches of Celery's request: its id (Celery's
    ``task_ready``) and ``send_event``."""

    def __init__(self) -> None:
        self.id = "t-1"
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send_event(self, type_: str, **fields: Any) -> None:
        self.sent.append((type_, fields))


def test_a_stale_attempts_dead_process_is_sent_as_an_attempt_end_not_a_task_failure() -> None:
    ends, worker = _ends()
    claim = _claim()
    claim.state, claim.hard_stopped, claim.lost_reason = LOST, True, "taken over"
    claim.request = request = _Request()
    ends.lost_attempt_stopped(claim)
    assert worker.done == [("free", 3), ("forget", "t-1")]  # nothing recorded as ours
    ((type_, fields),) = request.sent
    assert type_ == "pulse-attempt-ended"
    assert (fields["epoch"], fields["outcome"], fields["reason"]) == (1, "failed", "taken over")
    assert "LeaseLost" in fields["exception"]


@pytest.mark.parametrize(("redispatch", "done"), [
    (True, [("free", 3), ("forget", "t-1"), ("requeue", "t-1")]),
    (False, [("free", 3), ("forget", "t-1")]),
])
def test_an_attempt_celery_cancelled_goes_back_or_is_left_to_recover_by_its_policy(
        redispatch: bool, done: list[tuple[Any, ...]]) -> None:
    """Celery cancels running requests on a broker connection loss
    (``worker_cancel_long_running_tasks_on_connection_loss``) and at a cold or soft
    shutdown, leaving their messages for the broker to deliver again: a task Recover would
    re-dispatch is requeued (epoch + 1), one that must not run twice is left to expire
    (Recover sends it to review). Never ended ``revoked``, as a terminate would be."""
    ends, worker = _ends()
    claim = _claim()
    claim.start_in_background = redispatch
    claim.request = SimpleNamespace(_already_cancelled=True, _already_revoked=False)
    ends.ran(claim, Terminated(15), True)
    assert worker.done == done


@pytest.mark.parametrize(("exc", "failed", "outcome", "error"), [
    (None, False, SUCCEEDED, None),
    (ValueError("boom"), True, FAILED, "ValueError('boom')"),
])
def test_an_attempt_that_ended_by_itself_before_celerys_cancel_ends_as_it_ended(
        exc: BaseException | None, failed: bool, outcome: str, error: str | None) -> None:
    """Celery sets its cancel flag after it signals the process: an attempt that returned
    or raised first is not run again (Celery settles its message as usual)."""
    ends, worker = _ends()
    claim = _claim()
    claim.start_in_background = True
    claim.request = SimpleNamespace(_already_cancelled=True, _already_revoked=False)
    ends.ran(claim, exc, failed)
    assert worker.done == [("free", 3), ("complete", "t-1", outcome, error)]
