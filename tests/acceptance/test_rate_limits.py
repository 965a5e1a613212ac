"""Cluster-wide rate limits (issue 39): ``pulse_rate_limit="20/s"`` holds across every
worker, on every store.

The rule is decided in the start's transaction by the store's clock: in any window of the
declared length, no more than N starts are granted for the key. The tests read it two
ways: the claims' start times as the store recorded them (exactly the rule), and the
bodies' own clocks. A body begins after its start's transaction commits and its job
reaches a pool process (a start made ahead of the pool also waits for a process, about
20 ms at most): so that check allows 50 ms of jitter off the window. On a loaded machine
a commit or a hand-off can take longer (a CI run had a body begun late enough to share a
window with the next second's on-time ones); late bodies are counted in the output and
left out of the window count, and none may begin before its grant.

Real processes: 3 ``celery worker -P pulse -c 4`` on RabbitMQ, PostgreSQL / SQLite /
MariaDB.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_pulse.store.sql import SqlStore
from tests.acceptance.test_permits import (  # noqa: F401 (fixtures)
    Cluster,
    all_in_state,
    cluster,
    ended,
    penv,
    producer,
    runs,
    store_of,
)
from tests.helpers.workers import Env, wait_alive

RATED = "permitapp.rated"
PER_CUSTOMER = "permitapp.rated_per_customer"
LIMIT, WINDOW = 20, 1.0
JITTER = 0.05


@pytest.fixture(params=["postgres", "sqlite", "mariadb"])
def any_store(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue({"postgres": "pg_url", "sqlite": "sqlite_url",
                                        "mariadb": "mariadb_url"}[request.param])
    return url


def most_in_a_window(times: Iterable[float], window: float) -> int:
    """The most of ``times`` inside any half-open window ``(t - window, t]``."""
    ordered = sorted(times)
    return max(sum(1 for s in ordered if t - window < s <= t) for t in ordered)


def on_time(bodies: Iterable[tuple[str, int, float]], granted: dict[tuple[str, int], float]
            ) -> list[float]:
    """The bodies' start times (``(task_id, epoch, at)``) that began within ``JITTER`` of
    their grant (a body whose grant is not on record counts too). None began before it."""
    kept, late = [], []
    for task_id, epoch, at in bodies:
        grant = granted.get((task_id, epoch))
        assert grant is None or at >= grant - 0.001, (task_id, epoch, at, grant)
        (late if grant is not None and at - grant > JITTER else kept).append(at)
    if late:
        print(f"\n{len(late)} of {len(kept) + len(late)} bodies began more than "
              f"{JITTER * 1000:.0f} ms after their grant")
    return kept


def grants_of(store: SqlStore, ids: list[str]) -> dict[tuple[str, int], float]:
    """Each claim's last start, as the store recorded it, by ``(task_id, epoch)``."""
    with store.engine.connect() as conn:
        return {(task_id, int(epoch)): float(t) for task_id, epoch, t in conn.execute(
            sa.text("SELECT task_id, epoch, started_at FROM pulse_claims "
                    "WHERE task_id IN :ids").bindparams(sa.bindparam("ids", expanding=True)),
            {"ids": ids})}


def store_starts(store: SqlStore, ids: list[str]) -> list[float]:
    """The start time the store recorded for each claim (its clock)."""
    return list(grants_of(store, ids).values())


def test_a_rate_limit_holds_across_three_workers_on_every_store(
        any_store: str, rabbitmq_url: str, tmp_path: Path, penv: Callable[..., Env],  # noqa: F811
        cluster: Cluster, store_of: Callable[[str], SqlStore]) -> None:  # noqa: F811
    """3 workers x ``-c 4``, 200 tasks of 10 ms under 20/s published at once: never more
    than 20 starts in any second, by the store's record and by the bodies' clocks; each
    task once; and the limit binds (the last start comes at least 9 s after the first,
    200 / 20 - 1), without lagging far behind it."""
    n = 200
    env = penv(any_store, rabbitmq_url)
    store = store_of(any_store)
    journal = tmp_path / "journal.txt"
    ws = tuple(cluster.worker(env, f"r{i}@%h", concurrency=4) for i in range(3))
    cluster.ready(*ws)
    with producer(env) as client:
        ids = [client.send_task(RATED, (str(journal), 0.01)).id for _ in range(n)]
    # What an operator sees meanwhile: the rate, the starts in its window, its waiters.
    shown = re.compile(rf"rate rate:task:{RATED}: \d+ of {LIMIT} started in the last 1s, "
                       r"[1-9]\d* waiting")
    wait_alive(lambda: shown.search(env.celery("pulse", "status").stdout), 30,
               "pulse status to show the rate and its waiters", ws)
    wait_alive(lambda: ended(journal, RATED) == n, 90, f"all {n} tasks to end", ws)
    wait_alive(lambda: all_in_state(any_store, ids, "succeeded"), 30, "every claim", ws)

    done = runs(journal, RATED)
    assert sorted(r.task_id for r in done) == sorted(ids)  # each exactly once
    granted = grants_of(store, ids)
    recorded = list(granted.values())
    assert most_in_a_window(recorded, WINDOW) <= LIMIT
    bodies = on_time(((r.task_id, r.start.epoch, r.start.at) for r in done), granted)
    # How many bodies follow their grant within JITTER is load, not the rule (the store's
    # record above is exact, and no body began before its grant): on an idle machine the
    # median lag is 4-18 ms and 3-9 of 200 are late; loaded CI runs (3 test processes on
    # 2 cores) had 51, 71 and 160 late on MariaDB. More than LIMIT on time is asserted,
    # so that the window count on the bodies' clocks below can fail.
    assert len(bodies) > LIMIT
    assert most_in_a_window(bodies, WINDOW - JITTER) <= LIMIT
    span = max(recorded) - min(recorded)
    print(f"\n[{any_store.split(':')[0]}] {n} starts at {LIMIT}/s over {span:.2f} s "
          f"(ideal {n / LIMIT - 1:.0f} s); busiest second by the store: "
          f"{most_in_a_window(recorded, WINDOW)}")
    assert span >= n / LIMIT - 1 - 0.01  # the limit bound: it was never above it
    assert span <= (n / LIMIT - 1) * 1.3  # and waiters were not left far behind it


@pytest.mark.parametrize("how", ["killed", "rolling"])
def test_workers_replaced_mid_run_never_go_above_the_rate(
        rabbitmq_url: str, pg_url: str, tmp_path: Path, penv: Callable[..., Env],  # noqa: F811
        cluster: Cluster, store_of: Callable[[str], SqlStore], how: str) -> None:  # noqa: F811
    """The same, with two of the three workers replaced mid-run: SIGKILLed then new ones
    started (a start granted to a killed worker still counts for its second), or a
    rolling restart (the new ones ready before the old ones get SIGTERM and finish what
    they hold): the new workers are held to the same rate, never above it."""
    n = 160
    # A body running when its worker is killed runs again (redispatch), not to review.
    env = penv(pg_url, rabbitmq_url, {"pulse_lease_ttl": 4, "pulse_recover_interval": 0.5,
                                      "pulse_on_lost": "redispatch"})
    store = store_of(pg_url)
    journal = tmp_path / "journal.txt"
    ws = [cluster.worker(env, f"k{i}@%h", concurrency=4) for i in range(3)]
    cluster.ready(*ws)
    with producer(env) as client:
        ids = [client.send_task(RATED, (str(journal), 0.01)).id for _ in range(n)]
    wait_alive(lambda: ended(journal, RATED) >= 60, 60, "a third of the tasks", ws)
    if how == "killed":
        for w in ws[:2]:
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait(10)
    fresh = [cluster.worker(env, f"n{i}@%h", concurrency=4) for i in range(2)]
    cluster.ready(*fresh)
    if how == "rolling":
        for w in ws[:2]:
            w.proc.send_signal(signal.SIGTERM)
        for w in ws[:2]:
            w.proc.wait(60)
    alive = (ws[2], *fresh)
    wait_alive(lambda: all_in_state(pg_url, ids, "succeeded"), 120, "every claim", alive)
    with store.engine.connect() as conn:
        granted = [float(t) for t in conn.execute(sa.text(
            "SELECT started_at FROM pulse_rate_starts WHERE key = :k"),
            {"k": f"rate:task:{RATED}"}).scalars()]
    # Every start granted in the last window is still recorded (older ones are purged by
    # the next start); all claims' final starts are, by the store's record:
    final = grants_of(store, ids)
    assert most_in_a_window(final.values(), WINDOW) <= LIMIT
    assert most_in_a_window(granted, WINDOW) <= LIMIT
    done = runs(journal, RATED)
    bodies = on_time(((r.task_id, r.start.epoch, r.start.at) for r in done), final)
    assert most_in_a_window(bodies, WINDOW - JITTER) <= LIMIT
    assert time.time() - max(r.start.at for r in done) < 60


def test_a_keyed_rate_gives_each_key_its_own_rate(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, penv: Callable[..., Env],  # noqa: F811
        cluster: Cluster, store_of: Callable[[str], SqlStore]) -> None:  # noqa: F811
    """10/s per customer, two customers, 40 tasks each on 2 workers x ``-c 4``: each
    customer never above 10 in a second, and the two together go above it (each key has
    its own rate)."""
    env = penv(pg_url, rabbitmq_url)
    journal = tmp_path / "journal.txt"
    ws = tuple(cluster.worker(env, f"p{i}@%h", concurrency=4) for i in range(2))
    cluster.ready(*ws)
    with producer(env) as client:
        ids = [client.send_task(PER_CUSTOMER, (str(journal), 0.01), {"customer": i % 2}).id
               for i in range(80)]
    wait_alive(lambda: ended(journal, PER_CUSTOMER) == 80, 60, "all 80 tasks to end", ws)
    done = runs(journal, PER_CUSTOMER)
    granted = grants_of(store_of(pg_url), ids)
    for customer in ("0", "1"):
        mine = [r for r in done if r.start.key == customer]
        assert len(mine) == 40
        assert most_in_a_window([granted[r.task_id, r.start.epoch] for r in mine],
                                WINDOW) <= 10
        bodies = on_time(((r.task_id, r.start.epoch, r.start.at) for r in mine), granted)
        assert most_in_a_window(bodies, WINDOW - JITTER) <= 10
    assert most_in_a_window([r.start.at for r in done], WINDOW - JITTER) > 10
