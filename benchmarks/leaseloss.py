"""Lease-loss reaction: from losing a lease to ``LeaseLost`` in the task, and to hard stop.

* takeover: while ``bench.watch`` runs, the claim is granted to someone else in the
  store (a raw SQL UPDATE bumping the epoch, as Recover would); measured: commit of
  that UPDATE -> the task's own record of ``LeaseLost``;
* hard stop: the same with ``bench.stubborn``, which catches and ignores ``LeaseLost``:
  -> the pool child is gone;
* store outage: a private PostgreSQL (the store) is stopped; measured: stop ->
  ``LeaseLost`` (the worker self-fences on its monotonic deadline), and how long before
  the store's own ``lease_until`` that came.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks import infra

CONF = {"pulse_lease_ttl": 6.0, "pulse_revoke_grace": 2.0}
PG_NOW = "extract(epoch from clock_timestamp())"


def renew_interval() -> float:
    return CONF["pulse_lease_ttl"] / 3


def _first(path: Path, word: str) -> list[str] | None:
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith(word + " "):
            return line.split()
    return None


def _state(engine: sa.Engine, task_id: str) -> str | None:
    with engine.connect() as conn:
        state = conn.execute(sa.text("SELECT state FROM pulse_claims WHERE task_id = :t"),
                             {"t": task_id}).scalar()
    return None if state is None else str(state)


def _take_over(engine: sa.Engine, task_id: str) -> float:
    """Grant the claim to a thief (epoch + 1, new token); returns the commit time."""
    with engine.begin() as conn:
        row = conn.execute(sa.text(
            f"UPDATE pulse_claims SET epoch = epoch + 1, holder = 'thief', token = :tok, "
            f"lease_until = {PG_NOW} + 60 WHERE task_id = :t RETURNING epoch"),
            {"tok": uuid.uuid4().hex, "t": task_id}).first()
    if row is None:
        raise RuntimeError(f"claim {task_id} not found")
    return time.time()


def _start_task(worker: infra.Worker, engine: sa.Engine, broker: str, queue: str, task: str,
                path: Path) -> str:
    task_id = infra.publish(broker, queue, [(task, [str(path), 60.0])])[0]
    infra.wait_for(lambda: _first(path, "start") or worker.check_alive(), 30,
                   f"{task} to start")
    infra.wait_for(lambda: _state(engine, task_id) == "running", 10, "the claim to be running")
    return task_id


def takeover_cases(scratch: infra.Scratch, database_url: str, repeats: int) -> dict[str, Any]:
    broker = infra.RABBIT_URL
    queue = f"bench-loss-{uuid.uuid4().hex[:10]}"
    reactions: list[float] = []
    hard: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(infra.fresh_pg_schema(database_url))
        engine = sa.create_engine(store, poolclass=sa.pool.NullPool)
        stack.callback(engine.dispose)
        infra.declare_queue(broker, queue)
        stack.callback(infra.delete_queue, broker, queue)
        started = stack.enter_context(infra.workers())
        worker = infra.Worker(scratch, "loss", pool="pulse", concurrency=2, broker=broker,
                              queue=queue, store=store, conf=CONF)
        started.append(worker)
        worker.wait_ready()
        for i in range(repeats):
            path = scratch.path("watch")
            task_id = _start_task(worker, engine, broker, queue, "bench.watch", path)
            # Different phases of the renewal cycle on each repeat.
            time.sleep((i * 0.37) % renew_interval())
            taken = _take_over(engine, task_id)
            lost = infra.wait_for(lambda p=path: _first(p, "lost") or worker.check_alive(),
                                  renew_interval() + 10, "LeaseLost in the task")
            reactions.append(float(lost[-1]) - taken)
            infra.log(f"  takeover -> LeaseLost {reactions[-1]:.2f}s")
        path = scratch.path("stubborn")
        task_id = _start_task(worker, engine, broker, queue, "bench.stubborn", path)
        start = _first(path, "start")
        assert start is not None
        pid = int(start[1])
        taken = _take_over(engine, task_id)
        ignored = infra.wait_for(lambda: _first(path, "ignored") or worker.check_alive(),
                                 renew_interval() + 10, "the stubborn task to see LeaseLost")
        infra.wait_for(lambda: not infra.pid_alive(pid), CONF["pulse_revoke_grace"] + 15,
                       "the stubborn child to be killed", 0.005)
        dead = time.time()
        worker.check_undisturbed()
        hard = {"lease_lost_s": float(ignored[-1]) - taken, "hard_stop_s": dead - taken,
                "after_lease_lost_s": dead - float(ignored[-1])}
        infra.log(f"  hard stop {hard['hard_stop_s']:.2f}s after the takeover")
    return {"takeover_s": reactions, "hard_stop": hard}


def outage_case(scratch: infra.Scratch) -> dict[str, Any]:
    broker = infra.RABBIT_URL
    queue = f"bench-outage-{uuid.uuid4().hex[:10]}"
    server = infra.PrivatePostgres().init()
    try:
        infra.migrate(server.url)
        engine = sa.create_engine(server.url, poolclass=sa.pool.NullPool)
        infra.declare_queue(broker, queue)
        with infra.workers() as started:
            worker = infra.Worker(scratch, "outage", pool="pulse", concurrency=2, broker=broker,
                                  queue=queue, store=server.url, conf=CONF)
            started.append(worker)
            worker.wait_ready()
            path = scratch.path("watch")
            task_id = _start_task(worker, engine, broker, queue, "bench.watch", path)
            time.sleep(0.7)
            with engine.connect() as conn:
                lease_until = float(conn.execute(sa.text(
                    "SELECT lease_until FROM pulse_claims WHERE task_id = :t"),
                    {"t": task_id}).scalar_one())
            engine.dispose()
            stopped = time.time()
            server.stop()
            lost = infra.wait_for(lambda: _first(path, "lost") or worker.check_alive(),
                                  CONF["pulse_lease_ttl"] + 10, "LeaseLost during the outage")
            t_lost = float(lost[-1])
            worker.check_undisturbed()
        infra.delete_queue(broker, queue)
    finally:
        server.destroy()
    return {"lease_lost_s": t_lost - stopped,
            # Positive: the task was told before the store could grant the lease again.
            # (lease_until read just before the stop; a renewal in between only adds margin.)
            "before_store_expiry_s": lease_until - t_lost}


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    database_url = infra.ensure_bench_database()
    infra.log("lease loss: store-side takeover")
    taken, _ = infra.retrying(
        functools.partial(takeover_cases, scratch, database_url, 2 if quick else 5), "lease loss")
    infra.log("lease loss: store outage")
    outage, _ = infra.retrying(lambda: outage_case(scratch), "store outage")
    infra.log(f"  outage -> LeaseLost {outage['lease_lost_s']:.2f}s")
    reactions = taken["takeover_s"]
    return {"conf": CONF, "renew_interval": renew_interval(),
            "bound_s": renew_interval() + 1.0,
            "takeover_s": reactions, "takeover_median_s": statistics.median(reactions),
            "takeover_max_s": max(reactions), "hard_stop": taken["hard_stop"],
            "outage": outage, "self_fence_s": CONF["pulse_lease_ttl"] - min(
                1.0, CONF["pulse_lease_ttl"] / 10)}
