"""Starts folded into their reservation with their permits (issues 39 and 41):
``ReserveRequest.permits`` with ``start``, on every store.

A store that :attr:`~celery_pulse.store.base.ClaimStore.folds_permits` (PostgreSQL's
pipelined exchange) reserves such a request and starts it in the same transaction when
every permit it needs has room, by the same rule as ``start_many``: the limit is never
passed, a start that finds no room stays ``reserved`` (and is told apart), a completion
earlier in the exchange gives back the permit the fold takes, a start asked before it in
the same exchange goes first. Any other store, and any call that is not a pipelined
exchange (``reserve`` itself), only reserves it: never started without its permits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from celery_pulse.store.base import (
    RESERVED,
    RUNNING,
    SUCCEEDED,
    Completion,
    Grant,
    Permit,
    ReserveRequest,
    Store,
)
from tests.contract.test_claims_contract import TTL, W1, W2, claim, grant, key
from tests.contract.test_claims_contract import request as new_request
from tests.contract.test_permits_contract import needs, running, start, usage


def folded(*permits: Permit) -> ReserveRequest:
    """A new delivery with a free process: reserve it, and start it with ``permits``."""
    return dataclasses.replace(new_request(), start=True, permits=tuple(permits))


def grants_of(answers: Sequence[object]) -> list[Grant]:
    assert all(isinstance(a, Grant) for a in answers), answers
    return [a for a in answers if isinstance(a, Grant)]


def test_permit_folds_start_up_to_the_limit_in_the_order_asked(
        store: Store, request: pytest.FixtureRequest) -> None:
    """Three folded reservations under a limit of 2 in one exchange: where the store
    folds (PostgreSQL, direct or through PgBouncer), the first two asked start
    (``Grant.started``, ``running``), the third stays reserved, waiting; elsewhere all
    three are only reserved. Never over the limit."""
    kind = request.node.callspec.params["store"]
    assert store.folds_permits == (kind == "postgres" or kind.startswith("pgb-"))
    hot = Permit("k", 2)
    asked = [folded(hot) for _ in range(3)]
    done = store.exchange(W1, TTL, [], asked, [])
    got = grants_of(done.reserved)
    assert [g.task_id for g in got] == [r.task_id for r in asked]
    states = [claim(store, g.task_id).state for g in got]
    if store.folds_permits:
        assert [g.started for g in got] == [True, True, False]
        assert states == [RUNNING, RUNNING, RESERVED]
        assert usage(store) == {"k": (2, 2, 1)}
    else:
        assert [g.started for g in got] == [False] * 3 and states == [RESERVED] * 3
        assert store.permit_usage() == []
    # The folded starts hold their permits: a start asked afterwards waits for them.
    later = grant(store, W1, new_request())
    started, waiting = start(store, W1, [later], needs([later], hot))
    assert (set(started), waiting) == ((set(), {later.task_id}) if store.folds_permits
                                       else ({later.task_id}, set()))


def test_permit_folds_reserve_alone_never_starts(store: Store) -> None:
    """``reserve`` (not an exchange) takes no permits: a folded request is reserved."""
    (answer,) = store.reserve(W1, [folded(Permit("k", 5))], TTL)
    assert isinstance(answer, Grant) and not answer.started
    assert claim(store, answer.task_id).state == RESERVED
    assert store.permit_usage() == []


def test_permit_folds_take_what_the_exchange_completion_gives_back(store: Store) -> None:
    """A completion earlier in the exchange frees the permit the fold takes; a full key
    without one leaves the fold reserved."""
    hot = Permit("k", 1)
    first = running(store, W1, [hot])
    full = store.exchange(W1, TTL, [], [folded(hot)], [])
    (waited,) = grants_of(full.reserved)
    assert not waited.started and claim(store, waited.task_id).state == RESERVED
    done = store.exchange(W1, TTL, [Completion(first.task_id, first.epoch, first.token,
                                               SUCCEEDED)], [folded(hot)], [])
    assert done.completed == {first.task_id: "applied"}
    (taken,) = grants_of(done.reserved)
    assert taken.started is store.folds_permits
    assert claim(store, taken.task_id).state == (RUNNING if store.folds_permits else RESERVED)


def test_permit_folds_go_after_the_starts_asked_with_them(store: Store) -> None:
    """A limited start asked in the same exchange was reserved before: it goes first."""
    hot = Permit("k", 1)
    earlier = grant(store, W1, new_request())
    done = store.exchange(W1, TTL, [], [folded(hot)], [key(earlier)], needs([earlier], hot))
    (fold,) = grants_of(done.reserved)
    assert set(done.started) == {earlier.task_id}
    assert not fold.started and claim(store, fold.task_id).state == RESERVED


def test_permit_folds_a_refused_reservation_takes_nothing(store: Store) -> None:
    """A folded request for a task another worker holds is refused and holds no permit;
    the other folds of its exchange still start."""
    hot = Permit("k", 1)
    theirs = grant(store, W2, new_request())
    done = store.exchange(W1, TTL, [], [dataclasses.replace(
        new_request(theirs.task_id), start=True, permits=(hot,)), folded(hot)], [])
    refused, mine = done.reserved
    assert not isinstance(refused, Grant)
    assert isinstance(mine, Grant) and mine.started is store.folds_permits
    assert claim(store, theirs.task_id).state == RESERVED


def test_permit_folds_under_a_rate_count_as_starts(store: Store) -> None:
    """Under a rate, folded starts count in its window like any start: two of 2 per
    minute fold, the next start (folded or asked) waits."""
    rate = Permit("r", 2, 60.0)
    done = store.exchange(W1, TTL, [], [folded(rate), folded(rate)], [])
    got = grants_of(done.reserved)
    if not store.folds_permits:
        assert not any(g.started for g in got)
        return
    assert all(g.started for g in got)
    again = store.exchange(W1, TTL, [], [folded(rate)], [])
    (third,) = grants_of(again.reserved)
    assert not third.started and third.task_id in again.waiting
    assert again.retry_in.get(third.task_id, 0) > 0
