"""Recovery after SIGKILL: how long until a killed worker's task runs again (or is reviewed).

Worker A (``-c 1``) starts a 60 s task and prefetches 3 short ones; worker B is started
and ready; then A's whole process group gets SIGKILL. Measured: kill -> the task's
body starting again on B (``acks_late``), or kill -> ``needs_review`` in the claim table
(pulse, not ``acks_late``), and how many of the 3 prefetched tasks ran after all.
Plain Celery on RabbitMQ is measured the same way (the broker redelivers unacked
messages when the dead worker's connection closes); on Redis it waits for the
transport's ``visibility_timeout``, which is stated, not waited for.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks import infra

CONF = {"pulse_lease_ttl": 5.0, "pulse_recover_interval": 2.0}
PREFETCHED = 3
REDIS_VISIBILITY_TIMEOUT = 3600.0  # kombu's default for the Redis transport


def bound() -> float:
    """DESIGN §5: crash -> re-dispatched or needs_review within ttl + recover_interval + 1 s."""
    return CONF["pulse_lease_ttl"] + CONF["pulse_recover_interval"] + 1.0


def _lines(path: Path, word: str) -> list[list[str]]:
    if not path.exists():
        return []
    return [ln.split() for ln in path.read_text().splitlines() if ln.startswith(word + " ")]


def scenario(scratch: infra.Scratch, database_url: str, broker: str, pool: str,
             task: str) -> dict[str, Any]:
    broker_url = infra.BROKERS[broker]
    queue = f"bench-rec-{uuid.uuid4().hex[:10]}"
    journal = scratch.path("journal")
    touched = scratch.path("touched")
    out: dict[str, Any] = {"broker": broker, "pool": pool, "task": task,
                           "acks_late": task == "bench.late"}
    with contextlib.ExitStack() as stack:
        store = (stack.enter_context(infra.fresh_pg_schema(database_url))
                 if pool == "pulse" else None)
        engine = sa.create_engine(store, poolclass=sa.pool.NullPool) if store else None
        infra.declare_queue(broker_url, queue)
        stack.callback(infra.delete_queue, broker_url, queue)
        started = stack.enter_context(infra.workers())
        conf = CONF if pool == "pulse" else {}
        a = infra.Worker(scratch, "rec-a", pool=pool, concurrency=1, broker=broker_url,
                         queue=queue, store=store, conf=conf)
        started.append(a)
        a.wait_ready()
        task_id = infra.publish(broker_url, queue, [(task, [str(journal), 60.0])])[0]
        infra.wait_for(lambda: _lines(journal, "start") or a.check_alive(), 30,
                       "the task to start on A")
        infra.publish(broker_url, queue, [("bench.touch", [str(touched)])] * PREFETCHED)
        if engine is not None:
            infra.wait_for(lambda: _count(engine, "reserved") >= PREFETCHED, 20,
                           "A to reserve the prefetched tasks")
        elif broker == "rabbitmq":
            infra.wait_for(lambda: infra.queue_depth(broker_url, queue) == 0, 20,
                           "A to prefetch the short tasks")
        else:
            time.sleep(1.0)
        # B has a free process for the prefetched tasks while it re-runs the long one.
        b = infra.Worker(scratch, "rec-b", pool=pool, concurrency=2, broker=broker_url,
                         queue=queue, store=store, conf=conf)
        started.append(b)
        b.wait_ready()
        time.sleep(0.3)
        killed = time.time()
        a.kill()
        # Long enough for pulse's bound; a plain-Celery task that is not back by then is
        # not coming back (its message was acknowledged before the kill).
        window = bound() + (7.0 if pool == "pulse" else 3.0)
        if engine is not None and task == "bench.plain":
            def reviewed() -> float | None:
                b.check_alive()
                with engine.connect() as conn:
                    state = conn.execute(sa.text("SELECT state FROM pulse_claims WHERE "
                                                 "task_id = :t"), {"t": task_id}).scalar()
                return time.time() if state == "needs_review" else None
            out["outcome"] = "needs_review"
            out["seconds"] = infra.wait_for(reviewed, window, "needs_review", 0.02) - killed
        else:
            def rerun() -> float | None:
                b.check_alive()
                again = [ln for ln in _lines(journal, "start") if ln[3].startswith("rec-b@")]
                return float(again[0][-1]) if again else None
            try:
                out["seconds"] = infra.wait_for(rerun, window, "the task to run again") - killed
                out["outcome"] = "re-run"
            except TimeoutError:
                out["seconds"] = None
                out["outcome"] = f"not re-run within {window:g} s (lost)"
        with contextlib.suppress(TimeoutError):
            infra.wait_for(lambda: len(_lines(touched, "touch")) >= PREFETCHED, 10,
                           "the prefetched tasks to run")
        ran = len({ln[1] for ln in _lines(touched, "touch")})
        for w in (a, b):
            w.check_undisturbed()
        out["prefetched"] = PREFETCHED
        out["prefetched_lost"] = PREFETCHED - ran
        if engine is not None:
            engine.dispose()
    return out


def _count(engine: sa.Engine, state: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM pulse_claims WHERE state = :s"),
                                {"s": state}).scalar_one())


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    database_url = infra.ensure_bench_database()
    if quick:
        cases = [("rabbitmq", "pulse", "bench.late"), ("rabbitmq", "prefork", "bench.late")]
    else:
        cases = [("rabbitmq", "pulse", "bench.late"), ("redis", "pulse", "bench.late"),
                 ("rabbitmq", "pulse", "bench.plain"), ("rabbitmq", "prefork", "bench.late"),
                 ("rabbitmq", "prefork", "bench.plain")]
    results = []
    for broker, pool, task in cases:
        infra.log(f"recovery: {pool} on {broker}, {task}")
        result, _ = infra.retrying(
            functools.partial(scenario, scratch, database_url, broker, pool, task),
            f"recovery {pool} {broker} {task}")
        infra.log(f"  {result['outcome']} after {result['seconds']}")
        results.append(result)
    stated = [{"broker": "redis", "pool": "prefork", "task": "bench.late", "acks_late": True,
               "outcome": "redelivered after visibility_timeout (configured, not waited for)",
               "seconds": REDIS_VISIBILITY_TIMEOUT, "stated": True}]
    return {"cases": results, "stated": stated, "conf": CONF, "bound": bound()}
