"""SQL cost, counted by the server: statements and round trips per task and at idle.

Once per server store, a private server of our own is the store of one ``-P pulse``
worker (RabbitMQ, ``-c 2``), so that nobody else's statements are counted:

* PostgreSQL, with ``pg_stat_statements`` preloaded: every statement the worker sends
  is one call there, BEGIN/COMMIT included (``track_utility``). Round trips: the hot
  path's statements (reserve, start, complete) travel together in pipelined exchanges,
  counted by the worker (``exchanges`` in its stats); every other statement is one
  round trip.
* MariaDB, with the Performance Schema on: every statement is counted by its digest
  (``events_statements_summary_by_digest``, COMMIT and ROLLBACK included). Every
  statement is a round trip of its own but for those the usual exchange sends together
  in one multi-statement packet, counted by the worker (``packets`` and
  ``packet_statements`` in its stats); requests that are not statements (a ping, say)
  are added from the worker's user's counts by command
  (``events_statements_summary_by_user_by_event_name``).

The reads of each server come from a monitoring user of their own, left out of the
counts. Three windows, each after a stats reset:

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
#: The hot path's kinds: reservations, starts and completions.
TASK_KINDS = ("reserve", "start", "complete")
#: Worker settings for this section (renew every 2 s so renewals show in a short window).
CONF = {"pulse_lease_ttl": 6}
#: The private MariaDB's settings: durable (as in production), statements counted by
#: digest, digests long enough to tell pulse's statements apart.
MARIADB_SETTINGS = {"performance-schema": "ON", "max-digest-length": "4096",
                    "performance-schema-max-digest-length": "4096"}
_TRANSACTION = re.compile(r"^(BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE|START TRANSACTION)\b")


def classify(query: str) -> str:
    """The kind of a PostgreSQL statement (``pg_stat_statements`` text)."""
    q = " ".join(query.split()).upper()
    if _TRANSACTION.match(q):
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
    return _other_tables(q)


def _other_tables(q: str) -> str:
    if "PULSE_WORKERS" in q or "PULSE_DRAINS" in q:
        return "registry"
    if "PULSE_LEADERS" in q:
        return "leader"
    if "PULSE_BEAT" in q or "PULSE_SCHEDULE" in q:
        return "beat"
    return "other"


def normalise_digest(text: str) -> str:
    """A MariaDB digest as plain upper-case SQL: ``\\`pulse_claims\\` . \\`state\\``` ->
    ``PULSE_CLAIMS.STATE``, no space inside parentheses or before commas."""
    q = " ".join(text.replace("`", "").split()).upper()
    q = re.sub(r" ?\. ?", ".", q)
    q = re.sub(r"\( ", "(", q)
    q = re.sub(r" \)", ")", q)
    return q.replace(" ,", ",")


#: The columns a MariaDB statement on pulse_claims reads, by the transaction it serves
#: (``celery_pulse/store/sql/mysql.py``, ``mysql_sql.py``: each operation reads its rows
#: under lock, writes, then reads back what it wrote).
_MYSQL_READS = (
    ("TASK_ID, STATE, HOLDER, EPOCH, ATTEMPTS, MAX_ATTEMPTS,", "reserve"),  # locked read
    ("TASK_ID, EPOCH, TOKEN, LEASE_UNTIL, ATTEMPTS, STATE FROM", "reserve"),  # read back
    ("TASK_ID, EPOCH, TOKEN, STATE FROM", "complete"),  # locked read
    ("TASK_ID, STATE, EPOCH FROM", "complete"),  # a stale completion's read
    ("TASK_ID, LEASE_UNTIL FROM", "start"),  # read back
)


def classify_mysql(digest: str) -> str:
    """The kind of a MariaDB statement (its Performance Schema digest)."""
    q = normalise_digest(digest)
    if _TRANSACTION.match(q):
        return "begin/commit"
    if "PULSE_CLAIMS" not in q:
        return _other_tables(q)
    if q.startswith("INSERT INTO PULSE_CLAIMS"):
        return "reserve"  # new claims, and re-grants (ON DUPLICATE KEY UPDATE)
    if "ORDER BY PULSE_CLAIMS.LEASE_UNTIL" in q:
        return "recover"
    update = re.match(r"UPDATE PULSE_CLAIMS SET (.*?) WHERE (.*)", q)
    if update:
        columns = re.findall(r"(?:^|, )([A-Z_]+) = ", update.group(1))
        if columns == ["LEASE_UNTIL"]:
            return "renew"
        where = update.group(2).removeprefix("PULSE_CLAIMS.")  # Core's, or as text
        if "OUTCOME" in columns and "EPOCH" not in columns and where.startswith("TASK_ID IN "):
            return "complete"
        if columns[:1] == ["STATE"] and "STARTED_AT" in columns:
            return "start"
        if "EPOCH" in columns or "LEASE_UNTIL <=" in q:
            return "recover"
        return "other"  # release, mark_published, review
    select = re.match(r"SELECT (.*?) FROM PULSE_CLAIMS ", q + " ")
    if select:
        selected = ", ".join(c.split(".")[-1] for c in select.group(1).split(", "))
        for prefix, kind in _MYSQL_READS:
            if (selected + " FROM").startswith(prefix):
                return kind
        if selected == "TASK_ID":  # a locked read of our leases: renew skips locked rows
            return "renew" if "SKIP LOCKED" in q or "FOR UPDATE" not in q else "start"
    if "LEASE_UNTIL <=" in q:
        return "recover"
    return "other"


class PgStats:
    """Reads and resets pg_stat_statements as a separate role (filtered out)."""

    store = "postgres"
    #: The hot path's statements share one round trip per exchange.
    pipelined = True

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

    def claims(self, *states: str) -> int:
        """How many claims are in one of ``states``."""
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM pulse_claims WHERE state "
                                            "IN :states").bindparams(
                sa.bindparam("states", expanding=True)), {"states": list(states)}).scalar_one())

    def claims_table(self) -> dict[str, int]:
        """Row updates of pulse_claims, and how many were HOT (PostgreSQL's statistics)."""
        time.sleep(1.5)  # backends flush table statistics at most once a second
        with self.engine.connect() as conn:
            table = conn.execute(sa.text(
                "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                "WHERE relname = 'pulse_claims'")).one()
        return {"claims_updates": int(table.n_tup_upd),
                "claims_hot_updates": int(table.n_tup_hot_upd)}

    def close(self) -> None:
        self.engine.dispose()


class MariaDBStats:
    """Reads and resets the Performance Schema's statement counts as a separate user.

    Digests carry no user, so the worker's statements are those run in the store's
    database (the monitor connects to none); the count of requests that are not
    statements comes from the worker's user (root) alone.
    """

    store = "mariadb"
    #: A statement is a round trip of its own, but for those a packet carried together
    #: (counted by the worker: :func:`measure`).
    pipelined = False

    def __init__(self, server: infra.PrivateMariaDB) -> None:
        url = sa.make_url(server.url)
        self.schema = url.database
        self.user = url.username
        admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE USER {MONITOR}@'127.0.0.1'")
            conn.exec_driver_sql(f"GRANT ALL PRIVILEGES ON *.* TO {MONITOR}@'127.0.0.1'")
        admin.dispose()
        monitor = sa.URL.create(url.drivername, username=MONITOR, host=url.host,
                                port=url.port)  # no database: its statements have no schema
        self.engine = sa.create_engine(monitor, isolation_level="AUTOCOMMIT",
                                       poolclass=sa.pool.NullPool)

    def reset(self) -> float:
        with self.engine.connect() as conn:
            for table in ("events_statements_summary_by_digest",
                          "events_statements_summary_by_user_by_event_name"):
                conn.exec_driver_sql(f"TRUNCATE TABLE performance_schema.{table}")
        return time.monotonic()

    def read(self) -> list[dict[str, Any]]:
        """One row per statement digest, plus one per kind of request that is not a
        statement (``statement/com/*`` but a query or the goodbye, which has no reply)."""
        with self.engine.connect() as conn:
            digests = conn.execute(sa.text(
                "SELECT digest_text, count_star, sum_rows_sent + sum_rows_affected AS n_rows, "
                "sum_timer_wait / 1e9 AS ms FROM performance_schema."
                "events_statements_summary_by_digest WHERE schema_name = :schema "
                "AND count_star > 0"), {"schema": self.schema}).all()
            commands = conn.execute(sa.text(
                "SELECT event_name, count_star FROM performance_schema."
                "events_statements_summary_by_user_by_event_name WHERE user = :user AND "
                "event_name LIKE 'statement/com/%' AND event_name NOT IN "
                "('statement/com/Query', 'statement/com/Quit') AND count_star > 0"),
                {"user": self.user}).all()
        rows = [{"query": normalise_digest(r.digest_text), "calls": int(r.count_star),
                 "rows": int(r.n_rows), "ms": float(r.ms),
                 "kind": classify_mysql(r.digest_text)} for r in digests]
        rows += [{"query": f"({r.event_name.rsplit('/', 1)[1]} command)",
                  "calls": int(r.count_star), "rows": 0, "ms": 0.0, "kind": "other"}
                 for r in commands]
        return rows

    def claims(self, *states: str) -> int:
        """How many claims are in one of ``states``."""
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(
                f"SELECT count(*) FROM `{self.schema}`.pulse_claims WHERE state IN :states")
                .bindparams(sa.bindparam("states", expanding=True)),
                {"states": list(states)}).scalar_one())

    def claims_table(self) -> dict[str, int]:
        return {}  # InnoDB has no HOT updates to count

    def close(self) -> None:
        self.engine.dispose()


def by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {k: {"calls": 0.0, "rows": 0.0, "ms": 0.0} for k in KINDS}
    for r in rows:
        for field in ("calls", "rows", "ms"):
            out[r["kind"]][field] += r[field]
    return out


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    """PostgreSQL's figures at the top level (as before MariaDB was measured), MariaDB's
    under ``mariadb``."""
    result, _ = infra.retrying(lambda: measure_postgres(scratch, quick), "sql cost")
    result["mariadb"], _ = infra.retrying(lambda: measure_mariadb(scratch, quick),
                                          "sql cost on MariaDB")
    return result  # type: ignore[no-any-return]


def measure_postgres(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    server = infra.PrivatePostgres({"shared_preload_libraries": "pg_stat_statements",
                                    "pg_stat_statements.track_utility": "on"})
    return _measure_on(scratch, quick, server, PgStats)


def measure_mariadb(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    return _measure_on(scratch, quick, infra.PrivateMariaDB(MARIADB_SETTINGS), MariaDBStats)


def _measure_on(scratch: infra.Scratch, quick: bool, server: Any,
                stats_type: type[PgStats] | type[MariaDBStats]) -> dict[str, Any]:
    """:func:`measure` on a private ``server`` of our own, read through ``stats_type``."""
    try:
        server.init()
        stats = stats_type(server)
        try:
            return measure(scratch, quick, stats, server.url)
        finally:
            stats.close()
    finally:
        server.destroy()


def measure(scratch: infra.Scratch, quick: bool, stats: PgStats | MariaDBStats,
            url: str) -> dict[str, Any]:
    n = 300 if quick else 2000
    idle_window = 8.0 if quick else 20.0
    held_window = 6.0 if quick else 10.0
    broker = infra.RABBIT_URL
    queue = f"bench-sql-{uuid.uuid4().hex[:10]}"
    name = f"sqlcost-{stats.store}"
    result: dict[str, Any] = {"store": stats.store, "n": n, "conf": CONF, "concurrency": 2}
    infra.migrate(url)
    infra.declare_queue(broker, queue)
    try:
        with infra.workers() as started:
            worker = infra.Worker(scratch, name, pool="pulse", concurrency=2,
                                  broker=broker, queue=queue, store=url, conf=CONF)
            started.append(worker)
            worker.wait_ready()
            time.sleep(2.0)  # first leader term, first scans: not part of steady idle

            infra.log(f"sql cost ({stats.store}): idle window {idle_window:g}s")
            t0 = stats.reset()
            time.sleep(idle_window)
            idle_rows = stats.read()
            idle_s = time.monotonic() - t0
            worker.check_alive()

            infra.log(f"sql cost ({stats.store}): {n} no-op tasks")
            stop_file = scratch.path("stop")
            counts0 = infra.pulse_counts(broker, queue, f"{name}@bench")
            t0 = stats.reset()
            infra.publish(broker, queue, [("bench.noop", [])] * n
                          + [("bench.stop", [str(stop_file)])])

            def settled() -> bool:
                worker.check_alive()
                return stats.claims("succeeded") >= n + 1
            infra.wait_for(settled, max(60.0, n / 10), "every claim to be final", 0.05)
            load_rows = stats.read()
            load_s = time.monotonic() - t0
            counts1 = infra.pulse_counts(broker, queue, f"{name}@bench")
            result.update(stats.claims_table())

            infra.log(f"sql cost ({stats.store}): 10 leases held")
            infra.publish(broker, queue, [("bench.sleep", [120_000])] * 10)
            infra.wait_for(lambda: stats.claims("reserved", "running") >= 10,
                           30, "10 leases to be held", 0.05)
            time.sleep(0.5)
            t0 = stats.reset()
            time.sleep(held_window)
            held_rows = stats.read()
            held_s = time.monotonic() - t0
            held_now = stats.claims("reserved", "running")
            worker.check_undisturbed()
    finally:
        infra.delete_queue(broker, queue)

    idle = by_kind(idle_rows)
    load = by_kind(load_rows)
    held = by_kind(held_rows)
    idle_rate = {k: v["calls"] / idle_s for k, v in idle.items()}
    total_idle = sum(idle_rate.values())
    per_task = {k: v["calls"] / n for k, v in load.items()}
    exchanges = counts1["exchanges"] - counts0["exchanges"]
    ops = counts1["exchanged_ops"] - counts0["exchanged_ops"]
    if stats.pipelined:
        # The hot path's statements travel in exchanges (one round trip each,
        # pipelined); every other statement is a round trip of its own.
        round_trips = exchanges + sum(v["calls"] for k, v in load.items()
                                      if k not in TASK_KINDS)
    else:  # one statement (or other request), one round trip, but for those a packet
        # carried together (MariaDB's usual exchange: the worker counts them)
        carried = counts1.get("packet_statements", 0) - counts0.get("packet_statements", 0)
        packets = counts1.get("packets", 0) - counts0.get("packets", 0)
        round_trips = sum(v["calls"] for v in load.values()) - carried + packets

    def rollbacks(rows: list[dict[str, Any]]) -> float:
        return float(sum(r["calls"] for r in rows
                         if r["query"].lstrip().upper().startswith("ROLLBACK")))

    def top(rows: list[dict[str, Any]], seconds: float | None = None) -> list[dict[str, Any]]:
        ordered = sorted(rows, key=lambda r: -r["calls"])[:12]
        return [{"kind": r["kind"], "calls": r["calls"], "rows": r["rows"],
                 "per_second": r["calls"] / seconds if seconds else None,
                 "query": " ".join(r["query"].split())[:160]} for r in ordered]

    result.update({
        "pipelined": stats.pipelined,
        "idle_seconds": idle_s, "load_seconds": load_s, "held_seconds": held_s,
        "idle_per_second": idle_rate, "idle_total_per_second": total_idle,
        "per_task": per_task,
        "statements_per_task_total": sum(per_task.values()),
        "per_task_total": round_trips / n,
        "exchanges_per_task": exchanges / n,
        "ops_per_exchange": ops / exchanges if exchanges else None,
        "per_task_lifecycle": sum(per_task[k] for k in TASK_KINDS),
        "rollbacks_per_task": rollbacks(load_rows) / n,
        "idle_rollbacks_per_second": rollbacks(idle_rows) / idle_s,
        "per_task_net_of_idle": max(0.0, round_trips / n - total_idle * load_s / n),
        "rows_per_call": {k: (load[k]["rows"] / load[k]["calls"] if load[k]["calls"] else None)
                          for k in TASK_KINDS},
        "exec_ms_per_call": {k: (load[k]["ms"] / load[k]["calls"] if load[k]["calls"] else None)
                             for k in TASK_KINDS},
        "held_leases": int(held_now),
        "renew_calls_per_second": held["renew"]["calls"] / held_s,
        "renew_rows_per_call": (held["renew"]["rows"] / held["renew"]["calls"]
                                if held["renew"]["calls"] else None),
        "renew_interval": CONF["pulse_lease_ttl"] / 3,
        "top_statements": top(load_rows),
        "top_idle_statements": top(idle_rows, idle_s),
    })
    return result
