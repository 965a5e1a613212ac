"""How many store connections a real ``celery worker -P pulse`` opens, per process and
role, counted on the PostgreSQL server by the name each connection gives
(``pg_stat_activity.application_name``), against the formula ``docs/production.md``
states: the parent ``pulse_store_pool_size`` + 2 (the hot path's pipeline and the
permit signals' LISTEN) + at most 2 of the ``pulse://`` backend; each pool child 1 (+ 1
for chord parts with ``pulse://``).

The load exercises every user of the store: renewals (a 3 s lease, renewed every
second, on tasks that outlast it), starts, a concurrency limit (permits and their
signals), the beat firing every second, ``pulse://`` results read with ``get()`` and a
chord, and Recover taking over the claims of a second worker SIGKILLed mid-task.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, chord

import celery_pulse
from celery_pulse.store.records import RUNNING, SUCCEEDED
from celery_pulse.store.sql import sizing
from tests.helpers.connections import MARIADB_NAMES, Peaks, mariadb_with_connect_attrs
from tests.helpers.mariadb import PrivateMariaDB
from tests.helpers.workers import Env, Worker, wait_alive

#: The parent's connections outside its pool, on PostgreSQL.
DEDICATED = 2
#: The ``pulse://`` backend's connections in a worker's parent, one per thread that uses
#: it: the chord finisher's, Recover's (the leader's chord sweep, a spent budget's
#: failure) and the event loop (Celery's own writes). CI once saw all three at once.
PARENT_BACKEND = 3

#: Renewals every second (a third of the TTL): tasks of 1.5 s renew at least once.
FAST_LEASES: dict[str, Any] = {"pulse_lease_ttl": 3, "pulse_worker_ttl": 6,
                               "pulse_recover_interval": 0.5}


def conf_with(pool_size: int, tick: str) -> dict[str, Any]:
    return {**FAST_LEASES, "pulse_store_pool_size": pool_size,
            "result_backend": "pulse://",
            "pulse_concurrency_limits": {"pulseapp.add": 1},
            "beat_schedule": {"tick": {"task": "pulseapp.touch", "schedule": 1.0,
                                       "args": [tick]}}}


@contextmanager
def client(env: Env) -> Iterator[Celery]:
    app = Celery("conns-client", broker=env.broker_url, backend="pulse://",
                 set_as_current=False)
    app.conf.update(task_default_queue=env.queue, pulse_store_url=env.store_url)
    celery_pulse.install(app)
    try:
        yield app
    finally:
        app.close()


def claim_rows(store_url: str) -> list[Any]:
    engine = sa.create_engine(store_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text("SELECT task_id, state, epoch FROM pulse_claims")))
    finally:
        engine.dispose()


def test_worker_connections_stay_within_the_stated_bound(
        pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker], tmp_path: Any) -> None:
    pool_size, concurrency = 2, 2
    tick = str(tmp_path / "tick")
    env = make_env(pg_url, rabbitmq_url, conf_with(pool_size, tick))
    doomed = workers(env, "doomed@%h", concurrency=1).wait_ready(60)
    with client(env) as app:
        # Recover: a task started on a worker that dies, taken over by the one measured
        # (started after the task is running, so that the dead worker has it).
        lost = app.send_task("pulseapp.sleep", (30.0,))
        wait_alive(lambda: any(r.task_id == lost.id and r.state == RUNNING
                               for r in claim_rows(pg_url)), 60, "a task running", (doomed,))
        w = workers(env, "conns@%h", concurrency=concurrency).wait_ready(60)
    with Peaks(w.pid) as peaks, client(env) as app:
        doomed.kill()
        slow = [app.send_task("pulseapp.sleep", (1.5,)) for _ in range(6)]
        adds = [app.send_task("pulseapp.add", (i, i)) for i in range(20)]
        joined = chord(app.signature("pulseapp.add", (i, 1)) for i in range(5))(
            app.signature("pulseapp.total"))
        assert [r.get(timeout=120) for r in adds] == [2 * i for i in range(20)]
        assert [r.get(timeout=120) for r in slow] == [1.5] * 6
        assert joined.get(timeout=120) == sum(i + 1 for i in range(5))
        wait_alive(lambda: any(r.task_id == lost.id and r.state != RUNNING
                               for r in claim_rows(pg_url)),
                   60, "Recover to take over the dead worker's task", (w,))
        wait_alive(lambda: (tmp_path / "tick").exists() and
                   (tmp_path / "tick").read_text().count("\n") >= 3, 30, "the beat to fire", (w,))
    by_process = {f"{role}:{pid}": n for (role, pid), n in sorted(peaks.by_process.items())}
    assert peaks.samples > 20, peaks.samples
    parent = {role: n for (role, pid), n in peaks.by_process.items() if pid == w.pid}
    children = [(role, n) for (role, pid), n in peaks.by_process.items() if pid != w.pid]
    # Every user of the store ran: the parent's pool and dedicated connections, a
    # child's store (chord parts write through the backend there).
    assert parent.get("worker", 0) >= 2, by_process
    assert parent.get("worker", 0) <= pool_size + DEDICATED, by_process
    assert parent.get("backend", 0) <= PARENT_BACKEND, by_process
    assert all(n <= sizing.CHILD_POOL_SIZE for role, n in children
               if role in ("child", "backend")), by_process
    assert {role for role, _ in children} <= {"child", "backend"}, by_process
    stated = (pool_size + DEDICATED + PARENT_BACKEND
              + concurrency * (sizing.CHILD_POOL_SIZE + 1))
    assert peaks.total <= stated, (peaks.total, stated, by_process)
    print(f"peaks: total {peaks.total} (stated {stated}), {by_process}")


@pytest.fixture
def mariadb_with_attrs() -> Iterator[PrivateMariaDB]:
    with mariadb_with_connect_attrs() as server:
        yield server


def test_mariadb_worker_connections_stay_within_the_stated_bound(
        mariadb_with_attrs: PrivateMariaDB, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """On MariaDB (PyMySQL's ``program_name``): no pipeline, no LISTEN, so the parent
    keeps its pool and nothing more."""
    pool_size, concurrency = 2, 2
    env = make_env(mariadb_with_attrs.url, rabbitmq_url, {
        **FAST_LEASES, "pulse_store_pool_size": pool_size, "result_backend": "pulse://",
        "pulse_concurrency_limits": {"pulseapp.add": 1}})
    w = workers(env, "conns-maria@%h", concurrency=concurrency).wait_ready(60)
    root_url = mariadb_with_attrs.url.rsplit("/", 1)[0] + "/performance_schema"
    with Peaks(w.pid, admin_url=root_url, names_sql=MARIADB_NAMES) as peaks, \
            client(env) as app:
        slow = [app.send_task("pulseapp.sleep", (1.5,)) for _ in range(4)]
        adds = [app.send_task("pulseapp.add", (i, i)) for i in range(20)]
        assert [r.get(timeout=120) for r in adds] == [2 * i for i in range(20)]
        assert [r.get(timeout=120) for r in slow] == [1.5] * 4
    by_process = {f"{role}:{pid}": n for (role, pid), n in sorted(peaks.by_process.items())}
    parent = {role: n for (role, pid), n in peaks.by_process.items() if pid == w.pid}
    assert peaks.samples > 20, peaks.samples
    assert 1 <= parent.get("worker", 0) <= pool_size, by_process
    assert parent.get("backend", 0) <= PARENT_BACKEND, by_process
    assert all(n <= sizing.CHILD_POOL_SIZE for (role, pid), n in peaks.by_process.items()
               if pid != w.pid), by_process
    print(f"peaks on MariaDB: total {peaks.total}, {by_process}")


@pytest.mark.parametrize("concurrency", [2])
def test_the_smallest_pool_runs_200_tasks_with_no_lease_lost(
        pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker], concurrency: int) -> None:
    """``pulse_store_pool_size = 1``: every thread of the parent shares one pooled
    connection; renewals (every second) still land, and no lease is lost."""
    env = make_env(pg_url, rabbitmq_url, {**FAST_LEASES, "pulse_store_pool_size": 1,
                                          "result_backend": "pulse://"})
    w = workers(env, f"small-{uuid.uuid4().hex[:6]}@%h", concurrency=concurrency)
    w.wait_ready(60)
    with Peaks(w.pid) as peaks, client(env) as app:
        sent = [app.send_task("pulseapp.sleep", (0.01 if i % 20 else 1.5,)) for i in range(200)]
        for result in sent:
            result.get(timeout=180)
    rows = claim_rows(pg_url)
    assert len(rows) == 200
    assert {r.state for r in rows} == {SUCCEEDED}, {r.state for r in rows}
    assert max(r.epoch for r in rows) == 1  # never taken over: no lease was lost
    assert "lost" not in w.log().lower(), w.log()[-3000:]
    parent = {role: n for (role, pid), n in peaks.by_process.items() if pid == w.pid}
    assert parent.get("worker", 0) <= 1 + DEDICATED, peaks.by_process
