"""The lease keeper's local table: lost attempts stay fenced, warm shutdown gives back
what never ran. On the SQLite store (a file per test), no worker process."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from celery_pulse.leases import RUNNING, LeaseKeeper, LocalClaim
from celery_pulse.store.base import Grant, Message, ReserveRequest
from celery_pulse.store.sql import SqlStore, open_store

TTL = 30.0


class Listener:
    def __init__(self) -> None:
        self.lost: list[LocalClaim] = []
        self.hard_stopped: list[LocalClaim] = []

    def on_lost(self, claim: LocalClaim) -> None:
        self.lost.append(claim)

    def on_hard_stop(self, claim: LocalClaim) -> None:
        self.hard_stopped.append(claim)

    def on_renewed(self, claims: Sequence[LocalClaim]) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    sql = open_store(f"sqlite:///{tmp_path / 'keeper.sqlite3'}", check_schema=False)
    sql.migrate()
    yield sql
    sql.close()


def reserve(store: SqlStore, task_id: str, publication: str) -> Grant:
    message = Message(b"[[], {}, {}]", {"id": task_id}, {}, {}, "application/json", "utf-8")
    (grant,) = store.reserve("w1", [ReserveRequest(task_id, "t", message, "redispatch", 10, 0,
                                                   publication)], TTL)
    assert isinstance(grant, Grant)
    return grant


def test_a_newer_grant_of_the_task_still_hard_stops_the_lost_attempt(store: SqlStore) -> None:
    clock, listener = Clock(), Listener()
    keeper = LeaseKeeper(store, "w1", ttl=TTL, interval=1, margin=1, grace=2,
                         listener=listener, monotonic=clock)
    old = keeper.add(reserve(store, "t1", "p1"), clock(), 0, False)
    old.pid = 4242  # running in a pool process
    keeper._lose(old, "taken over")
    store.release("w1", [old.key], never_ran=True)
    new = keeper.add(reserve(store, "t1", "p1"), clock(), 0, False)
    assert keeper.get("t1") is new
    clock.now += 3  # past the grace, and the old attempt ignored LeaseLost
    keeper.enforce_deadlines()
    assert listener.hard_stopped == [old]
    keeper.forget(old)  # its result came back: nothing left to stop
    assert keeper.get("t1") is new and keeper._displaced == {}


def test_warm_shutdown_never_releases_a_job_handed_to_the_pool(store: SqlStore) -> None:
    """Accepted or not seen accepted: a job in the pool may have run, so it stays running.

    Only reservations and starts that never reached the pool are released as never run;
    the others' leases expire and Recover decides by the task's policy.
    """
    keeper = LeaseKeeper(store, "w1", ttl=TTL, interval=1, margin=1, grace=2,
                         listener=Listener())
    clock = keeper.monotonic
    handed, accepted, _ = (keeper.add(reserve(store, t, "p"), clock(), 0, False)
                           for t in ("a", "b", "c"))
    for claim in (handed, accepted):
        assert store.start("w1", claim.task_id, claim.epoch, claim.token, TTL)
        keeper.mark_running(claim)
        claim.in_pool = True
    accepted.pid = 4242
    keeper.stop()
    states = {c.task_id: c.state for c in store.list_claims()}
    assert states == {"a": RUNNING, "b": RUNNING, "c": "reserved"}
