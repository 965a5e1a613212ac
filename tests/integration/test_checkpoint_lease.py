"""``lease.checkpoint()`` and ``lease.last_checkpoint`` as a pool child runs them, on each
SQL store (issue 40): the child's checkpointer with and without a shared slot, a fenced
block that carries a checkpoint, and a stale attempt refused.

SQL only (``sql_store``): the child writes through its own store connection, and a
checkpoint inside ``lease.fenced(conn)`` goes through the application's connection.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from celery_pulse.errors import LeaseLost
from celery_pulse.lease import Lease
from celery_pulse.pool import checkpointing
from celery_pulse.pool.checkpointing import SlotCheckpointer
from celery_pulse.pool.slots import DeadlineTable
from celery_pulse.store.checkpoints import CheckpointTooLarge
from celery_pulse.store.records import Grant
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.sql.fence import make_fencer
from tests.contract.test_claims_contract import TTL, W1, W2, grant, key, request
from tests.helpers.stores import url_of


@dataclasses.dataclass
class Held:
    """What the worker's renewal knows of a lease (the keeper's LocalClaim)."""

    task_id: str
    epoch: int
    token: str
    slot: int | None


def attempt(store: SqlStore, g: Grant, *, holder: str = W1, table: DeadlineTable | None = None,
            slot: int | None = None,
            deadline: Callable[[], float] = lambda: time.monotonic() + 3600) -> Lease:
    """The lease a pool child builds for ``g`` (in ``slot`` of ``table``, if given)."""
    slots = None if table is None else table.checkpoints
    return Lease(g.task_id, g.epoch, g.token, holder,
                 read_deadline=lambda: (deadline(), False),
                 fencer=make_fencer(url_of(store), TTL), initial_deadline=deadline(),
                 checkpointer=SlotCheckpointer(lambda: store, holder, TTL, slots, slot))


def running(store: SqlStore, holder: str = W1, **kwargs: object) -> Grant:
    g = grant(store, holder, request(**kwargs))  # type: ignore[arg-type]
    assert store.start(holder, g.task_id, g.epoch, g.token, TTL) is not None
    return g


def taken_over(store: SqlStore, g: Grant) -> Grant:
    """The task requeued and granted to W2, as a later attempt."""
    (item,) = store.requeue(W1, [key(g)], publish_ttl=TTL)
    assert store.mark_published([(item.task_id, item.epoch, item.token or "")]) == 1
    again = grant(store, W2, request(g.task_id, publication="p1"))
    assert store.start(W2, again.task_id, again.epoch, again.token, TTL) is not None
    return again


def test_checkpoints_wait_commits_and_the_next_attempt_reads_it(sql_store: SqlStore) -> None:
    g = running(sql_store, publication="p1")
    lease = attempt(sql_store, g)
    assert lease.last_checkpoint is None  # a first attempt
    lease.checkpoint({"next": 50}, wait=True)
    lease.checkpoint({"next": 100}, wait=True)
    later = attempt(sql_store, taken_over(sql_store, g), holder=W2)
    seen = later.last_checkpoint
    assert seen is not None and (seen.value, seen.epoch) == ({"next": 100}, g.epoch)
    later.checkpoint({"next": 150})  # no slot: committed at once
    assert later.last_checkpoint is seen  # what an earlier attempt left, read once
    now = sql_store.last_checkpoint(g.task_id)
    assert now is not None and now.value == {"next": 150}


def test_checkpoints_a_stale_attempt_gets_lease_lost_and_writes_nothing(
        sql_store: SqlStore) -> None:
    g = running(sql_store, publication="p1")
    stale = attempt(sql_store, g)
    stale.checkpoint({"next": 10}, wait=True)
    taken_over(sql_store, g)
    with pytest.raises(LeaseLost, match="refused the checkpoint"):
        stale.checkpoint({"next": 20}, wait=True)
    assert stale.lost
    with pytest.raises(LeaseLost):  # known lost: refused before any write
        stale.checkpoint({"next": 30})
    cp = sql_store.last_checkpoint(g.task_id)
    assert cp is not None and cp.value == {"next": 10}


def test_checkpoints_past_the_local_deadline_raise_before_any_write(
        sql_store: SqlStore) -> None:
    """A paused holder resumed past its deadline: LeaseLost from ``checkpoint()`` itself."""
    g = running(sql_store)
    past = time.monotonic() - 1
    lease = attempt(sql_store, g, deadline=lambda: past)
    with pytest.raises(LeaseLost):
        lease.checkpoint({"next": 1}, wait=True)
    assert sql_store.last_checkpoint(g.task_id) is None


def test_checkpoints_wait_false_waits_in_the_slot_until_carried_or_flushed(
        sql_store: SqlStore) -> None:
    table = DeadlineTable(size=4)
    g = running(sql_store)
    slot = table.assign(g.task_id, time.monotonic() + 3600)
    held = [Held(g.task_id, g.epoch, g.token, slot)]
    lease = attempt(sql_store, g, table=table, slot=slot)
    lease.checkpoint({"next": 50})
    assert sql_store.last_checkpoint(g.task_id) is None  # left for the renewal
    (pending,) = table.checkpoints.pending(held)
    assert (pending.seq, pending.value) == (1, '{"next":50}')
    # The renewal carries it, as the worker's renewer does.
    assert sql_store.checkpoint(W1, [pending]) == ({g.task_id}, set())
    table.checkpoints.mark_carried(held, [pending])
    assert table.checkpoints.pending(held) == []
    checkpointing.flush(lease)  # nothing left to flush: no write
    lease.checkpoint({"next": 100})
    assert [w.seq for w in table.checkpoints.pending(held)] == [2]
    checkpointing.flush(lease)  # the body ended before a renewal carried it
    cp = sql_store.last_checkpoint(g.task_id)
    assert cp is not None and cp.value == {"next": 100}
    # A slot given to the next lease holds nothing of this one.
    table.free(slot)
    again = table.assign("another", time.monotonic() + 3600)
    assert again == slot and table.checkpoints.pending(
        [Held("another", 1, "t", again)]) == []


def test_checkpoints_inside_a_fenced_block_commit_with_it(sql_store: SqlStore) -> None:
    g = running(sql_store)
    lease = attempt(sql_store, g)
    engine = sa.create_engine(url_of(sql_store))
    try:
        with engine.connect() as conn, lease.fenced(conn):
            lease.checkpoint({"next": 1})
        cp = sql_store.last_checkpoint(g.task_id)
        assert cp is not None and cp.value == {"next": 1}
        with pytest.raises(RuntimeError), engine.connect() as conn, lease.fenced(conn):
            lease.checkpoint({"next": 2})
            raise RuntimeError("the block fails: its checkpoint goes with it")
        cp = sql_store.last_checkpoint(g.task_id)
        assert cp is not None and cp.value == {"next": 1}
        lease.checkpoint({"next": 3})  # after the block: on its own again
        cp = sql_store.last_checkpoint(g.task_id)
        assert cp is not None and cp.value == {"next": 3}
    finally:
        engine.dispose()


def test_checkpoints_a_bad_value_is_refused_before_anything(sql_store: SqlStore) -> None:
    g = running(sql_store)
    lease = attempt(sql_store, g)
    with pytest.raises(CheckpointTooLarge):
        lease.checkpoint("x" * 70_000)
    with pytest.raises(TypeError):
        lease.checkpoint({1, 2})
    assert lease.checkpoint_seq == 0 and sql_store.last_checkpoint(g.task_id) is None
    assert not lease.lost
