"""SQLite's usual exchange made on the worker's event loop (:mod:`celery_pulse.store.sql.sqlite_loop`),
on a real SQLite store file and a real kombu hub (the loop a Celery worker runs), without a
worker process.

What is checked: ops submitted on the loop are exchanged and answered on the loop's thread,
not the commit thread; while another connection holds the write lock the loop does not
wait for it (the commit thread makes that exchange once the lock is free, and the loop
turns meanwhile); an exchange whose answer needs the general path (a refused reservation)
is rolled back on the loop and answered by the thread; an error in an exchange made on
the loop leaves nothing of it behind, and the exchanges after it work.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu.asynchronous import Hub

from celery_pulse.errors import PulseError
from celery_pulse.leases import LeaseKeeper
from celery_pulse.store.base import SUCCEEDED, Grant, Refusal
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.sql.sqlite import SqliteClaims
from tests.helpers.stores import claim_row, migrated
from tests.integration.test_loop_commit import TTL, Answers, attached, request, run_loop

LOOP = threading.current_thread().name


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture
def store(path: Path) -> Iterator[SqlStore]:
    sql = migrated(f"sqlite:///{path}")
    try:
        yield sql
    finally:
        sql.close()


@pytest.fixture
def keeper(store: SqlStore, hub: Hub) -> Iterator[LeaseKeeper]:
    with attached(store, hub) as keeper:
        committer = keeper._loop_committer
        assert committer is not None
        run_loop(hub, lambda: committer.active)  # the commit thread's backlog is through
        yield keeper


def made(store: SqlStore) -> dict[str, int]:
    claims = store.claims
    assert isinstance(claims, SqliteClaims)
    return dict(claims.made)


def test_ops_submitted_on_the_loop_are_exchanged_and_answered_on_the_loop(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    answers = Answers()
    for i in range(3):
        keeper.submit_reserve(request(f"t{i}"), answers.to(f"t{i}"), urgent=i == 0)
    run_loop(hub, lambda: len(answers.got) == 3)
    assert all(isinstance(answers.got[f"t{i}"], Grant) for i in range(3))
    assert set(answers.threads.values()) == {LOOP}
    assert keeper.counters.exchanges == 1  # the three went out together

    claims = [keeper.add(answers.got[f"t{i}"], time.monotonic(), 0, False) for i in range(3)]
    for claim in claims:
        keeper.submit_complete(claim, SUCCEEDED, None, answers.to(f"done-{claim.task_id}"))
    run_loop(hub, lambda: len(answers.got) == 6)
    assert [answers.got[f"done-t{i}"] for i in range(3)] == ["applied"] * 3
    assert set(answers.threads.values()) == {LOOP}
    assert made(store)["loop_exchanges"] == keeper.counters.exchanges == 2
    assert store.claim_counts().get(SUCCEEDED) == 3


def test_while_another_connection_holds_the_write_lock_the_loop_does_not_wait(
        store: SqlStore, path: Path, hub: Hub, keeper: LeaseKeeper) -> None:
    answers = Answers()
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # the write lock, as a renewal holds it
        keeper.submit_reserve(request("t1"), answers.to("t1"), urgent=True)
        ticks: list[float] = []
        began = time.monotonic()
        for turn in range(1, 4):  # the loop keeps turning (its timers fire) while it is held
            hub.call_later(0.05, lambda: ticks.append(time.monotonic()))
            run_loop(hub, lambda turn=turn: len(ticks) >= turn)
        assert made(store)["loop_exchanges_locked"] == 1
        # (Waiting for the lock, the loop would have been held for the busy timeout.)
        assert ticks[0] - began < 1.0, ticks[0] - began
        assert "t1" not in answers.got  # the commit thread waits for the lock
    finally:
        other.execute("COMMIT")
        other.close()
    run_loop(hub, lambda: "t1" in answers.got)
    assert isinstance(answers.got["t1"], Grant)
    assert answers.threads["t1"] == "pulse-commit"
    # The next exchange is the loop's again.
    keeper.submit_reserve(request("t2"), answers.to("t2"), urgent=True)
    run_loop(hub, lambda: "t2" in answers.got)
    assert isinstance(answers.got["t2"], Grant)
    assert answers.threads["t2"] == LOOP


def test_a_refused_reservation_is_rolled_back_on_the_loop_and_answered_by_the_thread(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    (theirs,) = store.reserve("w2", [request("held")], TTL)  # a live lease of another worker
    assert isinstance(theirs, Grant)
    answers = Answers()
    keeper.submit_reserve(request("held"), answers.to("held"), urgent=True)
    keeper.submit_reserve(request("free"), answers.to("free"), urgent=True)
    run_loop(hub, lambda: len(answers.got) == 2)
    assert isinstance(answers.got["held"], Refusal)
    assert isinstance(answers.got["free"], Grant) and answers.got["free"].epoch == 1
    assert answers.threads["held"] == answers.threads["free"] == "pulse-commit"
    assert made(store)["direct_exchanges_redone"] >= 1
    row = claim_row(store, "held")
    assert (row.holder, row.epoch) == ("w2", 1)  # the pass rolled back took nothing


def test_an_error_on_the_loop_leaves_nothing_and_the_next_exchange_works(
        store: SqlStore, hub: Hub, keeper: LeaseKeeper) -> None:
    answers = Answers()
    keeper.submit_reserve(request("done"), answers.to("done"), urgent=True)
    run_loop(hub, lambda: "done" in answers.got)
    claim = keeper.add(answers.got["done"], time.monotonic(), 0, False)
    with store.engine.begin() as conn:  # the reservation of task "boom" fails in SQLite
        conn.exec_driver_sql("CREATE TRIGGER boom BEFORE INSERT ON pulse_claims "
                             "WHEN NEW.task_id = 'boom' BEGIN SELECT RAISE(ABORT, 'boom'); END")

    keeper.submit_complete(claim, SUCCEEDED, None, answers.to("completed"))
    keeper.submit_reserve(request("boom"), answers.to("boom"), urgent=True)
    run_loop(hub, lambda: "boom" in answers.got)
    assert isinstance(answers.got["boom"], PulseError)
    assert claim_row(store, "done").state == "reserved"  # the completion went with it
    claims = store.claims
    assert isinstance(claims, SqliteClaims)
    assert not claims.on_loop.driver().in_transaction
    # The completion is sent again, and applies; a new reservation is granted.
    keeper.submit_reserve(request("after"), answers.to("after"), urgent=True)
    run_loop(hub, lambda: "completed" in answers.got and "after" in answers.got)
    assert answers.got["completed"] == "applied"
    assert isinstance(answers.got["after"], Grant)
    assert claim_row(store, "done").state == SUCCEEDED
