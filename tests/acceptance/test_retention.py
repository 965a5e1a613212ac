"""Retention keeps up with the task rate (issue 35), with real ``celery worker -P pulse``.

Before, a purge deleted at most 500 finished claims per pass, one pass a minute: above
8.3 tasks/s the claims table grew without end. Now one pass deletes every claim past
``pulse_retention``, batch after batch (500 rows each, the default).

A first worker (default retention: it purges nothing) runs 1,200 no-op tasks; a second
one with a 1 s retention and beat off (so it purges at once, not after winning an
election) starts on that backlog. Its first pass must leave nothing past retention,
long before its next pass: the old purge left 700 claims for the next ones. Running
the tasks on the first worker keeps the test independent of how fast this machine runs
them (a burst spread over several passes would let the old purge keep up too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from celery import Celery

from celery_pulse.store.sql import SqlStore, open_store
from tests.helpers.workers import Env, Worker, wait_alive

TASKS = 1200
RETENTION = 1.0
#: Longer than the test waits: only the purge at the worker's start can pass it.
INTERVAL = 60.0
#: The first pass starts with the worker's threads; process scheduling on a busy machine.
SLACK = 10.0
FINISHED = ("succeeded", "failed", "revoked")


@contextlib.contextmanager
def opened(url: str) -> Iterator[SqlStore]:
    store = open_store(url)
    try:
        yield store
    finally:
        store.close()


def publish_noops(env: Env, count: int) -> None:
    app = Celery("retention-client", broker=env.broker_url, set_as_current=False)
    app.conf.task_default_queue = env.queue
    try:
        with app.producer_or_acquire() as producer:
            for _ in range(count):
                app.send_task("opsapp.noop", producer=producer)
    finally:
        app.close()


def finished(store: SqlStore) -> int:
    counts = store.claim_counts()
    return sum(counts.get(state, 0) for state in FINISHED)


def test_one_purge_pass_clears_every_claim_past_retention(
        pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """Passes if, 1,200 finished claims in the store, a worker with a 1 s retention
    purges them all in its first pass (well inside its 60 s purge interval), the store's
    retention lag is then 0, and its stats show that lag and a purge rate."""
    env = make_env(pg_url, rabbitmq_url, {"pulse_beat": False})
    env.app = "tests.apps.opsapp"
    publish_noops(env, TASKS)
    first = workers(env, "busy@%h", concurrency=2).wait_ready(60)
    with opened(pg_url) as store:
        wait_alive(lambda: finished(store) == TASKS, 60, "every task to finish", (first,))
        first.kill()
        wait_alive(lambda: store.retention_lag(RETENTION) > 0, 10, "time to pass", ())
        conf: dict[str, Any] = {"pulse_beat": False, "pulse_retention": RETENTION,
                                "pulse_purge_interval": INTERVAL}
        env.conf = conf
        purger = workers(env, "purger@%h").wait_ready(60)
        wait_alive(lambda: finished(store) == 0, SLACK,
                   f"every finished claim purged in one pass (retention {RETENTION}s, "
                   f"purge every {INTERVAL}s)", (purger,), interval=0.2)
        assert store.retention_lag(RETENTION) == 0.0
    name = purger.wait_log(r"registered (\S+)").group(1)
    stats = env.celery_json("inspect", "stats", "-d", name)[name]["pulse"]["retention"]
    assert stats["lag"] == 0.0 and stats["purged_per_second"] > 0, stats
