"""MySQL/MariaDB drivers: what each costs pulse, to choose the default by measurement.

Each installed driver of ``celery_pulse.store.sql.engine.MYSQL_DRIVERS`` is measured two
ways, in alternated repeats on fresh MariaDB databases:

* **the store's hot path in one process**: rounds of ``reserve`` (granted ``running``,
  as for a job that goes straight to a pool process) then ``complete``, of 1 task and of
  16 tasks per batch; wall time and this process's CPU per task. This is the client
  cost the driver can change (the server's work is the same for each).
* **a worker**: 2,000 no-op tasks on a ``-P pulse -c 2`` worker (RabbitMQ), as in the
  throughput section, against plain prefork in the same repeat.
"""

from __future__ import annotations

import functools
import importlib
import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from benchmarks import infra, throughput
from celery_pulse.store.base import Completion, Grant, Message, ReserveRequest
from celery_pulse.store.sql import open_store
from celery_pulse.store.sql.engine import MYSQL_DRIVERS

BATCHES = (1, 16)
TASKS_PER_BATCH_SIZE = 1600
BODY = b'[[], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'


def installed() -> list[str]:
    """The drivers that import here (the C ones need libmariadb-dev to build)."""
    out = []
    for driver, (module, _install) in MYSQL_DRIVERS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        out.append(driver)
    return out


def driver_url(driver: str) -> str:
    url = sa.make_url(infra.MARIADB_URL)
    return url.set(drivername=f"{url.get_backend_name()}+{driver}").render_as_string(
        hide_password=False)


def _request() -> ReserveRequest:
    task_id = uuid.uuid4().hex
    message = Message(BODY, {"id": task_id, "task": "bench.noop", "retries": 0},
                      {"correlation_id": task_id, "priority": 0},
                      {"exchange": "", "routing_key": "celery"}, "application/json", "utf-8")
    return ReserveRequest(task_id, "bench.noop", message, "redispatch", 10, start=True)


def hot_path(url: str, batch: int, tasks: int) -> dict[str, float]:
    """Wall and CPU milliseconds per task of reserve+complete rounds of ``batch`` tasks."""
    store = open_store(url)
    try:
        store.reserve("bench", [_request()], 30)  # connect and warm the statement caches
        rounds = max(1, tasks // batch)
        requests = [[_request() for _ in range(batch)] for _ in range(rounds)]
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for group in requests:
            grants = store.reserve("bench", group, 30)
            store.complete("bench", [Completion(g.task_id, g.epoch, g.token, "succeeded")
                                     for g in grants if isinstance(g, Grant)])
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        store.close()
    n = rounds * batch
    return {"wall_ms": 1000 * wall / n, "cpu_ms": 1000 * cpu / n}


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    drivers = installed()
    missing = [d for d in MYSQL_DRIVERS if d not in drivers]
    repeats = 1 if quick else 3
    tasks = 200 if quick else TASKS_PER_BATCH_SIZE
    workload = throughput.workloads(quick)[0]  # the no-op run: 500 quick, 2,000 in full
    database_url = infra.ensure_bench_database()
    hot: list[dict[str, Any]] = []
    worker: list[dict[str, Any]] = []
    for rep in range(repeats):
        for driver in drivers[rep % len(drivers):] + drivers[:rep % len(drivers)]:
            with infra.fresh_mariadb(driver_url(driver)) as url:
                for batch in BATCHES:
                    infra.log(f"drivers: hot path {driver} batch {batch} (#{rep + 1}/{repeats})")
                    hot.append({"driver": driver, "batch": batch, "repeat": rep,
                                **hot_path(url, batch, tasks)})
        for variant, driver in [("prefork", None), *(("pulse-mariadb", d) for d in drivers)]:
            infra.log(f"drivers: worker {variant} {driver or ''} (#{rep + 1}/{repeats})")
            one = functools.partial(throughput.run_one, scratch, database_url, "rabbitmq",
                                    variant, workload,
                                    mariadb_url=driver_url(driver or "pymysql"))
            result, _disturbed = infra.retrying(one, f"drivers {variant} {driver}")
            worker.append({"driver": driver or "prefork", "repeat": rep,
                           "rate": result["rate"], "cpu_ms_per_task": result["cpu_ms_per_task"]})
    return {"drivers": drivers, "missing": missing, "workload": workload.label,
            "versions": _versions(drivers), "summary": summarise(hot, worker, drivers)}


def _versions(drivers: list[str]) -> dict[str, str]:
    from importlib.metadata import version

    dists = {"pymysql": "PyMySQL", "mysqldb": "mysqlclient", "mariadbconnector": "mariadb"}
    return {d: version(dists[d]) for d in drivers}


def summarise(hot: list[dict[str, Any]], worker: list[dict[str, Any]], drivers: list[str]
              ) -> list[dict[str, Any]]:
    """Medians per driver, and per-repeat ratios (worker rate vs prefork)."""
    rows = []
    base = {r["repeat"]: r["rate"] for r in worker if r["driver"] == "prefork"}
    for driver in drivers:
        row: dict[str, Any] = {"driver": driver}
        for batch in BATCHES:
            mine = [h for h in hot if h["driver"] == driver and h["batch"] == batch]
            row[f"wall_ms_{batch}"] = statistics.median(h["wall_ms"] for h in mine)
            row[f"cpu_ms_{batch}"] = statistics.median(h["cpu_ms"] for h in mine)
        runs = [w for w in worker if w["driver"] == driver]
        row["rate"] = statistics.median(w["rate"] for w in runs)
        row["ratio"] = statistics.median(w["rate"] / base[w["repeat"]] for w in runs)
        row["parent_cpu_ms"] = statistics.median(w["cpu_ms_per_task"]["parent"] for w in runs)
        rows.append(row)
    return rows

