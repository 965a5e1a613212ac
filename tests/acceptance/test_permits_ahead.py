"""Tasks under a limit started ahead of the pool with their permits (issue 41).

Short limited tasks under load go ahead of the pool as plain ones do: their start, with
the permits, is made while the previous job runs, so no pool process waits for it. The
limit still holds (the permits are taken in the start), and a start ahead that finds no
permit leaves the task to ask with its process, in line. Real workers, a real store.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from celery_pulse.store.base import PermitUsage
from celery_pulse.store.sql import SqlStore
from tests.acceptance.test_permits import (  # noqa: F401 - fixtures
    LIMITED,
    Cluster,
    all_in_state,
    closed,
    cluster,
    ended,
    max_overlap,
    penv,
    producer,
    runs,
    store_of,
    task_key,
    usage,
)
from tests.helpers.workers import Env, wait_alive


def started_ahead(client: object, names: list[str], what: str = "started_ahead"
                  ) -> int | None:
    """The workers' count of limited starts made ahead of the pool (or ``folded`` into
    their reservation), from their stats (None: not every worker answered)."""
    stats = client.control.inspect(timeout=2, destination=names).stats() or {}  # type: ignore[attr-defined]
    if set(stats) != set(names):
        return None
    return sum(int(s["pulse"]["permits"][what]) for s in stats.values())


@pytest.fixture(params=["postgres", "sqlite"])
def a_store(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue({"postgres": "pg_url", "sqlite": "sqlite_url"}
                                       [request.param])
    return url


@pytest.mark.parametrize("limit", [1000, 2], ids=["never-binds", "binds"])
def test_short_limited_tasks_start_ahead_of_the_pool_and_the_limit_holds(
        a_store: str, limit: int, rabbitmq_url: str, tmp_path: Path,
        penv: Callable[..., Env], cluster: Cluster,  # noqa: F811
        store_of: Callable[[str], SqlStore]) -> None:  # noqa: F811
    """Two workers x ``-c 2``, 300 short tasks (2 ms) of a limited kind. Passes if the
    history never shows more bodies at once than the limit, every task ran exactly once
    and succeeded, no permit is left held, and, under a limit that never binds (1,000),
    the workers' stats count starts made ahead of the pool with permits (0 before this
    change: a limited task's process waited for its start), and on PostgreSQL starts
    folded into their reservation with their permits (none on SQLite, whose store does
    not fold them). Under a limit that binds (2 of 4 processes) a start ahead finds no
    permit and the task asks in line; the limit holds with folds as without."""
    N = 300
    env = penv(a_store, rabbitmq_url)
    env.conf["pulse_concurrency_limits"] = {LIMITED: limit}
    store = store_of(a_store)
    journal = tmp_path / "journal.txt"
    ws = tuple(cluster.worker(env, f"a{i}@%h", concurrency=2) for i in range(2))
    cluster.ready(*ws)
    names = [w.wait_log(r"pulse: registered (\S+)").group(1) for w in ws]
    with producer(env) as client:
        ids = [client.send_task(LIMITED, (str(journal), 0.002)).id for _ in range(N)]
        wait_alive(lambda: ended(journal, LIMITED) == N, 120, f"all {N} tasks to end", ws)
        wait_alive(lambda: all_in_state(a_store, ids, "succeeded"), 30,
                   "every claim to succeed", ws)
        (ahead,) = wait_alive(lambda: (n := started_ahead(client, names)) is not None
                              and (n,), 20, "the workers' stats", ws, interval=0.5)
        (folded,) = wait_alive(lambda: (n := started_ahead(client, names, "folded"))
                               is not None and (n,), 20, "the workers' stats", ws,
                               interval=0.5)
    done = runs(journal, LIMITED)
    assert sorted(r.task_id for r in done) == sorted(ids)  # each exactly once
    deepest = max_overlap(closed(r) for r in done)
    print(f"\n[{a_store.split(':')[0]}] {ahead} of {N} limited starts made ahead of the "
          f"pool, {folded} folded into their reservation; at most {deepest} at once")
    assert deepest <= limit, f"at most {limit} may run at once; the history shows {deepest}"
    if limit == 1000:
        assert ahead + folded > 0, "no limited task was started ahead of the pool"
    if a_store.startswith("sqlite"):
        assert folded == 0, "SQLite's store does not fold permits into a reservation"
    elif limit == 1000:
        assert folded > 0, "no limited start was folded into its reservation"
    assert usage(store, task_key(LIMITED)) == PermitUsage(task_key(LIMITED), limit, 0, 0)
    for w in ws:
        assert "Traceback" not in w.log(), w.log()[-3000:]
