"""The hot path on the event loop (:mod:`celery_pulse.loop_commit`), on a real PostgreSQL
store and a real kombu hub (the loop a Celery worker runs), without a worker process.

What is checked: the ops submitted on the loop's thread are exchanged and answered
there (not on the committer thread), what queues up while an exchange is in flight goes
out together in the next one, the loop stopping mid-exchange loses nothing (the rest goes
to the committer thread), a store outage fails reservations and retries completions,
starts under permits go from the loop too, and what the loop cannot do without blocking
is done by the committer thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from kombu.asynchronous import Hub

from celery_pulse.errors import StoreUnavailable
from celery_pulse.leases import WAITING, LeaseKeeper, LocalClaim
from celery_pulse.store.base import (
    SUCCEEDED,
    Grant,
    Message,
    Permit,
    Refusal,
    ReserveRequest,
)
from celery_pulse.store.sql import SqlStore, open_store

pytestmark = pytest.mark.postgres

TTL = 30.0


class Listener:
    def on_lost(self, claim: LocalClaim) -> None:
        pass

    def on_hard_stop(self, claim: LocalClaim) -> None:
        pass

    def on_renewed(self, claims: Sequence[LocalClaim]) -> None:
        pass


@pytest.fixture
def store(pg_url: str) -> Iterator[SqlStore]:
    sql = open_store(pg_url, check_schema=False)
    sql.migrate()
    yield sql
    sql.close()


@contextlib.contextmanager
def attached(store: SqlStore, hub: Hub, warm_up: Callable[[], object] = lambda: None
             ) -> Iterator[LeaseKeeper]:
    """A started keeper that serves the ops submitted on ``hub``'s thread from that loop
    (``warm_up`` runs before it attaches)."""
    keeper = LeaseKeeper(store, "w1", ttl=TTL, interval=5, margin=1, grace=2,
                         listener=Listener())
    keeper.start()
    warm_up()
    assert keeper.attach_loop(hub)
    try:
        yield keeper
    finally:
        keeper.stop(release=False)


@pytest.fixture
def keeper(store: SqlStore, hub: Hub) -> Iterator[LeaseKeeper]:
    # The pipeline's connection is open (in a worker, the first exchange opens it, from
    # the committer thread: connecting from the loop would block it).
    pipeline = store._pipeline
    assert pipeline is not None
    with attached(store, hub, lambda: pipeline.run("warm up", [("SELECT 1", ())])) as keeper:
        yield keeper


class Answers:
    """Callbacks that record each answer and the thread it came on."""

    def __init__(self) -> None:
        self.got: dict[str, Any] = {}
        self.threads: dict[str, str] = {}
        self.changed = threading.Event()

    def to(self, key: str) -> Callable[..., None]:
        def callback(result: Any, *_extra: Any) -> None:
            self.got[key] = result
            self.threads[key] = threading.current_thread().name
            self.changed.set()
        return callback

    def wait(self, keys: Sequence[str], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(k in self.got for k in keys):
            assert time.monotonic() < deadline, f"no answer for {set(keys) - set(self.got)}"
            self.changed.wait(0.05)
            self.changed.clear()


def run_loop(hub: Hub, until: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = hub.create_loop()
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the loop did not get there in time"
        next(loop)


def request(task_id: str, urgent_start: bool = False) -> ReserveRequest:
    message = Message(b"[[], {}, {}]", {"id": task_id}, {}, {}, "application/json", "utf-8")
    return ReserveRequest(task_id, "t", message, "redispatch", 10, 0, f"pub-{task_id}",
                          urgent_start)


def committer_of(keeper: LeaseKeeper) -> Any:
    committer = keeper._loop_committer
    assert committer is not None
    return committer


def in_flight(hub: Hub, keeper: LeaseKeeper, task_id: str, answers: Answers) -> Any:
    """Send a reservation from the loop's tick and stop there: its answer not read yet."""
    committer = committer_of(keeper)
    run_loop(hub, lambda: committer.active)  # the committer thread's backlog is through
    keeper.submit_reserve(request(task_id), answers.to(task_id), urgent=True)
    committer._tick()  # what the loop does before it polls
    return committer


def test_ops_submitted_on_the_loop_are_exchanged_and_answered_on_the_loop(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    answers = Answers()
    for i in range(3):
        keeper.submit_reserve(request(f"t{i}"), answers.to(f"t{i}"), urgent=i == 0)
    run_loop(hub, lambda: len(answers.got) == 3)
    assert all(isinstance(answers.got[f"t{i}"], Grant) for i in range(3))
    assert set(answers.threads.values()) == {threading.current_thread().name}
    assert keeper.counters.exchanges == 1  # the three went out together

    claims = [keeper.add(answers.got[f"t{i}"], time.monotonic(), 0, False) for i in range(3)]
    for claim in claims:
        keeper.submit_complete(claim, SUCCEEDED, None, answers.to(f"done-{claim.task_id}"))
    run_loop(hub, lambda: len(answers.got) == 6)
    assert [answers.got[f"done-t{i}"] for i in range(3)] == ["applied"] * 3
    assert set(answers.threads.values()) == {threading.current_thread().name}
    assert keeper.counters.exchanges == 2
    assert store.claim_counts().get(SUCCEEDED) == 3


def test_what_queues_up_during_an_exchange_goes_out_together_in_the_next(
        hub: Hub, keeper: LeaseKeeper) -> None:
    answers = Answers()
    committer = in_flight(hub, keeper, "first", answers)
    assert committer._exchange is not None
    for i in range(5):
        keeper.submit_reserve(request(f"next{i}"), answers.to(f"next{i}"), urgent=True)
    run_loop(hub, lambda: len(answers.got) == 6)
    assert keeper.counters.exchanges == 2
    assert keeper.counters.exchanged_ops == 6


def test_the_loop_stopping_mid_exchange_finishes_it_and_hands_the_rest_to_the_thread(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    answers = Answers()
    committer = in_flight(hub, keeper, "in-flight", answers)
    assert committer._exchange is not None
    keeper.submit_reserve(request("queued"), answers.to("queued"), urgent=True)
    keeper.detach_loop()  # as when the consumer stops: the loop won't turn again
    assert isinstance(answers.got["in-flight"], Grant)  # answered by the detach itself
    answers.wait(["queued"])
    assert isinstance(answers.got["queued"], Grant)
    assert answers.threads["queued"] == "pulse-commit"
    # From now on every op goes to the committer thread.
    keeper.submit_reserve(request("after"), answers.to("after"), urgent=True)
    answers.wait(["after"])
    assert answers.threads["after"] == "pulse-commit"


def test_a_store_outage_fails_the_reservations_and_retries_the_completions(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper, pg_url: str) -> None:
    answers = Answers()
    keeper.submit_reserve(request("done"), answers.to("done"), urgent=True)
    run_loop(hub, lambda: "done" in answers.got)
    claim = keeper.add(answers.got["done"], time.monotonic(), 0, False)
    pipeline = store._pipeline
    assert pipeline is not None and pipeline._conn is not None
    backend_pid = pipeline._conn.info.backend_pid
    engine = sa.create_engine(pg_url)
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": backend_pid})
    engine.dispose()

    keeper.submit_complete(claim, SUCCEEDED, None, answers.to("completed"))
    keeper.submit_reserve(request("during"), answers.to("during"), urgent=True)
    run_loop(hub, lambda: "during" in answers.got)
    assert isinstance(answers.got["during"], StoreUnavailable)
    assert "completed" not in answers.got  # kept, to be sent again
    run_loop(hub, lambda: "completed" in answers.got)  # after its backoff, reconnected
    assert answers.got["completed"] == "applied"
    assert answers.threads["completed"] == "pulse-commit"  # it reconnected
    assert store.claim_counts().get(SUCCEEDED) == 1
    keeper.submit_reserve(request("after"), answers.to("after"), urgent=True)
    run_loop(hub, lambda: "after" in answers.got)  # and the loop goes on from there
    assert isinstance(answers.got["after"], Grant)
    assert answers.threads["after"] == threading.current_thread().name


def test_a_refused_reservation_is_answered_after_the_reads_the_thread_makes(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    (theirs,) = store.reserve("w2", [request("taken")], TTL)
    assert isinstance(theirs, Grant)
    answers = Answers()
    keeper.submit_reserve(request("taken"), answers.to("taken"), urgent=True)
    keeper.submit_reserve(request("free"), answers.to("free"), urgent=True)
    run_loop(hub, lambda: len(answers.got) == 2)
    refusal = answers.got["taken"]
    assert isinstance(refusal, Refusal) and refusal.holder == "w2"
    assert isinstance(answers.got["free"], Grant)
    assert answers.threads["taken"] == "pulse-commit"  # why it was refused: a read


def test_a_request_bigger_than_the_socket_takes_is_sent_on_from_the_loop(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    committer = committer_of(keeper)
    run_loop(hub, lambda: committer.active)
    big = request("big")
    body = b"x" * (32 * 2**20)  # more than any socket buffer takes at once
    big = ReserveRequest(big.task_id, big.task_name, Message(
        body, {"id": "big"}, {}, {}, "application/octet-stream", "binary"),
        big.policy, big.max_attempts, big.retries, big.publication, False)
    answers = Answers()
    keeper.submit_reserve(big, answers.to("big"), urgent=True)
    committer._tick()
    assert committer._exchange is not None and committer._exchange.flight.writing
    run_loop(hub, lambda: "big" in answers.got, timeout=30)
    assert isinstance(answers.got["big"], Grant)
    assert answers.threads["big"] == threading.current_thread().name


def test_the_first_exchange_connects_from_the_thread_and_the_next_go_from_the_loop(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    assert store._pipeline is not None
    store._pipeline.close()  # as in a new worker: no connection yet
    answers = Answers()
    keeper.submit_reserve(request("first"), answers.to("first"), urgent=True)
    run_loop(hub, lambda: "first" in answers.got)
    assert isinstance(answers.got["first"], Grant)
    assert answers.threads["first"] == "pulse-commit"
    keeper.submit_reserve(request("second"), answers.to("second"), urgent=True)
    run_loop(hub, lambda: "second" in answers.got)
    assert isinstance(answers.got["second"], Grant)
    assert answers.threads["second"] == threading.current_thread().name


def test_a_batch_the_store_only_takes_blocking_goes_through_the_thread(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    answers = Answers()
    # The same task twice in one batch: the pipelined statement can't take it.
    keeper.submit_reserve(request("twice"), answers.to("first"), urgent=True)
    keeper.submit_reserve(request("twice"), answers.to("second"), urgent=True)
    run_loop(hub, lambda: len(answers.got) == 2)
    granted = [answers.got[k] for k in ("first", "second") if isinstance(answers.got[k], Grant)]
    assert len(granted) == 1  # never granted twice
    assert set(answers.threads.values()) == {"pulse-commit"}
    # The loop goes on serving the next ones itself.
    keeper.submit_reserve(request("then"), answers.to("then"), urgent=True)
    run_loop(hub, lambda: "then" in answers.got)
    assert answers.threads["then"] == threading.current_thread().name


def test_starts_under_a_permit_go_from_the_loop_with_the_rest_of_the_exchange(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    """A start under a concurrency permit is one transaction of two round trips, sent
    and answered on the loop like any other exchange: the permit is taken, a second start
    waits for it, and a completion in the same exchange gives it back to that start."""
    answers = Answers()
    for name in ("a", "b"):
        keeper.submit_reserve(request(name), answers.to(name), urgent=True)
    run_loop(hub, lambda: len(answers.got) == 2)
    a, b = (keeper.add(answers.got[n], time.monotonic(), 0, False) for n in ("a", "b"))
    for claim in (a, b):
        claim.permits = (Permit("k", 1),)
    keeper.submit_start(a, answers.to("start-a"), urgent=True)
    run_loop(hub, lambda: "start-a" in answers.got)
    keeper.submit_start(b, answers.to("start-b"), urgent=True)
    run_loop(hub, lambda: "start-b" in answers.got)
    assert (answers.got["start-a"], answers.got["start-b"]) == (True, WAITING)
    exchanges = keeper.counters.exchanges
    keeper.submit_complete(a, SUCCEEDED, None, answers.to("done-a"))
    keeper.submit_start(b, answers.to("again-b"), urgent=True)
    run_loop(hub, lambda: "again-b" in answers.got)
    assert (answers.got["done-a"], answers.got["again-b"]) == ("applied", True)
    assert keeper.counters.exchanges == exchanges + 1  # one exchange: both went together
    assert set(answers.threads.values()) == {threading.current_thread().name}
    (usage,) = store.permit_usage()
    assert (usage.key, usage.running) == ("k", 1)
