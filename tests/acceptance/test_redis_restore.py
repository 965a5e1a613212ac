"""On Redis, a dead worker's deliveries that never got their reservation come back soon.

kombu takes a message off the Redis list and keeps a copy among the ``unacked`` until
it is acknowledged; pulse acknowledges at reservation. A worker SIGKILLed between the
two leaves the copy there, and only kombu's sweep (``restore_visible``) puts it back in
the queue, once it is older than ``visibility_timeout``. pulse sets that to 30 s (10
lease TTLs at least) and the sweep to every tick of kombu's 10 s timer: kombu's own
default sweeps on every 10th tick, which left such a delivery out for up to 100 s more
(the fault suite saw one still missing three minutes later).

The test holds the claim table locked so the worker's reservation waits, kills the
worker while the delivery sits among Redis's ``unacked``, and times its return. One
task: a second one queued behind it would be taken by the worker's next ``BRPOP``, and
a worker killed between that reply and kombu's record of it loses the message (kombu's
Redis transport; docs/faq.md). It runs on a Redis of its own: another test's workers
sweep a shared Redis too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_pulse.bootsteps.runtime import REDIS_VISIBILITY_MIN
from tests.fault.evidence import redis_messages
from tests.fault.nemesis import PrivateRedis
from tests.helpers import services
from tests.helpers.workers import Env, Worker, wait_for

FAST = {"pulse_lease_ttl": 3, "pulse_renew_interval": 0.5, "pulse_heartbeat_interval": 0.5,
        "pulse_worker_ttl": 3, "pulse_recover_interval": 0.5}
#: kombu's timer ticks every 10 s; a sweep on every tick finds a delivery at most one
#: tick after it turned visible. The rest is slack for a loaded machine (kombu's own
#: default would take up to 100 s past visibility: well past this bound).
BOUND = REDIS_VISIBILITY_MIN + 10 + 15


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    services.require("redis")
    redis = PrivateRedis().start()
    try:
        yield redis
    finally:
        redis.destroy()


def _where(env: Env, task_id: str) -> str:
    """The task's message in the broker: ready, unacknowledged, or nowhere."""
    queued, unacked = redis_messages(env)
    if any(task_id in m for m in queued):
        return "ready"
    return "unacknowledged" if any(task_id in m for m in unacked.values()) else "nowhere"


def _waiting_for_the_lock(conn: sa.Connection) -> int:
    return int(conn.execute(sa.text(
        "select count(*) from pg_locks where relation = 'pulse_claims'::regclass "
        "and not granted")).scalar_one())


def test_a_killed_workers_unreserved_delivery_comes_back_within_a_sweep(
        pg_url: str, private_redis: PrivateRedis, tmp_path: Path,
        make_env: Callable[..., Env], workers: Callable[..., Worker]) -> None:
    env = make_env(pg_url, private_redis.url, FAST)
    first = workers(env, "ra@%h").wait_ready()
    engine = sa.create_engine(pg_url)
    path = tmp_path / "t.txt"
    client = Celery("pulse-test-client", broker=env.broker_url, set_as_current=False)
    client.conf.task_default_queue = env.queue
    try:
        with engine.connect() as lock:
            # The reservation waits for the lock: the delivery stays unacknowledged.
            lock.execute(sa.text("lock table pulse_claims in access exclusive mode"))
            task_id = client.send_task("pulseapp.touch", args=[str(path)]).id
            wait_for(lambda: _waiting_for_the_lock(lock) and _where(env, task_id)
                     == "unacknowledged", 20,
                     "the worker's reservation waiting, its delivery unacknowledged")
            first.kill()
            killed = time.monotonic()
            # The dead worker's statements still wait for the lock (PostgreSQL notices a
            # dead client only when it writes to it) and would commit once it is released.
            lock.execute(sa.text(
                "select pg_terminate_backend(pid) from pg_locks "
                "where relation = 'pulse_claims'::regclass and not granted"))
            wait_for(lambda: not _waiting_for_the_lock(lock), 10,
                     "the dead worker's statements to end")
            lock.rollback()
        with engine.connect() as conn:
            assert conn.execute(sa.text("select count(*) from pulse_claims where task_id = :t"),
                                {"t": task_id}).scalar_one() == 0, "a reservation committed"
        assert _where(env, task_id) == "unacknowledged"
        workers(env, "rb@%h").wait_ready()
        try:
            wait_for(path.exists, BOUND + 10, "the task to run after the worker died",
                     interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its message is {_where(env, task_id)}") from None
        took = time.monotonic() - killed
        assert took <= BOUND, f"the delivery came back after {took:.1f}s, past {BOUND:.0f}s"
        assert _where(env, task_id) == "nowhere"  # acknowledged at its reservation
    finally:
        client.close()
        engine.dispose()
