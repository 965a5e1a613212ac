"""Checkpoints carried by the lease (issue 40), with real ``celery worker -P pulse``
processes on every store.

A walk over items 0..999 records a checkpoint every 50 items (``tests.apps.checkpointapp``
journals each item, each checkpoint and where each attempt began). Its worker is
SIGKILLed at a seeded point (``PULSE_CHECKPOINT_SEED``): the attempt Recover starts
elsewhere begins at the last committed checkpoint, redoes only what came after it, and
skips nothing. A SIGSTOPped holder resumed after the takeover gets LeaseLost at its next
checkpoint, and its value never becomes the task's checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_pulse.store.sql import SqlStore, open_store
from tests.conftest import STORES
from tests.helpers.workers import Env, Worker, wait_alive, wait_for

APP = "tests.apps.checkpointapp"
FAST: dict[str, Any] = {"pulse_lease_ttl": 3, "pulse_renew_interval": 0.5,
                        "pulse_recover_interval": 0.5, "pulse_worker_ttl": 3,
                        "pulse_heartbeat_interval": 0.5}
SEED = int(os.environ.get("PULSE_CHECKPOINT_SEED", "40"))
#: Walks per kill: each its own pace, so the kill finds each at another point.
WALKS = 10
EVERY = 50
TOTAL = 1000
#: A checkpoint called this long before the kill was committed by then (renewals every
#: 0.5 s carry it; the rest is slack for a loaded machine).
FRESH = 2.0


@dataclasses.dataclass(frozen=True)
class Line:
    kind: str
    task_id: str
    epoch: int
    value: int
    at: float


def read(path: Path) -> list[Line]:
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if text and not text.endswith("\n"):
        lines = lines[:-1]  # being written
    out = []
    for line in lines:
        kind, task_id, epoch, value, *rest = line.split()
        out.append(Line(kind, task_id, int(epoch), int(value), float(rest[-1])))
    return out


def of(lines: list[Line], task_id: str, kind: str, epoch: int | None = None) -> list[Line]:
    return [x for x in lines if x.task_id == task_id and x.kind == kind
            and (epoch is None or x.epoch == epoch)]


@pytest.fixture
def cenv(make_env: Callable[..., Env]) -> Callable[..., Env]:
    def factory(store_url: str, broker_url: str) -> Env:
        env = make_env(store_url, broker_url, FAST)
        return Env(env.store_url, env.broker_url, env.queue, env.tmp, env.conf, app=APP)
    return factory


@pytest.fixture
def producer() -> Iterator[Callable[[str], Celery]]:
    made: list[Celery] = []

    def make(broker_url: str) -> Celery:
        app = Celery("checkpoint-client", broker=broker_url)
        made.append(app)
        return app
    yield make
    for app in made:
        app.close()


@contextlib.contextmanager
def opened(url: str) -> Iterator[SqlStore]:
    store = open_store(url, check_schema=False)
    try:
        yield store
    finally:
        store.close()


@pytest.mark.parametrize("store_url", STORES, indirect=True)
def test_checkpoints_a_killed_walk_resumes_at_its_last_committed_checkpoint(
        store_url: str, rabbitmq_url: str, cenv: Callable[..., Env],
        workers: Callable[..., Worker], producer: Callable[[str], Celery],
        tmp_path: Path) -> None:
    """Ten walks (half with ``wait=True``) on one worker, SIGKILLed when the first reaches
    a seeded item; a second worker finishes them: each re-run begins at the checkpoint the
    store holds, which is the killed attempt's latest committed one, and between the two
    attempts every item is done, none skipped."""
    rng = random.Random(SEED)
    print(f"\nPULSE_CHECKPOINT_SEED={SEED}")
    env = cenv(store_url, rabbitmq_url)
    path = tmp_path / "journal.txt"
    a = workers(env, "a@%h", concurrency=WALKS).wait_ready()
    app = producer(rabbitmq_url)
    waits = {}
    for n in range(WALKS):
        result = app.send_task("checkpointapp.walk", queue=env.queue, kwargs={
            "path": str(path), "total": TOTAL, "every": EVERY,
            "pause": rng.uniform(0.006, 0.012), "wait": n % 2 == 1})
        waits[result.id] = n % 2 == 1
    ids = list(waits)
    kill_at = rng.randrange(400, 900)
    wait_alive(lambda: len(of(read(path), ids[0], "item")) > kill_at, 60,
               f"the first walk to reach item {kill_at}", (a,))
    a.kill()
    first = read(path)
    with opened(store_url) as store:
        held = {task_id: store.last_checkpoint(task_id) for task_id in ids}

    b = workers(env, "b@%h", concurrency=WALKS).wait_ready()
    wait_alive(lambda: all(of(read(path), t, "end") for t in ids), 120,
               "every walk to end on the second worker", (b,))
    lines = read(path)
    redone_total = 0
    for task_id in ids:
        (begun,) = of(first, task_id, "begin")
        done_first = [x.value for x in of(first, task_id, "item")]
        called = of(first, task_id, "checkpoint")
        reruns = [x for x in of(lines, task_id, "begin") if x.epoch > begun.epoch]
        assert len(reruns) == 1, reruns
        rerun = reruns[0]
        cp = held[task_id]
        # The re-run began where the store's checkpoint says, written by the killed attempt.
        start = 0 if cp is None else cp.value["next"]
        assert rerun.value == start, (task_id, rerun, cp)
        assert rerun.kind == "begin" and (cp is None or (cp.epoch == begun.epoch
                                                          and cp.value["epoch"] == begun.epoch))
        # Committed means called: a cursor the killed attempt reached (its journal line may
        # be missing only if the kill came between the call and the line).
        reached = {x.value for x in called} | {max(done_first, default=-1) + 1}
        assert start == 0 or start in reached, (start, reached)
        # Fresh: every checkpoint() that returned (wait=True) or was called FRESH seconds
        # before the kill (carried by a renewal since) is in the store.
        killed_at = max(x.at for x in first)
        due = [x.value for x in called if waits[task_id] or x.at <= killed_at - FRESH]
        assert start >= max(due, default=0), (task_id, start, due, waits[task_id])
        # Nothing skipped, nothing done twice in one attempt.
        assert done_first == list(range(len(done_first)))
        assert [x.value for x in of(lines, task_id, "item", rerun.epoch)] == list(
            range(start, TOTAL))
        assert start <= len(done_first)
        redone = len(done_first) - start
        if waits[task_id]:  # every checkpoint committed before the walk went on
            assert redone <= EVERY, (task_id, redone)
        redone_total += redone
        assert len(of(lines, task_id, "end")) == 1
    print(f"kill at item {kill_at} of walk 1: {redone_total} items redone over {WALKS} "
          f"walks (at most {EVERY} each with wait=True)")


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_checkpoints_a_retry_resumes_from_the_checkpoint_of_the_attempt_before(
        store_url: str, rabbitmq_url: str, cenv: Callable[..., Env],
        workers: Callable[..., Worker], producer: Callable[[str], Celery],
        tmp_path: Path) -> None:
    """On the embedded default store: a body that checkpoints (left for the renewal) and
    then calls ``self.retry()`` ends before any renewal could carry it; the value is
    committed as the body ends, and the retry begins from it."""
    env = cenv(store_url, rabbitmq_url)
    path = tmp_path / "journal.txt"
    a = workers(env, "a@%h", concurrency=1).wait_ready()
    result = producer(rabbitmq_url).send_task("checkpointapp.retrying", queue=env.queue,
                                              args=[str(path), 321])
    wait_alive(lambda: of(read(path), result.id, "end"), 60, "the retry to end", (a,))
    first, second = of(read(path), result.id, "begin")
    assert (first.value, second.value) == (0, 321)
    assert second.epoch > first.epoch
    (end,) = of(read(path), result.id, "end")
    assert end.epoch == second.epoch


@pytest.mark.postgres
def test_checkpoints_a_paused_holder_resumed_after_takeover_gets_lease_lost(
        pg_url: str, redis_url: str, cenv: Callable[..., Env],
        workers: Callable[..., Worker], producer: Callable[[str], Celery],
        tmp_path: Path) -> None:
    """SIGSTOP the walking worker, let Recover give the walk to another, SIGCONT: the old
    attempt ends on LeaseLost (the worker's revoke or its next checkpoint, whichever comes
    first), none of its values is the checkpoint from then on, and the one the store holds
    as the new attempt ends is the new attempt's own. (Redis: a paused RabbitMQ
    consumer's open channel would hold the re-dispatched message in its prefetch.)
    That a stale attempt's own ``checkpoint()`` raises and writes nothing is
    tests/integration/test_checkpoint_lease.py's."""
    env = cenv(pg_url, redis_url)
    path = tmp_path / "journal.txt"
    a = workers(env, "a@%h", concurrency=1).wait_ready()
    b = workers(env, "b@%h", concurrency=1).wait_ready()
    app = producer(redis_url)
    task_id = app.send_task("checkpointapp.walk", queue=env.queue, kwargs={
        "path": str(path), "total": 600, "every": 10, "pause": 0.01}).id
    wait_alive(lambda: len(of(read(path), task_id, "checkpoint")) >= 3, 60,
               "the walk's first checkpoints", (a, b))
    (first,) = of(read(path), task_id, "begin")
    # The walk runs on whichever worker got it: pause that one.
    paused = a if "a@" in _holder_of(pg_url, task_id) else b
    other = b if paused is a else a
    with opened(pg_url) as store:
        wait_for(lambda: store.last_checkpoint(task_id), 10, "a committed checkpoint")
    paused.signal(signal.SIGSTOP)
    try:
        rerun = wait_alive(lambda: [x for x in of(read(path), task_id, "begin")
                                    if x.epoch > first.epoch], 60,
                           "the walk's re-run on the other worker", (other,))[0]
        assert rerun.value > 0  # it resumed from the paused attempt's checkpoint
        wait_alive(lambda: of(read(path), task_id, "checkpoint", rerun.epoch), 30,
                   "the re-run's first checkpoint", (other,))
    finally:
        paused.signal(signal.SIGCONT)
    lost = wait_for(lambda: of(read(path), task_id, "lost", first.epoch), 30,
                    "the paused attempt's LeaseLost")
    assert len(lost) == 1
    with opened(pg_url) as store:
        seen = [store.last_checkpoint(task_id)]

        def ended() -> bool:
            # The store records the outcome after the body's uncarried checkpoint is
            # committed; the body's own "end" line comes before both.
            seen.append(store.last_checkpoint(task_id))
            detail = store.claim_detail(task_id)
            return detail is not None and detail.claim.finished_at is not None
        wait_alive(ended, 60, "the re-run's outcome in the store", (other,))
        cp = store.last_checkpoint(task_id)
        assert of(read(path), task_id, "end", rerun.epoch)
    # From the resume on, every checkpoint read is the new attempt's, or the one it began
    # from (its own first ones are carried by a renewal): never one the paused attempt
    # wrote after it.
    assert all(c is not None and (c.epoch == rerun.epoch or (
        c.epoch == first.epoch and c.value["next"] == rerun.value)) for c in seen), seen
    assert seen[-1] is not None and seen[-1].epoch == rerun.epoch
    assert cp is not None and cp.epoch == rerun.epoch and cp.value == {
        "next": 600, "epoch": rerun.epoch}
    # The stale attempt wrote nothing after its lease was taken: every checkpoint the
    # re-run read or the store holds is of an attempt that held the lease at the time.
    assert not of(read(path), task_id, "end", first.epoch)


def _holder_of(url: str, task_id: str) -> str:
    with opened(url) as store:
        found = [c for c in store.list_claims(limit=100) if c.task_id == task_id]
    assert found and found[0].holder, found
    return found[0].holder
