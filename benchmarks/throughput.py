"""Throughput of ``-P pulse`` vs ``-P prefork`` (same broker, same ``-c``), plus CPU and memory.

Method: pre-publish N tasks and a final ``bench.stop`` to a fresh queue, then start a
worker on that queue. ``worker_ready`` writes the ready time, ``bench.stop`` its own
start time: rate = N / (stop - ready). Each pulse run gets a fresh, migrated schema
(PostgreSQL), database (MariaDB) or SQLite file. CPU, from ready to stop: on-CPU time
of the worker's processes (parent vs pool children; schedstat) and of the store server
serving it (``store``): the PostgreSQL backends connected to the benchmark database
(schedstat), or the whole ``mariadbd`` process (one process with a thread per
connection, shared with whoever else uses that server meanwhile; utime + stime). SQLite
runs inside the worker: no server.

Result backends (issue 17): the tasks store their results (none ignores them) wherever
a run configures a backend: Celery's SQLAlchemy backend in a fresh schema
(``prefork-sqla``), Redis in a database of its own, flushed before and after each run
(``prefork-redis``, ``pulse-redis``; the whole ``redis-server`` process is added to the
store column, shared like MariaDB's), or ``pulse://``, the run's fresh PostgreSQL store
(``pulse-results``). After the measurement the runner checks that the backend holds a
``SUCCESS`` for every task published (the run fails loudly if any is missing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

import sqlalchemy as sa

from benchmarks import infra

CONCURRENCY = 2
X = "\u00d7"  # multiplication sign
VARIANTS = ("prefork", "pulse-postgres", "pulse-sqlite", "pulse-mariadb")
#: Stores measured on the main workloads only (2,000 no-op and 1,000 x 10 ms, both
#: brokers), not on the acks_late ones nor on 20,000 tasks: the full run's time budget.
MAIN_ONLY = ("pulse-mariadb",)
#: Peers that keep state in PostgreSQL too, measured beside plain prefork in the same
#: repeats (full runs, RabbitMQ, default acks only): prefork with Celery's own SQLAlchemy
#: result backend, and procrastinate (a PostgreSQL job queue, ``-c 2``).
PEERS = ("prefork-sqla", "procrastinate")
#: Result backends (issue 17), every result stored: prefork + Redis, pulse (PostgreSQL
#: store) + Redis, pulse + ``pulse://`` (its own store). Full runs: RabbitMQ, 2,000 no-op
#: and 1,000 x 10 ms, in the same repeats as prefork-sqla (prefork + SQLAlchemy backend)
#: and pulse-postgres (pulse without results), which they are compared with.
RESULTS = ("prefork-redis", "pulse-redis", "pulse-results")
#: Where RESULTS run in full runs (about 80 s of the full run for both, 25 s for the no-op
#: one alone).
RESULTS_WORKLOADS = ("noop-2000", "sleep-1000")
#: In quick runs (the test suite's), only ``pulse://`` on the no-op workload: one short run.
QUICK_RESULTS = ("pulse-results",)
#: The store of a pulse variant whose name is not ``pulse-<store>``.
STORE_OF = {"pulse-redis": "postgres", "pulse-results": "postgres"}
#: The result backend of each variant that has one.
RESULT_BACKEND_OF = {"prefork-sqla": "sqla", "prefork-redis": "redis",
                     "pulse-redis": "redis", "pulse-results": "pulse"}
#: Redis for the result backends: a database of its own (flushed before and after each
#: run), not the broker's.
RESULTS_REDIS_URL = os.environ.get("PULSE_BENCH_REDIS_RESULTS", "redis://127.0.0.1:6379/8")
#: How long the runner waits, after a run's ``stop``, for the last results to be written.
RESULTS_WAIT = 30.0


@dataclasses.dataclass(frozen=True)
class Workload:
    key: str
    label: str
    task: str
    args: tuple[Any, ...]
    n: int


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [Workload("noop-500", "500 no-op", "bench.noop", (), 500),
                Workload("sleep-200", f"200 {X} 10 ms", "bench.sleep", (10,), 200)]
    return [Workload("noop-2000", "2,000 no-op", "bench.noop", (), 2000),
            Workload("sleep-1000", f"1,000 {X} 10 ms", "bench.sleep", (10,), 1000),
            *LATE,
            Workload("noop-20000", "20,000 no-op", "bench.noop", (), 20000)]


#: acks_late tasks: Recover re-dispatches a lost attempt whether it started or not, so
#: their start is recorded in the background instead of before the body.
LATE = [Workload("noop-late-2000", "2,000 no-op, acks_late", "bench.noop_late", (), 2000),
        Workload("sleep-late-1000", f"1,000 {X} 10 ms, acks_late", "bench.sleep_late", (10,),
                 1000)]


def variants(broker: str, workload: Workload, quick: bool) -> tuple[str, ...]:
    """What runs for one (broker, workload): the peers only where they compare fairly."""
    if workload in LATE or workload.n > 2000:
        return tuple(v for v in VARIANTS if v not in MAIN_ONLY)
    if broker != "rabbitmq":
        return VARIANTS
    if quick:
        return VARIANTS + (QUICK_RESULTS if workload.task == "bench.noop" else ())
    return VARIANTS + PEERS + (RESULTS if workload.key in RESULTS_WORKLOADS else ())


def plan(quick: bool) -> list[tuple[str, Workload, int]]:
    """(broker, workload, repeats) in the order they run."""
    if quick:
        return [("rabbitmq", w, 1) for w in workloads(quick)]
    small = [w for w in workloads(quick) if w.n <= 2000 and w not in LATE]
    big = [w for w in workloads(quick) if w.n > 2000]
    out: list[tuple[str, Workload, int]] = []
    for broker in ("rabbitmq", "redis"):
        out += [(broker, w, 2) for w in small]
    out += [("rabbitmq", w, 2) for w in LATE]
    # 20,000 tasks: once, on RabbitMQ only (time budget of the full run).
    out += [("rabbitmq", w, 1) for w in big]
    return out


class PgBackends:
    """CPU of the PostgreSQL backends connected to the benchmark database."""

    def __init__(self, database_url: str) -> None:
        self.engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)

    def pids(self) -> list[int]:
        with self.engine.connect() as conn:
            return [int(p) for p in conn.execute(sa.text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()")).scalars()]

    def cpu(self) -> dict[int, float]:
        return infra.cpu_seconds(self.pids())

    def close(self) -> None:
        self.engine.dispose()


class MariaDBServer:
    """CPU of the MariaDB server process (all its threads; nothing if not on this host).

    A connection is a thread of one ``mariadbd``, not a process of its own, so the
    benchmark's connections cannot be told apart from other users' by /proc: this is
    the whole server, which whoever else uses it during the run adds to.
    """

    def __init__(self, url: str = infra.MARIADB_URL) -> None:
        self.pid = infra.mariadb_server_pid(url)
        if self.pid is None:
            infra.log(f"the MariaDB server of {url} is not a process on this host: "
                      f"its CPU is not measured")

    def cpu(self) -> dict[int, float]:
        return infra.process_cpu_seconds(self.pid) if self.pid is not None else {}

    def close(self) -> None:
        pass


class RedisServer:
    """CPU of the local ``redis-server`` of ``url`` (the whole process: shared with whoever
    else uses it during the run; nothing if it is not a process on this host)."""

    def __init__(self, url: str) -> None:
        import redis

        client = redis.Redis.from_url(url)
        try:
            pid = int(client.info("server")["process_id"])
        finally:
            client.close()
        self.pid: int | None = pid if infra._comm(pid).startswith("redis") else None
        if self.pid is None:
            infra.log(f"the Redis server of {url} is not a process on this host: "
                      f"its CPU is not measured")

    def cpu(self) -> dict[int, float]:
        return infra.process_cpu_seconds(self.pid) if self.pid is not None else {}

    def close(self) -> None:
        pass


Meter = PgBackends | MariaDBServer | RedisServer


def _cpu_of(meters: list[Meter]) -> dict[int, float]:
    out: dict[int, float] = {}
    for meter in meters:
        out.update(meter.cpu())
    return out


def stored_results(backend: str, url: str, ids: list[str]) -> set[str]:
    """The ids among ``ids`` whose result ``backend`` (of ``url``) holds as ``SUCCESS``."""
    wanted = set(ids)
    if backend == "redis":
        import redis

        client = redis.Redis.from_url(url)
        try:
            values = client.mget([f"celery-task-meta-{i}" for i in ids])
        finally:
            client.close()
        return {json.loads(v)["task_id"] for v in values
                if v is not None and json.loads(v).get("status") == "SUCCESS"} & wanted
    if backend == "pulse":
        query = ("SELECT substr(key, length('celery-task-meta-') + 1) FROM pulse_results "
                 "WHERE key LIKE 'celery-task-meta-%' AND state = 'SUCCESS'")
    elif backend == "sqla":
        query = "SELECT task_id FROM celery_taskmeta WHERE status = 'SUCCESS'"
    else:
        raise ValueError(f"unknown result backend {backend!r}")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return set(conn.execute(sa.text(query)).scalars()) & wanted
    finally:
        engine.dispose()


def check_results(backend: str, url: str, ids: list[str], worker: infra.Worker) -> int:
    """Wait (up to RESULTS_WAIT) until ``backend`` holds a ``SUCCESS`` for every one of
    ``ids``; raise if some never arrive. Returns how many were checked."""
    missing: set[str] = set(ids)

    def complete() -> bool:
        nonlocal missing
        worker.check_alive()
        missing = set(ids) - stored_results(backend, url, ids)
        return not missing
    try:
        infra.wait_for(complete, RESULTS_WAIT, f"every result in the {backend} backend", 0.2)
    except TimeoutError:
        raise RuntimeError(f"{worker.name}: the {backend} result backend lacks the result of "
                           f"{len(missing)} of {len(ids)} tasks {RESULTS_WAIT:g} s after the "
                           f"run (e.g. {sorted(missing)[:3]}):\n{worker.log()[-3000:]}"
                           ) from None
    return len(ids)


#: A run whose queue does not shrink for this long is stuck (reported, not waited out).
STALL = 45.0


class Progress:
    """Watches the queue depth; ``stalled()`` once it has not changed for STALL seconds."""

    def __init__(self, broker_url: str, queue: str) -> None:
        self.broker_url = broker_url
        self.queue = queue
        self.depth: int | None = None
        self.changed = time.monotonic()
        self.checked = 0.0

    def stalled(self) -> bool:
        now = time.monotonic()
        if now - self.checked < 1.0:
            return False
        self.checked = now
        depth = infra.queue_depth(self.broker_url, self.queue)
        if depth != self.depth:
            self.depth, self.changed = depth, now
        return now - self.changed > STALL


def _cpu_split(worker: infra.Worker) -> tuple[dict[int, float], dict[int, float]]:
    pids = worker.pids()
    readings = infra.cpu_seconds(pids)
    parent = {p: v for p, v in readings.items() if p == worker.pid}
    children = {p: v for p, v in readings.items() if p != worker.pid}
    return parent, children


def run_one(scratch: infra.Scratch, database_url: str, broker: str, variant: str,
            workload: Workload, mariadb_url: str = infra.MARIADB_URL) -> dict[str, Any]:
    """One measured run; returns its figures (``mariadb_url``: the server and driver of a
    ``pulse-mariadb`` run)."""
    if variant == "procrastinate":
        return run_procrastinate(scratch, database_url, workload)
    broker_url = infra.BROKERS[broker]
    queue = f"bench-tp-{uuid.uuid4().hex[:10]}"
    stop_file = scratch.path("stop")
    pool = "pulse" if variant.startswith("pulse") else "prefork"
    store_kind = STORE_OF.get(variant, variant.split("-", 1)[-1]) if pool == "pulse" else None
    result_backend = RESULT_BACKEND_OF.get(variant)
    meters: list[Meter] = []
    if store_kind == "postgres" or result_backend == "sqla":
        meters.append(PgBackends(database_url))
    elif store_kind == "mariadb":
        meters.append(MariaDBServer())
    if result_backend == "redis":
        meters.append(RedisServer(RESULTS_REDIS_URL))
    checked = 0
    with contextlib.ExitStack() as stack:
        for meter in meters:
            stack.callback(meter.close)
        store = (stack.enter_context(infra.fresh_store(store_kind, scratch, database_url,
                                                       mariadb_url))
                 if store_kind else None)
        conf: dict[str, Any] | None = None
        results_url = ""
        if result_backend == "sqla":  # Celery's own SQLAlchemy result backend
            results_url = stack.enter_context(infra.fresh_pg_schema(database_url))
            conf = {"result_backend": "db+" + results_url}
        elif result_backend == "redis":  # a database of its own, emptied before and after
            results_url = RESULTS_REDIS_URL
            infra.purge_redis_db(results_url)
            stack.callback(infra.purge_redis_db, results_url)
            conf = {"result_backend": results_url}
        elif result_backend == "pulse":  # the run's own store (pulse_store_url)
            assert store is not None
            results_url = store
            conf = {"result_backend": "pulse://"}
        infra.declare_queue(broker_url, queue)
        stack.callback(infra.delete_queue, broker_url, queue)
        ids = infra.publish(broker_url, queue,
                            [(workload.task, list(workload.args))] * workload.n
                            + [("bench.stop", [str(stop_file)])])
        started = stack.enter_context(infra.workers())
        worker = infra.Worker(scratch, f"tp-{variant}", pool=pool, concurrency=CONCURRENCY,
                              broker=broker_url, queue=queue, store=store, conf=conf)
        started.append(worker)
        ready = worker.wait_ready(timeout=60)
        parent0, children0 = _cpu_split(worker)
        store0 = _cpu_of(meters)

        progress = Progress(broker_url, queue)

        def stopped() -> bool:
            worker.check_alive()
            if stop_file.exists() and stop_file.stat().st_size > 0:
                return True
            if progress.stalled():
                worker.check_undisturbed()
                raise RuntimeError(f"{variant} made no progress for {STALL:g}s with "
                                   f"{progress.depth} messages left in the queue:\n"
                                   f"{worker.log()[-3000:]}")
            return False
        infra.wait_for(stopped, max(120.0, workload.n / 10), f"{workload.key} on {variant}", 0.02)
        worker.check_undisturbed()
        stop = float(stop_file.read_text().split()[-1])
        parent1, children1 = _cpu_split(worker)
        store1 = _cpu_of(meters)
        rss, pss = infra.memory(worker.pids())
        elapsed = stop - ready
        if result_backend:  # after the measurement, before the worker goes
            checked = check_results(result_backend, results_url, ids, worker)
        worker.kill()
    n = workload.n
    return {
        "broker": broker, "variant": variant, "workload": workload.key, "n": n,
        "elapsed_s": elapsed, "rate": n / elapsed, "startup_s": ready - worker.started,
        "cpu_ms_per_task": {
            "parent": 1000 * infra.cpu_delta(parent0, parent1) / n,
            "children": 1000 * infra.cpu_delta(children0, children1) / n,
            "store": 1000 * infra.cpu_delta(store0, store1) / n},
        "rss_mb": rss / 2**20, "pss_mb": pss / 2**20,
        "results_checked": checked,
    }


def run_procrastinate(scratch: infra.Scratch, database_url: str, workload: Workload
                      ) -> dict[str, Any]:
    """The same workload on procrastinate: jobs deferred first, then one worker started.

    Rate = N / (stop - begin): ``bench.begin`` is the first job, ``bench.stop`` the last
    (procrastinate takes jobs of one priority in id order). CPU: the worker process (its
    threads run the sync tasks) and the PostgreSQL backends.
    """
    import procrastinate

    begin_file, stop_file = scratch.path("begin"), scratch.path("stop")
    backends = PgBackends(database_url)
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(infra.fresh_pg_schema(database_url))
        dsn = url.replace("postgresql+psycopg://", "postgresql://", 1)
        client = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=dsn))
        with client.open():
            client.schema_manager.apply_schema()
            client.configure_task("bench.begin").defer(path=str(begin_file))
            args = dict(zip(("ms",), workload.args, strict=False))
            task = workload.task.replace("_late", "")
            for i in range(0, workload.n, 500):
                client.configure_task(task).batch_defer(*[args] * min(500, workload.n - i))
            client.configure_task("bench.stop").defer(path=str(stop_file))
        started = stack.enter_context(infra.workers())
        worker = infra.Process(
            scratch, "tp-procrastinate",
            [sys.executable, "-m", "procrastinate", "--app=benchmarks.procrastinate_app.app",
             "worker", f"--concurrency={CONCURRENCY}"],
            infra.app_env("memory://", "unused", BENCH_PROC_DSN=dsn))
        started.append(worker)

        def written(path: Any) -> bool:
            worker.check_alive()
            return bool(path.exists() and path.stat().st_size > 0)
        infra.wait_for(lambda: written(begin_file), 60, "procrastinate's first job", 0.02)
        proc0 = infra.cpu_seconds(worker.pids())
        pg0 = backends.cpu()
        infra.wait_for(lambda: written(stop_file), max(120.0, workload.n / 10),
                       f"{workload.key} on procrastinate", 0.02)
        proc1 = infra.cpu_seconds(worker.pids())
        pg1 = backends.cpu()
        rss, pss = infra.memory(worker.pids())
        began = float(begin_file.read_text().split()[-1])
        elapsed = float(stop_file.read_text().split()[-1]) - began
        worker.kill()
    backends.close()
    n = workload.n
    return {
        "broker": "rabbitmq", "variant": "procrastinate", "workload": workload.key, "n": n,
        "elapsed_s": elapsed, "rate": n / elapsed, "startup_s": began - worker.started,
        "cpu_ms_per_task": {"parent": 1000 * infra.cpu_delta(proc0, proc1) / n,
                            "children": 0.0,
                            "store": 1000 * infra.cpu_delta(pg0, pg1) / n},
        "rss_mb": rss / 2**20, "pss_mb": pss / 2**20,
    }


def _chosen(name: str) -> set[str] | None:
    """A comma-separated choice from the environment (None: all), for a run of a few
    cases: ``PULSE_BENCH_WORKLOADS=noop-2000 PULSE_BENCH_VARIANTS=prefork,pulse-sqlite``."""
    value = os.environ.get(name, "").strip()
    return {v.strip() for v in value.split(",") if v.strip()} or None


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    database_url = infra.ensure_bench_database()
    runs: list[dict[str, Any]] = []
    only_workloads = _chosen("PULSE_BENCH_WORKLOADS")
    only_variants = _chosen("PULSE_BENCH_VARIANTS")
    for broker, workload, repeats in plan(quick):
        if only_workloads is not None and workload.key not in only_workloads:
            continue
        for rep in range(repeats):
            for variant in variants(broker, workload, quick):
                if only_variants is not None and variant not in only_variants:
                    continue
                infra.log(f"throughput {broker} {workload.key} {variant} (#{rep + 1}/{repeats})")
                result, disturbed = infra.retrying(
                    functools.partial(run_one, scratch, database_url, broker, variant, workload),
                    f"throughput {broker} {workload.key} {variant}")
                result["repeat"] = rep
                result["disturbed_attempts"] = disturbed
                infra.log(f"  {result['rate']:.0f} tasks/s in {result['elapsed_s']:.2f}s")
                runs.append(result)
    return {"runs": runs, "summary": summarise(runs), "concurrency": CONCURRENCY,
            "disturbed_attempts": sum(r["disturbed_attempts"] for r in runs),
            "workloads": {w.key: w.label for w in workloads(quick)}}


#: Variants compared with each other in the same repeats (issue 17): the median of
#: per-repeat ratios, next to the ratio to prefork.
COMPARED = {"pulse-results": ("pulse-postgres", "prefork-sqla", "pulse-redis"),
            "pulse-redis": ("pulse-postgres",), "prefork-redis": ("prefork-sqla",)}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median rate per (broker, workload, variant) and median per-repeat ratio vs prefork
    (and, for the result backends, vs the variants of COMPARED)."""
    out = []
    keys = sorted({(r["broker"], r["workload"]) for r in runs},
                  key=lambda k: (k[0] != "rabbitmq", k[1]))
    for broker, workload in keys:
        mine = [r for r in runs if r["broker"] == broker and r["workload"] == workload]
        rates = {v: {r["repeat"]: r["rate"] for r in mine if r["variant"] == v}
                 for v in {r["variant"] for r in mine}}
        base = rates.get("prefork", {})
        for variant in VARIANTS + PEERS + RESULTS:
            rows = [r for r in mine if r["variant"] == variant]
            if not rows:
                continue
            ratios = [r["rate"] / base[r["repeat"]] for r in rows if r["repeat"] in base]
            cpu = {k: statistics.median(r["cpu_ms_per_task"][k] for r in rows)
                   for k in ("parent", "children", "store")}
            vs: dict[str, float] = {}
            for other in COMPARED.get(variant, ()):
                theirs = rates.get(other, {})
                per_repeat = [r["rate"] / theirs[r["repeat"]] for r in rows
                              if r["repeat"] in theirs]
                if per_repeat:
                    vs[other] = statistics.median(per_repeat)
            out.append({
                "broker": broker, "workload": workload, "variant": variant,
                "n": rows[0]["n"], "repeats": len(rows),
                "rate": statistics.median(r["rate"] for r in rows),
                "rates": [r["rate"] for r in rows],
                "ratio": statistics.median(ratios) if ratios else None,
                "vs": vs,
                "results_checked": sum(r.get("results_checked", 0) for r in rows),
                "cpu_ms_per_task": cpu,
                "rss_mb": statistics.median(r["rss_mb"] for r in rows),
                "pss_mb": statistics.median(r["pss_mb"] for r in rows),
            })
    return out
