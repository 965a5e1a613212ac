"""SQL cost, counted by the server: statements and round trips per task and at idle.

A private PostgreSQL with ``pg_stat_statements`` preloaded serves as the store of one
``-P pulse`` worker (RabbitMQ, ``-c 2``). Every statement the worker sends is one
call there, BEGIN/COMMIT included (``track_utility``). Round trips: the hot path's
statements (reserve, start, complete) travel together in pipelined exchanges, counted
by the worker (``exchanges`` in its stats); every other statement is one round trip.
Three windows, each after a stats reset:

* idle: the worker holds nothing (heartbeat, recover scans, leader, beat);
* load: N no-op tasks published to the running worker, until every claim is final;
* held: the worker holds 10 leases (2 running, 8 prefetched) of long tasks: renewals.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import sqlalchemy as sa

from benchmarks import infra

MONITOR = "bench_monitor"
KINDS = ("reserve", "start", "complete", "renew", "recover", "registry", "leader", "beat",
         "begin/commit", "other")
#: Worker settings for this section (renew every 2 s so renewals show in a short window).
CONF = {"pulse_lease_ttl": 6}


def classify(query: str) -> str:
    q = " ".join(query.split()).upper()
    if re.match(r"^(BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE|START TRANSACTION)\b", q):
        return "begin/commit"
    if "PULSE_CLAIMS" in q:
        if "INSERT INTO PULSE_CLAIMS" in q:
            return "reserve"
        update = re.search(r"(?:^|\) )UPDATE PULSE_CLAIMS SET (.*?) (?:FROM|WHERE) ", q)
        if update:  # plain, or after a ``WITH v(..) AS (VALUES ..)`` of batched leases
            set_clause = update.group(1)
            if set_clause.startswith("LEASE_UNTIL") and "SKIP LOCKED" in q:
                return "renew"
            if "OUTCOME" in set_clause or "FINISHED_AT" in set_clause:
                return "complete"
            if set_clause.startswith("LEASE_UNTIL") and "STARTED_AT" in set_clause:
                return "other"  # release (sets the lease first; constants become $n)
            if "STARTED_AT" in set_clause:
                return "start"
        if "SKIP LOCKED" in q or "ORDER BY PULSE_CLAIMS.LEASE_UNTIL" in q:
            return "recover"
        if q.startswith(("SELECT", "UPDATE", "DELETE")) and "LEASE_UNTIL <=" in q:
            return "recover"
        return "other"
    if "PULSE_WORKERS" in q or "PULSE_DRAINS" in q:
        return "registry"
    if "PULSE_LEADERS" in q:
        return "leader"
    if "PULSE_BEAT" in q or "PULSE_SCHEDULE" in q:
        return "beat"
    return "other"


class Stats:
    """Reads and resets pg_stat_statements as a separate role (filtered out)."""

    def __init__(self, server: infra.PrivatePostgres) -> None:
        admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT",
                                 poolclass=sa.pool.NullPool)
        with admin.connect() as conn:
            conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.exec_driver_sql(f"CREATE ROLE {MONITOR} LOGIN SUPERUSER")
        admin.dispose()
        url = server.url.replace("//postgres@", f"//{MONITOR}@")
        self.engine = sa.create_engine(url, isolation_level="AUTOCOMMIT",
                                       poolclass=sa.pool.NullPool)

    def reset(self) -> float:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT pg_stat_statements_reset()")
        return time.monotonic()

    def read(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT s.query, s.calls, s.rows, s.total_exec_time FROM pg_stat_statements s "
                "JOIN pg_roles r ON r.oid = s.userid WHERE r.rolname <> :monitor"),
                {"monitor": MONITOR}).all()
        return [{"query": r.query, "calls": int(r.calls), "rows": int(r.rows),
                 "ms": float(r.total_exec_time), "kind": classify(r.query)} for r in rows]

    def scalar(self, sql: str) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql)).scalar_one()

    def close(self) -> None:
        self.engine.dispose()


def by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {k: {"calls": 0.0, "rows": 0.0, "ms": 0.0} for k in KINDS}
    for r in rows:
        for field in ("calls", "rows", "ms"):
            out[r["kind"]][field] += r[field]
    return out


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    result, _ = infra.retrying(lambda: measure(scratch, quick), "sql cost")
    return result  # type: ignore[no-any-return]


def measure(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    n = 300 if quick else 2000
    idle_window = 8.0 if quick else 20.0
    held_window = 6.0 if quick else 10.0
    broker = infra.RABBIT_URL
    queue = f"bench-sql-{uuid.uuid4().hex[:10]}"
    server = infra.PrivatePostgres({"shared_preload_libraries": "pg_stat_statements",
                                    "pg_stat_statements.track_utility": "on"}).init()
    result: dict[str, Any] = {"n": n, "conf": CONF, "concurrency": 2}
    try:
        stats = Stats(server)
        infra.migrate(server.url)
        infra.declare_queue(broker, queue)
        with infra.workers() as started:
            worker = infra.Worker(scratch, "sqlcost", pool="pulse", concurrency=2,
                                  broker=broker, queue=queue, store=server.url, conf=CONF)
            started.append(worker)
            worker.wait_ready()
            time.sleep(2.0)  # first leader term, first scans: not part of steady idle

            infra.log(f"sql cost: idle window {idle_window:g}s")
            t0 = stats.reset()
            time.sleep(idle_window)
            idle_rows = stats.read()
            idle_s = time.monotonic() - t0
            worker.check_alive()

            infra.log(f"sql cost: {n} no-op tasks")
            stop_file = scratch.path("stop")
            counts0 = infra.pulse_counts(broker, queue, "sqlcost@bench")
            t0 = stats.reset()
            infra.publish(broker, queue, [("bench.noop", [])] * n
                          + [("bench.stop", [str(stop_file)])])

            def settled() -> bool:
                worker.check_alive()
                return int(stats.scalar("SELECT count(*) FROM pulse_claims WHERE state = "
                                        "'succeeded'")) >= n + 1
            infra.wait_for(settled, max(60.0, n / 10), "every claim to be final", 0.05)
            load_rows = stats.read()
            load_s = time.monotonic() - t0
            counts1 = infra.pulse_counts(broker, queue, "sqlcost@bench")
            time.sleep(1.5)  # backends flush table statistics at most once a second
            with stats.engine.connect() as conn:
                table = conn.execute(sa.text(
                    "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                    "WHERE relname = 'pulse_claims'")).one()

            infra.log("sql cost: 10 leases held")
            infra.publish(broker, queue, [("bench.sleep", [120_000])] * 10)
            infra.wait_for(lambda: int(stats.scalar(
                "SELECT count(*) FROM pulse_claims WHERE state IN ('reserved', 'running')")) >= 10,
                30, "10 leases to be held", 0.05)
            time.sleep(0.5)
            t0 = stats.reset()
            time.sleep(held_window)
            held_rows = stats.read()
            held_s = time.monotonic() - t0
            held_now = stats.scalar("SELECT count(*) FROM pulse_claims "
                                    "WHERE state IN ('reserved', 'running')")
            worker.check_undisturbed()
        infra.delete_queue(broker, queue)
        stats.close()
    finally:
        server.destroy()

    idle = by_kind(idle_rows)
    load = by_kind(load_rows)
    held = by_kind(held_rows)
    idle_rate = {k: v["calls"] / idle_s for k, v in idle.items()}
    total_idle = sum(idle_rate.values())
    per_task = {k: v["calls"] / n for k, v in load.items()}
    task_kinds = ("reserve", "start", "complete")
    # The hot path's statements travel in exchanges (one round trip each, pipelined);
    # every other statement is a round trip of its own.
    exchanges = counts1["exchanges"] - counts0["exchanges"]
    ops = counts1["exchanged_ops"] - counts0["exchanged_ops"]
    round_trips = exchanges + sum(v["calls"] for k, v in load.items() if k not in task_kinds)
    def top(rows: list[dict[str, Any]], seconds: float | None = None) -> list[dict[str, Any]]:
        ordered = sorted(rows, key=lambda r: -r["calls"])[:12]
        return [{"kind": r["kind"], "calls": r["calls"], "rows": r["rows"],
                 "per_second": r["calls"] / seconds if seconds else None,
                 "query": " ".join(r["query"].split())[:160]} for r in ordered]

    result.update({
        "idle_seconds": idle_s, "load_seconds": load_s, "held_seconds": held_s,
        "idle_per_second": idle_rate, "idle_total_per_second": total_idle,
        "per_task": per_task,
        "statements_per_task_total": sum(per_task.values()),
        "per_task_total": round_trips / n,
        "exchanges_per_task": exchanges / n,
        "ops_per_exchange": ops / exchanges if exchanges else None,
        "per_task_lifecycle": sum(per_task[k] for k in task_kinds),
        "per_task_net_of_idle": max(0.0, round_trips / n - total_idle * load_s / n),
        "rows_per_call": {k: (load[k]["rows"] / load[k]["calls"] if load[k]["calls"] else None)
                          for k in task_kinds},
        "exec_ms_per_call": {k: (load[k]["ms"] / load[k]["calls"] if load[k]["calls"] else None)
                             for k in task_kinds},
        "claims_updates": int(table.n_tup_upd),
        "claims_hot_updates": int(table.n_tup_hot_upd),
        "held_leases": int(held_now),
        "renew_calls_per_second": held["renew"]["calls"] / held_s,
        "renew_rows_per_call": (held["renew"]["rows"] / held["renew"]["calls"]
                                if held["renew"]["calls"] else None),
        "renew_interval": CONF["pulse_lease_ttl"] / 3,
        "top_statements": top(load_rows),
        "top_idle_statements": top(idle_rows, idle_s),
    })
    return result
