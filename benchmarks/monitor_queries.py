"""The operators' page queries on a store of 100,000 claims: timings and query plans.

    python benchmarks/monitor_queries.py [--stores postgres,mariadb,sqlite] [--claims N]
                                         [--no-plans] [--hot-path TASKS]

Fills a fresh store of each kind (a database of its own on PostgreSQL and MariaDB, a
temporary file on SQLite) with mixed claims in bulk: states, queues, task names and
holders skewed as in a real cluster (mostly succeeded; a few needing review; a busy
queue and a rare one), evidence, review decisions and permit holds. Then runs each page
query the Pulse pages make (every filter, its first page and a deep page through the
cursor, with its total; one claim's detail; the review list; permit usage; counts),
each five times after a warm-up, and prints the median per query per store, then the
plans: EXPLAIN ANALYZE on PostgreSQL, EXPLAIN on MariaDB, EXPLAIN QUERY PLAN on SQLite.
The target is < 300 ms per page, total included. With ``--hot-path``, it also times the
worker's hot path (reserve with start, complete) on the filled table with the view
indexes and without them: what the indexes cost every task.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.pages import ClaimQuery
from celery_pulse.store.records import FINISHED_STATES, Completion, Grant, Message, ReserveRequest
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.sql.factory import open_store
from celery_pulse.store.sql.monitor import count_statement, page_statement
from celery_pulse.store.sql.reviews import filtered
from celery_pulse.store.sql.tables import (
    VIEW_INDEXES,
    claims,
    evidence,
    permit_holds,
    permits,
    reviews,
)
from celery_pulse.store.views import decode_cursor, encode_cursor

PG_ADMIN = os.environ.get("PULSE_BENCH_PG_ADMIN", "postgresql+psycopg://root@127.0.0.1:5432/test")
MARIADB_ADMIN = os.environ.get("PULSE_BENCH_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test")
DATABASE = "pulse_bench_views"
#: States by weight: a cluster's claims are mostly finished.
STATES = {"succeeded": 80, "failed": 7, "revoked": 2, "running": 4, "reserved": 4, "open": 1,
          "needs_review": 2}
QUEUES = {"default": 50, "billing": 25, "mail": 15, "reports": 9, "rare": 1}
NAMES = [f"proj.tasks.t{i:02d}" for i in range(40)]
HOLDERS = [f"w{i:02d}@host" for i in range(20)]
REPEAT = 5


def create_database(kind: str) -> tuple[str, Callable[[], None]]:
    """A fresh database of ``kind``: its URL and how to drop it."""
    if kind == "sqlite":
        folder = tempfile.mkdtemp(prefix="pulse-views-")
        path = Path(folder) / "pulse.sqlite3"
        return f"sqlite:///{path}", lambda: shutil.rmtree(folder, ignore_errors=True)
    admin = sa.create_engine(PG_ADMIN if kind == "postgres" else MARIADB_ADMIN,
                             isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {DATABASE}")
        conn.exec_driver_sql(f"CREATE DATABASE {DATABASE}")
    url = admin.url.set(database=DATABASE).render_as_string(hide_password=False)

    def drop() -> None:
        with admin.connect() as conn:
            if kind == "postgres":
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
            else:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {DATABASE}")
        admin.dispose()
    return url, drop


def pick(weights: dict[str, int], rng: random.Random) -> str:
    return rng.choices(list(weights), list(weights.values()))[0]


def fill(store: SqlStore, n: int) -> None:
    """``n`` claims over the last week, with evidence, reviews and permit holds, in bulk."""
    rng = random.Random(34)
    now = time.time()
    rows, stale, audit, holds = [], [], [], []
    for i in range(n):
        state = pick(STATES, rng)
        created = now - 7 * 86400 * (1 - i / n) + rng.random()
        task_id = str(uuid.UUID(int=rng.getrandbits(128)))
        live = state in ("running", "reserved")
        epoch = rng.choice((1, 1, 1, 2, 3))
        finished = state in FINISHED_STATES or state == "needs_review"
        queue = pick(QUEUES, rng)
        rows.append({
            "task_id": task_id, "task_name": rng.choice(NAMES[:8] if rng.random() < .8 else NAMES),
            "state": state, "holder": rng.choice(HOLDERS) if state != "open" else None,
            "token": uuid.uuid4().hex if live else None, "epoch": epoch,
            "lease_until": now + 60 if live else None, "attempts": epoch, "max_attempts": 5,
            "policy": "review" if state == "needs_review" else "redispatch", "retries": 0,
            "body": b'[[42], {}, {}]', "headers": '{"argsrepr": "(42,)", "kwargsrepr": "{}"}',
            "properties": "{}", "delivery_info": f'{{"routing_key": "{queue}"}}',
            "content_type": "application/json", "content_encoding": "utf-8",
            "created_at": created, "reserved_at": created, "queue": queue,
            "started_at": created + 0.01 if state != "reserved" else None,
            "finished_at": created + 1 if finished else None,
            "outcome": "unknown" if state == "needs_review" else (state if finished else None),
            "error": None, "publication": None})
        if epoch > 1 and rng.random() < 0.1:
            stale.append({"task_id": task_id, "epoch": epoch - 1, "holder": rng.choice(HOLDERS),
                          "outcome": "succeeded", "error": None, "recorded_at": created + 2})
        if state == "needs_review" and rng.random() < 0.3:
            audit.append({"task_id": task_id, "action": "retry", "outcome": None, "note": None,
                          "decided_by": "bob@host", "decided_at": created + 3})
        if live and rng.random() < 0.5:
            holds.append({"key": f"k{rng.randrange(5)}", "task_id": task_id, "epoch": epoch,
                          "held": state == "running"})
    with store.engine.begin() as conn:
        for start in range(0, n, 5000):
            conn.execute(sa.insert(claims), rows[start:start + 5000])
        conn.execute(sa.insert(evidence), stale)
        conn.execute(sa.insert(reviews), audit)
        conn.execute(sa.insert(permits), [{"key": f"k{k}", "max_running": 3, "updated_at": now}
                                          for k in range(5)])
        conn.execute(sa.insert(permit_holds), holds)
    analyze(store)


def analyze(store: SqlStore) -> None:
    """Fresh statistics, as autovacuum / InnoDB / a periodic ANALYZE would leave them."""
    name = store.engine.dialect.name
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if name == "postgresql":
            conn.exec_driver_sql("VACUUM ANALYZE pulse_claims")
        elif name in ("mysql", "mariadb"):
            conn.exec_driver_sql("ANALYZE TABLE pulse_claims")
        else:
            conn.exec_driver_sql("ANALYZE")


def median_ms(fn: Callable[[], Any]) -> float:
    fn()
    times = []
    for _ in range(REPEAT):
        begun = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begun) * 1000)
    return statistics.median(times)


def deep_cursor(store: SqlStore, query: ClaimQuery) -> str | None:
    """The cursor half-way down ``query``'s rows (a page an operator paged deep to)."""
    total = store.find_claims(query).total
    stmt = (filtered(sa.select(claims.c.created_at, claims.c.task_id), query)
            .order_by(claims.c.created_at.desc(), claims.c.task_id.desc())
            .limit(1).offset(total // 2))
    with store.engine.connect() as conn:
        row = conn.execute(stmt).one_or_none()
    return None if row is None else encode_cursor(float(row.created_at), row.task_id)


def count(store: SqlStore, query: ClaimQuery) -> int:
    """The page's total on its own (what of a page's time the count takes)."""
    with store.conns.read() as conn:
        return int(conn.execute(count_statement(query)).scalar_one())


def queries(store: SqlStore) -> dict[str, ClaimQuery]:
    some = store.find_claims(ClaimQuery(states=("running",), limit=1)).rows[0]
    return {
        "all": ClaimQuery(),
        "state=needs_review": ClaimQuery(states=("needs_review",)),
        "state=succeeded": ClaimQuery(states=("succeeded",)),
        "state=running": ClaimQuery(states=("running",)),
        "state=reserved,running": ClaimQuery(states=("reserved", "running")),
        "state=succeeded,failed": ClaimQuery(states=("succeeded", "failed")),
        "queue=default": ClaimQuery(queue="default"),
        "queue=rare": ClaimQuery(queue="rare"),
        "task_name=t00": ClaimQuery(task_name=NAMES[0]),
        "task_name=t39": ClaimQuery(task_name=NAMES[39]),
        f"worker={some.holder}": ClaimQuery(worker=some.holder),
        "state=failed+queue=billing": ClaimQuery(states=("failed",), queue="billing"),
    }


def explain(store: SqlStore, stmt: Any) -> str:
    """The plan of ``stmt`` as the database tells it."""
    name = store.engine.dialect.name
    sql = str(stmt.compile(store.engine, compile_kwargs={"literal_binds": True}))
    prefix = {"postgresql": "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) ",
              "sqlite": "EXPLAIN QUERY PLAN "}.get(name, "EXPLAIN ")
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(prefix + sql).all()
    if name == "postgresql":
        return "\n".join(r[0] for r in rows)
    if name == "sqlite":
        return "\n".join(str(r[-1]) for r in rows)
    keys = rows[0]._fields if rows else ()
    return "\n".join(" ".join(f"{k}={v}" for k, v in zip(keys, r, strict=True)
                              if k in ("table", "type", "key", "rows", "Extra")) for r in rows)


def hot_path_us(store: SqlStore, tasks: int, batch: int = 50) -> float:
    """Microseconds per task of the worker's hot path: reservations with their start
    folded in, then their completions, ``batch`` at a time through ``exchange`` (the
    completions of one batch travel with the next batch's reservations, as a worker's)."""
    message = Message(b"[[], {}, {}]", {"argsrepr": "()", "kwargsrepr": "{}"}, {},
                      {"routing_key": "default"}, "application/json", "utf-8")
    done: list[Completion] = []
    begun = time.perf_counter()
    for start in range(0, tasks, batch):
        asks = [ReserveRequest(str(uuid.uuid4()), NAMES[0], message, "redispatch", 5,
                               start=True) for _ in range(min(batch, tasks - start))]
        got = store.exchange(HOLDERS[0], 60.0, done, asks, [])
        done = [Completion(g.task_id, g.epoch, g.token, "succeeded") for g in got.reserved
                if isinstance(g, Grant)]
    store.exchange(HOLDERS[0], 60.0, done, [], [])
    return (time.perf_counter() - begun) / tasks * 1e6


def view_indexes(store: SqlStore, present: bool) -> None:
    """Create or drop the operators' indexes (revision 0011's), to time the hot path
    with and without them on the same table."""
    for index in [i for i in claims.indexes if i.name and i.name.startswith("ix_pulse_claims_")
                  and i.name.removeprefix("ix_pulse_claims_") in VIEW_INDEXES]:
        if present:
            index.create(store.engine, checkfirst=True)
        else:
            index.drop(store.engine, checkfirst=True)


def hot_path(store: SqlStore, tasks: int, rounds: int = 3) -> dict[str, float]:
    """The hot path's median time per task with the view indexes and without, in
    alternating rounds on the filled table."""
    times: dict[str, list[float]] = {"with": [], "without": []}
    hot_path_us(store, 500)  # warm-up: connections, statement caches
    for _ in range(rounds):
        for present in (True, False):
            view_indexes(store, present)
            times["with" if present else "without"].append(hot_path_us(store, tasks))
    view_indexes(store, True)
    return {f"hot path µs/task, {k} view indexes": statistics.median(v)
            for k, v in times.items()}


def run(kind: str, n: int, plans: bool, hot_tasks: int = 0) -> dict[str, float]:
    url, drop = create_database(kind)
    store = open_store(url, check_schema=False)
    try:
        store.migrate()
        begun = time.perf_counter()
        fill(store, n)
        print(f"[{kind}] {n} claims filled in {time.perf_counter() - begun:.1f} s", flush=True)
        out: dict[str, float] = {}
        for name, query in queries(store).items():
            out[f"{name} page 1"] = median_ms(functools.partial(store.find_claims, query))
            cursor = deep_cursor(store, query)
            deep = ClaimQuery(query.states, query.queue, query.task_name, query.worker,
                              query.limit, cursor)
            if cursor is not None:
                out[f"{name} deep page"] = median_ms(functools.partial(store.find_claims, deep))
            out[f"{name} (its total alone)"] = median_ms(functools.partial(count, store, query))
            if plans:
                first = page_statement(store.conns, query, None)
                print(f"\n--- [{kind}] {name}: first page\n{explain(store, first)}")
                if cursor is not None:
                    seek = page_statement(store.conns, query, decode_cursor(cursor))
                    print(f"--- [{kind}] {name}: deep page\n{explain(store, seek)}")
                print(f"--- [{kind}] {name}: total\n{explain(store, count_statement(query))}")
        review = store.list_review(limit=1)
        task = review[0].task_id if review else store.list_claims(limit=1)[0].task_id
        out["claim detail"] = median_ms(lambda: store.claim_detail(task))
        out["review list (100)"] = median_ms(lambda: store.list_review(limit=100))
        out["review list queue=billing"] = median_ms(
            lambda: store.list_review(limit=100, query=ClaimQuery(queue="billing")))
        out["permit usage"] = median_ms(store.permit_usage)
        out["claim counts"] = median_ms(store.claim_counts)
        out["oldest review since"] = median_ms(store.oldest_review_since)
        if hot_tasks:
            out.update(hot_path(store, hot_tasks))
        return out
    finally:
        store.close()
        drop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", default="postgres,mariadb,sqlite")
    parser.add_argument("--claims", type=int, default=100_000)
    parser.add_argument("--no-plans", action="store_true")
    parser.add_argument("--hot-path", type=int, default=0, metavar="TASKS",
                        help="also time the hot path for TASKS tasks, with and without "
                             "the view indexes (3 alternating rounds)")
    args = parser.parse_args(argv)
    kinds = args.stores.split(",")
    results = {kind: run(kind, args.claims, not args.no_plans, args.hot_path)
               for kind in kinds}
    names = list(next(iter(results.values())))
    width = max(len(n) for n in names)
    print(f"\nmedian ms of {REPEAT} runs, {args.claims} claims (find_claims includes its total)")
    print(f"{'query':<{width}}  " + "  ".join(f"{k:>9}" for k in kinds))
    for name in names:
        cells = "  ".join(f"{results[k].get(name, float('nan')):9.1f}" for k in kinds)
        print(f"{name:<{width}}  {cells}")
    slow = [(k, n, v) for k in kinds for n, v in results[k].items()
            if v >= 300 and "hot path" not in n]
    print("all under 300 ms" if not slow else f"over 300 ms: {slow}")
    return 0 if not slow else 1


if __name__ == "__main__":
    sys.exit(main())
