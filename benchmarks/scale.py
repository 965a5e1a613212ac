"""Scale of the store: W simulated workers, each holding 50 leases, renewing in batches.

Every simulated worker is the real :class:`celery_pulse.leases.LeaseKeeper` on its own
:class:`~celery_pulse.store.sql.SqlStore` (its own connection), exactly as in a
worker: one renewal statement per interval for all its leases. The workers are
spread over a few processes (as real workers are) and start staggered over one
interval. The store is a private, durable PostgreSQL (fsync on), so its CPU can be
read from /proc without anybody else's load in it.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_mod
import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from benchmarks import infra

LEASES = 50
TTL = 3.0
INTERVAL = 1.0


class Quiet:
    """LeaseListener that only counts."""

    def __init__(self) -> None:
        self.lost = 0

    def on_lost(self, claim: Any) -> None:
        self.lost += 1

    def on_hard_stop(self, claim: Any) -> None:
        pass

    def on_renewed(self, claims: Any) -> None:
        pass


def _simulate(url: str, holders: list[str], offsets: list[float], start_at: float,
              duration: float, out: Any) -> None:
    """In a child process: run one LeaseKeeper per holder for ``duration`` seconds."""
    from celery_pulse.leases import LeaseKeeper
    from celery_pulse.store.base import Grant
    from celery_pulse.store.sql import store_on
    from celery_pulse.store.sql.engine import make_engine

    keepers = []
    listeners = []
    stores = []
    for holder in holders:
        store = store_on(make_engine(url))
        stores.append(store)
        store.now()  # open the connection now, not inside the first timed renewal
        listener = Quiet()
        keeper = LeaseKeeper(store, holder, ttl=TTL, interval=INTERVAL, margin=0.3, grace=5.0,
                             listener=listener)
        sent = time.monotonic()
        for i in range(LEASES):
            keeper.add(Grant(f"{holder}-{i}", 1, f"tok-{holder}-{i}", 0.0, 1), sent, 0, False)
        keepers.append(keeper)
        listeners.append(listener)
    for keeper, offset in sorted(zip(keepers, offsets, strict=True), key=lambda k: k[1]):
        delay = start_at + offset - time.time()
        if delay > 0:
            time.sleep(delay)
        keeper.start()
    time.sleep(max(0.0, start_at + INTERVAL + duration - time.time()))
    latencies: list[float] = []
    renewals = failures = 0
    for keeper in keepers:
        keeper.renewer.signal_stop()  # stop renewing (no release at the end: not part of the test)
        keeper.watchdog.signal_stop()
    for keeper in keepers:
        keeper.stop(release=False)
        latencies += keeper.counters.renew_latency
        renewals += keeper.counters.renewals
        failures += keeper.counters.renew_failures
    for store in stores:
        store.close()
    out.put({"latencies": latencies, "renewals": renewals, "failures": failures,
             "lost": sum(listener.lost for listener in listeners)})


def _seed(url: str, holders: list[str]) -> None:
    """One row per lease, held by its simulated worker (epoch 1, known token)."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE pulse_claims"))
        conn.execute(sa.text(
            "INSERT INTO pulse_claims (task_id, task_name, state, holder, token, epoch, "
            "lease_until, attempts, max_attempts, policy, retries, body, headers, properties, "
            "delivery_info, content_type, content_encoding, created_at, reserved_at) "
            "SELECT h || '-' || i, 'bench.noop', 'reserved', h, 'tok-' || h || '-' || i, 1, "
            "extract(epoch from clock_timestamp()) + 60, 1, 10, 'review', 0, '\\x00', '{}', "
            "'{}', '{}', 'application/json', 'utf-8', extract(epoch from clock_timestamp()), "
            "extract(epoch from clock_timestamp()) "
            "FROM unnest(CAST(:holders AS text[])) AS h, generate_series(0, :n - 1) AS i"),
            {"holders": holders, "n": LEASES})
        conn.execute(sa.text("ANALYZE pulse_claims"))
    engine.dispose()


def measure(server: infra.PrivatePostgres, workers: int, duration: float,
            processes: int) -> dict[str, Any]:
    holders = [f"sim{i:03d}-{uuid.uuid4().hex[:4]}" for i in range(workers)]
    _seed(server.url, holders)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.5 + 0.02 * workers  # time for the processes to connect
    procs = []
    for p in range(processes):
        mine = holders[p::processes]
        offsets = [INTERVAL * (holders.index(h) / workers) for h in mine]
        proc = ctx.Process(target=_simulate, args=(server.url, mine, offsets, start_at,
                                                   duration, out), daemon=True)
        proc.start()
        procs.append(proc)
    results: list[dict[str, Any]] = []
    try:
        # Measure the server's CPU only once every simulated worker is renewing.
        time.sleep(max(0.0, start_at + INTERVAL - time.time()))
        cpu0, t0 = server.cpu_seconds(), time.monotonic()
        time.sleep(duration)
        cpu1, t1 = server.cpu_seconds(), time.monotonic()
        deadline = time.monotonic() + 60 + workers * 0.2
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=0.5))
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError("a simulated worker process did not report back "
                                       f"(exit codes {[p.exitcode for p in procs]})") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    latencies = sorted(x for r in results for x in r["latencies"])
    cpu = infra.cpu_delta(cpu0, cpu1)

    def pct(q: float) -> float:
        return float(latencies[min(len(latencies) - 1, int(q * len(latencies)))]) * 1000

    return {
        "workers": workers, "leases": workers * LEASES, "samples": len(latencies),
        "renew_p50_ms": pct(0.50), "renew_p99_ms": pct(0.99),
        "renew_mean_ms": statistics.fmean(latencies) * 1000,
        "renewals": sum(r["renewals"] for r in results),
        "failures": sum(r["failures"] for r in results),
        "lost": sum(r["lost"] for r in results),
        "pg_cpu_percent": 100 * cpu / (t1 - t0),
        "statements_per_second": workers / INTERVAL,
        "rows_per_second": workers * LEASES / INTERVAL,
    }


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    counts = [10, 50] if quick else [10, 25, 50, 100, 200]
    duration = 3.0 if quick else 8.0
    server = infra.PrivatePostgres({"max_connections": "400"}).init()
    points = []
    try:
        infra.migrate(server.url)
        for workers in counts:
            infra.log(f"store scale: {workers} simulated workers x {LEASES} leases")
            point = measure(server, workers, duration, processes=2 if workers <= 25 else 4)
            infra.log(f"  renew p50 {point['renew_p50_ms']:.1f} ms, p99 "
                      f"{point['renew_p99_ms']:.1f} ms, PostgreSQL CPU "
                      f"{point['pg_cpu_percent']:.0f}%")
            points.append(point)
    finally:
        server.destroy()
    return {"points": points, "leases_per_worker": LEASES, "ttl": TTL, "interval": INTERVAL,
            "duration": duration, "default_interval": 10.0}
