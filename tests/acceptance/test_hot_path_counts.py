"""A worker's usual exchanges take each store's one-pass path, seen from outside: its
``celery inspect stats`` counts them (SQLite: on the driver's connection, by the event
loop itself; MariaDB: one multi-statement packet), and none went back to the general
path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from tests.helpers.workers import Env, Worker, wait_for

TASKS = 60
#: (the count of one-pass exchanges, the count of those that went the general path).
COUNTS = {"sqlite": ("direct_exchanges", "direct_exchanges_redone"),
          "mariadb": ("packets", "packets_refused")}


def _succeeded(store_url: str, task_ids: list[str]) -> int:
    engine = sa.create_engine(store_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(
                "SELECT COUNT(*) FROM pulse_claims WHERE state = 'succeeded' AND task_id IN "
                "(" + ", ".join(f"'{task_id}'" for task_id in task_ids) + ")")).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.parametrize("kind", ["sqlite", "mariadb"])
def test_a_workers_usual_exchanges_take_the_one_pass_path(
        kind: str, request: pytest.FixtureRequest, rabbitmq_url: str,
        make_env: Callable[..., Env], workers: Callable[..., Worker]) -> None:
    store_url = request.getfixturevalue(f"{kind}_url")
    env = make_env(store_url, rabbitmq_url)
    worker = workers(env, f"hot-{kind}@%h", concurrency=2).wait_ready(60)
    name = worker.wait_log(r"pulse: registered (\S+)").group(1)
    client = Celery("hot-path-client", broker=env.broker_url, set_as_current=False)
    try:
        sent = [client.send_task("pulseapp.add", (i, i), queue=env.queue).id
                for i in range(TASKS)]
        wait_for(lambda: _succeeded(store_url, sent) == TASKS or None, 60,
                 f"{TASKS} tasks to succeed")
        replies: dict[str, Any] = client.control.inspect(destination=[name],
                                                          timeout=5).stats() or {}
    finally:
        client.close()
    counts = replies[name]["pulse"]["counts"]
    made, redone = COUNTS[kind]
    assert counts["completed"] >= TASKS
    # Every exchange of this run was a usual one: all took the one-pass path.
    assert counts[made] > 0 and counts[redone] == 0, counts
    assert counts[made] >= counts["exchanges"], counts
    if kind == "sqlite":  # made on the event loop, but when another writer held the lock
        assert counts["loop_exchanges"] > 0, counts
        assert counts["loop_exchanges"] + counts["loop_exchanges_locked"] >= counts[made], counts
