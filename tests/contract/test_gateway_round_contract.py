"""One round of the gateway's group commit (gateway/dispatch.py ``Fenced.round``) on the
in-memory store and every SQL store: starts and finishes of one holder in one exchange,
each with its own answer, as the operations one at a time would have had them."""

from __future__ import annotations

import pytest

from celery_pulse.gateway.dispatch import Fenced, Step
from celery_pulse.gateway.session import LEASED, RUNNING, Attempt
from celery_pulse.store.base import Store
from tests.contract.test_claims_contract import TTL, grant, request

HOLDER = "gw:runner:" + "b" * 32


def _attempt(store: Store) -> Attempt:
    req = request()
    g = grant(store, HOLDER, req)
    return Attempt(req.task_id, req.task_id, "a-" + req.task_id, g.epoch, g.token,
                   "proj.add", g.lease_until, 0.0)


def _finish(attempt: Attempt, outcome: str = "SUCCEEDED") -> Step:
    stale = attempt.state == LEASED
    return Step(attempt, lambda: (Fenced.completion(attempt, outcome, None, stale=stale,
                                                    returned="1"), False))


def test_starts_and_finishes_of_a_round_each_get_their_own_answer(store: Store) -> None:
    fenced = Fenced(store, HOLDER, TTL)
    one, two, three = (_attempt(store) for _ in range(3))
    started = fenced.round([Step(one), Step(two)])
    assert all(isinstance(lease, float) and lease > 0 for lease in started)
    one.state = two.state = RUNNING

    def broken() -> tuple[object, bool]:
        raise ValueError("the backend could not encode it")
    # A finish, a finish of an attempt never started (evidence only), a failed build, and
    # a start, all in one round.
    answers = fenced.round([_finish(one), _finish(three), Step(two, broken), Step(three)])
    assert answers[0] == ("applied", False)
    assert answers[1] == ("evidence", False)
    assert isinstance(answers[2], ValueError)
    assert isinstance(answers[3], float)
    states = {c.task_id: c.state for c in store.list_claims()}
    assert states[one.task_id] == "succeeded"
    assert states[two.task_id] == "running" and states[three.task_id] == "running"


def test_a_finish_sent_again_is_a_duplicate_and_a_stale_start_is_refused(store: Store) -> None:
    fenced = Fenced(store, HOLDER, TTL)
    attempt = _attempt(store)
    (lease,) = fenced.round([Step(attempt)])
    assert lease is not None
    attempt.state = RUNNING
    assert fenced.round([_finish(attempt)]) == [("applied", False)]
    assert fenced.round([_finish(attempt)]) == [("duplicate", False)]
    assert fenced.round([Step(attempt)]) == [None]  # ended: no authority to start


@pytest.mark.parametrize("outcome, state", [("FAILED", "failed"), ("UNKNOWN", "needs_review")])
def test_a_rounds_finish_ends_the_claim_as_the_outcome_says(store: Store, outcome: str,
                                                             state: str) -> None:
    fenced = Fenced(store, HOLDER, TTL)
    attempt = _attempt(store)
    fenced.round([Step(attempt)])
    attempt.state = RUNNING
    assert fenced.round([_finish(attempt, outcome)]) == [("applied", False)]
    assert {c.task_id: c.state for c in store.list_claims()}[attempt.task_id] == state
