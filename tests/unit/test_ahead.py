"""Starts ahead of the pool: how many, in which order, and what a late answer does.

The keeper is a stand-in that records the starts asked for (the store is not what is
under test here: the exchange is, in ``test_keeper`` and the contract suite)."""

from __future__ import annotations

from typing import Any

from celery_pulse.bootsteps.ahead import MAX_AHEAD, WINDOW, StartAhead
from celery_pulse.bootsteps.loop import LoopCaller
from celery_pulse.leases import LOST, RESERVED, RUNNING, WAITING, LocalClaim
from celery_pulse.store.base import Permit


class Store:
    exchange_in_process = False


class Keeper:
    def __init__(self) -> None:
        self.claims: dict[str, LocalClaim] = {}
        self.starts: list[tuple[LocalClaim, Any, bool]] = []
        self.store = Store()

    def get(self, task_id: str) -> LocalClaim | None:
        return self.claims.get(task_id)

    def submit_start(self, claim: LocalClaim, callback: Any, urgent: bool = True) -> None:
        self.starts.append((claim, callback, urgent))

    def claim(self, task_id: str) -> LocalClaim:
        claim = self.claims[task_id] = LocalClaim(task_id, 1, "t" * 32, 1e12)
        return claim


def make(concurrency: int = 2, runtime: float | None = 0.001,
         waited_for: set[str] | None = None
         ) -> tuple[StartAhead, Keeper, list[tuple[LocalClaim, Any, Any]]]:
    keeper = Keeper()
    handed: list[tuple[LocalClaim, Any, Any]] = []
    waiting = waited_for if waited_for is not None else set()
    ahead = StartAhead(keeper, lambda: LoopCaller(None), concurrency,  # type: ignore[arg-type]
                       lambda claim, job, result: handed.append((claim, job, result)),
                       lambda permits: any(p.key in waiting for p in permits))
    ahead.runtime = runtime
    return ahead, keeper, handed


def test_a_reservation_lingers_while_jobs_wait_ahead_only_where_exchanges_are_local(
        ) -> None:
    for local in (False, True):
        ahead, keeper, _ = make(concurrency=2, runtime=WINDOW / 4)
        keeper.store.exchange_in_process = local
        assert not ahead.lingers()  # no job waits ahead: a process will wait for it
        ahead.settled(keeper.claim("a"), False, True)
        assert ahead.ahead
        assert ahead.lingers() is local  # the processes have their next jobs


def test_nothing_starts_ahead_before_a_job_ran_or_while_jobs_are_long() -> None:
    for runtime in (None, WINDOW * 2):
        ahead, keeper, _ = make(runtime=runtime)
        assert not ahead.fold(False)
        ahead.settled(keeper.claim("a"), False, True)
        assert keeper.starts == [] and not ahead.queued


def test_a_free_process_always_folds_the_start_into_the_reservation() -> None:
    ahead, _, _ = make(runtime=None)
    assert ahead.fold(True) and ahead.folding == 1
    ahead.settled(None, True, False)  # refused: nothing held
    assert ahead.folding == 0


def test_as_many_start_ahead_as_the_processes_get_through_in_the_window() -> None:
    ahead, keeper, _ = make(concurrency=2, runtime=WINDOW / 4)  # 4 jobs per process
    claims = [keeper.claim(f"t{i}") for i in range(12)]
    for claim in claims:
        ahead.settled(claim, False, True)
    assert [c for c, _cb, _u in keeper.starts] == claims[:8]  # in Celery's order
    assert all(not urgent for _c, _cb, urgent in keeper.starts)  # they may linger
    claims[0].in_pool = True
    ahead.left(claims[0])  # went to the pool: room for the next in line
    assert keeper.starts[-1][0] is claims[8]


def test_the_budget_is_at_least_one_per_process_and_at_most_the_cap() -> None:
    slow, keeper, _ = make(concurrency=3, runtime=WINDOW * 0.9)
    for i in range(10):
        slow.settled(keeper.claim(f"s{i}"), False, True)
    assert len(keeper.starts) == 3
    fast, keeper, _ = make(concurrency=2, runtime=1e-6)
    for i in range(MAX_AHEAD + 10):
        fast.settled(keeper.claim(f"f{i}"), False, True)
    assert len(keeper.starts) == MAX_AHEAD


def test_claims_that_ended_went_to_the_pool_or_were_lost_are_not_started() -> None:
    ahead, keeper, _ = make(concurrency=1, runtime=WINDOW / 2)  # budget 2
    ended, lost, applied, live = (keeper.claim(t) for t in ("ended", "lost", "applied", "live"))
    ahead.queued.extend([ended, lost, applied, live])
    del keeper.claims["ended"]
    lost.state = LOST
    applied.applied = True
    ahead.pump()
    assert [c for c, _cb, _u in keeper.starts] == [live]


def test_a_job_waiting_for_its_start_ahead_is_handed_over_when_it_answers() -> None:
    ahead, keeper, handed = make(concurrency=1)
    claim = keeper.claim("a")
    ahead.settled(claim, False, True)
    (_c, callback, _u), = keeper.starts
    assert claim.starting
    claim.waiting_job = job = object()  # the pool asked for it meanwhile
    callback(True)
    assert handed == [(claim, job, True)] and not claim.starting


def test_a_refused_start_ahead_gives_its_place_back() -> None:
    ahead, keeper, handed = make(concurrency=1, runtime=WINDOW / 1.5)  # budget 1
    first, second = keeper.claim("a"), keeper.claim("b")
    ahead.settled(first, False, True)
    ahead.settled(second, False, True)
    assert [c for c, _cb, _u in keeper.starts] == [first]
    keeper.starts[0][1](False)  # refused: it starts (or is dropped) when its process frees
    assert handed == [] and first.state == RESERVED
    assert [c for c, _cb, _u in keeper.starts] == [first, second]


def test_a_folded_grant_waiting_for_a_process_holds_a_place() -> None:
    ahead, keeper, _ = make(concurrency=1, runtime=WINDOW / 1.5)  # budget 1
    folded = keeper.claim("folded")
    folded.state = RUNNING
    assert ahead.fold(False)
    ahead.settled(folded, True, True)  # every process was taken meanwhile
    ahead.settled(keeper.claim("next"), False, True)
    assert keeper.starts == []  # the place is the folded one's
    folded.in_pool = True
    ahead.left(folded)
    assert [c.task_id for c, _cb, _u in keeper.starts] == ["next"]


def limited(keeper: Keeper, task_id: str, key: str = "task:t") -> LocalClaim:
    claim = keeper.claim(task_id)
    claim.permits = (Permit(key, 4),)
    return claim


def test_a_limited_claim_starts_ahead_with_its_permits_unless_its_keys_have_waiters() -> None:
    ahead, keeper, _ = make(concurrency=2, runtime=WINDOW / 4, waited_for={"task:busy"})
    free, behind, other = (limited(keeper, "free"), limited(keeper, "behind", "task:busy"),
                           keeper.claim("plain"))
    for claim in (free, behind, other):
        ahead.settled(claim, False, True)
    # The one whose key has tasks waiting asks with its process, behind them.
    assert [c for c, _cb, _u in keeper.starts] == [free, other]
    assert free.permits and free.starting


def test_a_start_ahead_that_finds_no_permit_keeps_its_keys_back_until_it_leaves() -> None:
    ahead, keeper, _ = make(concurrency=4, runtime=WINDOW / 4)
    first = limited(keeper, "first")
    ahead.settled(first, False, True)
    keeper.starts[0][1](WAITING)  # no permit free: it asks again with its process
    assert first.state == RESERVED and not first.starting
    second, plain = limited(keeper, "second"), keeper.claim("plain")
    ahead.settled(second, False, True)
    ahead.settled(plain, False, True)
    # Not ahead of the first in line for the same key; other tasks still go.
    assert [c for c, _cb, _u in keeper.starts] == [first, plain]
    first.in_pool = True
    ahead.left(first)  # it went to the pool (or waits there): the key goes ahead again
    third = limited(keeper, "third")
    ahead.settled(third, False, True)
    assert keeper.starts[-1][0] is third


def test_one_limited_start_ahead_per_key_at_first_twice_as_many_after_each_grant() -> None:
    ahead, keeper, _ = make(concurrency=4, runtime=WINDOW / 16)  # budget: the cap
    claims = [limited(keeper, f"k{i}") for i in range(12)]
    for claim in claims[:4]:
        ahead.settled(claim, False, True)
    # One in flight for the key; the others ask with their process.
    assert [c for c, _cb, _u in keeper.starts] == claims[:1]
    keeper.starts[0][1](True)  # it got its permit: two may fly now
    for claim in claims[4:8]:
        ahead.settled(claim, False, True)
    assert [c for c, _cb, _u in keeper.starts] == [claims[0], claims[4], claims[5]]
    keeper.starts[1][1](WAITING)  # one found none: back to one in flight (the other's)
    for claim in claims[8:]:
        ahead.settled(claim, False, True)
    assert len(keeper.starts) == 3


def test_a_task_under_a_rate_starts_ahead_as_a_limited_one_does() -> None:
    """A rate's start goes ahead of the pool while its key's starts are granted (one in
    flight at first); once one is told to wait for the window, the key's next tasks ask
    with their process, so a binding rate is never met by starts that wait for one."""
    ahead, keeper, _ = make(concurrency=2, runtime=WINDOW / 4)
    rated = [keeper.claim(f"rated{i}") for i in range(3)]
    for claim in rated:
        claim.permits = (Permit("rate:task:t", 20, 1.0),)
    ahead.settled(rated[0], False, True)
    ahead.settled(rated[1], False, True)
    assert [c for c, _cb, _u in keeper.starts] == rated[:1] and rated[0].starting
    keeper.starts[0][1](WAITING)  # the window is full
    ahead.settled(rated[2], False, True)
    assert [c for c, _cb, _u in keeper.starts] == rated[:1]
    assert not rated[1].starting and not rated[2].starting


def test_a_limited_delivery_folds_with_its_permits_as_a_start_ahead_would_go() -> None:
    """With a free process it folds; without one, only as a start ahead of its keys
    would (one in flight per key at first); never while its keys have waiters, nor
    where its permits depend on its body (None)."""
    hot = (Permit("task:k", 4),)
    ahead, keeper, _ = make(concurrency=2, runtime=WINDOW / 4, waited_for={"task:busy"})
    assert ahead.fold_limited(False, None) == () and ahead.folding == 0
    assert ahead.fold_limited(True, (Permit("task:busy", 4),)) == ()
    assert ahead.fold_limited(False, hot) == hot  # within the budget: one in flight
    assert ahead.fold_limited(False, hot) == ()  # the key's allowance is taken
    assert ahead.fold_limited(True, hot) == hot  # a free process waits for it
    assert ahead.folding == 2 and ahead.flying["task:k"] == 2
    # Both granted with their permits: the key may fly twice as many.
    for name in ("a", "b"):
        claim = keeper.claim(name)
        claim.state = RUNNING
        ahead.settled(claim, True, True, hot, True)
        assert claim.permits == hot
    assert ahead.folding == 0 and not ahead.flying and ahead.allowed["task:k"] == 4
    assert ahead.stats() == {"started_ahead": 0, "folded": 2}


def test_a_fold_that_found_no_permit_keeps_its_keys_back_until_it_leaves() -> None:
    hot = (Permit("task:k", 1),)
    ahead, keeper, _ = make(concurrency=2, runtime=WINDOW / 4)
    assert ahead.fold_limited(True, hot) == hot
    claim = keeper.claim("full")
    ahead.settled(claim, True, False, hot, False)  # reserved, not started
    assert claim.permits == hot and ahead.stats()["folded"] == 0
    assert ahead.fold_limited(True, hot) == ()  # it asks with its process first
    claim.in_pool = True
    ahead.left(claim)
    assert ahead.fold_limited(True, hot) == hot
    # A refused or failed reservation (no claim) gives its allowance back too.
    ahead.settled(None, True, False, hot, False)
    assert not ahead.flying and ahead.folding == 0
