"""What checkpoints cost the renewal: statements per interval and renewal latency.

One simulated worker is the real :class:`celery_pulse.leases.LeaseKeeper` on its own
:class:`~celery_pulse.store.sql.SqlStore`, holding 50 running leases and renewing them
every 1 s (TTL 3 s), with the real shared checkpoint slots of a worker
(:class:`celery_pulse.pool.slots.DeadlineTable`). A thread stands for the pool processes:
it writes one checkpoint per task per interval into the slots, spread over the interval,
as ``lease.checkpoint(value)`` does in a pool process. The store is a private, durable
PostgreSQL with ``pg_stat_statements``: the statements are the server's count. Variants,
measured in the same run:

* **none**: no checkpoint (the baseline: renewal alone);
* **default, 100 B** and **default, 4 KiB**: ``checkpoint(value)``, carried by the renewal;
* **wait=True, 100 B**: each checkpoint committed on its own, as ``wait=True`` does (one
  connection, as a pool process's).

"Renew p99" is the renewal statement alone (the keeper's own measure); "renew + carry
p99" the renewal with the checkpoints it carried, i.e. the renewer thread's whole turn.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa

from benchmarks import infra
from benchmarks.scale import Quiet
from benchmarks.sqlcost import PgStats

LEASES = 50
TTL = 3.0
INTERVAL = 1.0
VARIANTS = {"none": (0, False), "default-100B": (100, False), "default-4KiB": (4096, False),
            "wait-100B": (100, True)}
LABELS = {"none": "none", "default-100B": "default, 100 B", "default-4KiB": "default, 4 KiB",
          "wait-100B": "wait=True, 100 B"}


def _seed(url: str, holder: str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE pulse_claims"))
        conn.execute(sa.text(
            "INSERT INTO pulse_claims (task_id, task_name, state, holder, token, epoch, "
            "lease_until, attempts, max_attempts, policy, retries, body, headers, properties, "
            "delivery_info, content_type, content_encoding, created_at, reserved_at, "
            "started_at) SELECT :h || '-' || i, 'bench.walk', 'running', :h, "
            "'tok-' || :h || '-' || i, 1, extract(epoch from clock_timestamp()) + 60, 1, 10, "
            "'redispatch', 0, '\\x00', '{}', '{}', '{}', 'application/json', 'utf-8', "
            "extract(epoch from clock_timestamp()), extract(epoch from clock_timestamp()), "
            "extract(epoch from clock_timestamp()) FROM generate_series(0, :n - 1) AS i"),
            {"h": holder, "n": LEASES})
        conn.execute(sa.text("ANALYZE pulse_claims"))
    engine.dispose()


def measure(server: infra.PrivatePostgres, stats: PgStats, variant: str,
            duration: float) -> dict[str, Any]:
    from celery_pulse.leases import LeaseKeeper
    from celery_pulse.pool.slots import DeadlineTable
    from celery_pulse.store.base import Grant
    from celery_pulse.store.checkpoints import CheckpointWrite
    from celery_pulse.store.sql import store_on
    from celery_pulse.store.sql.engine import make_engine

    size, wait = VARIANTS[variant]
    holder = f"cp-{uuid.uuid4().hex[:6]}"
    _seed(server.url, holder)
    store = store_on(make_engine(server.url))
    child_store = store_on(make_engine(server.url))
    store.now()
    child_store.now()
    table = DeadlineTable(size=256)
    keeper = LeaseKeeper(store, holder, ttl=TTL, interval=INTERVAL, margin=0.3, grace=5.0,
                         listener=Quiet(), checkpoints=table.checkpoints)
    sent = time.monotonic()
    for i in range(LEASES):
        claim = keeper.add(Grant(f"{holder}-{i}", 1, f"tok-{holder}-{i}", 0.0, 1), sent, 0,
                           False)
        keeper.mark_running(claim, sent)
        claim.slot = table.assign(claim.task_id, claim.deadline)
    carried: list[float] = []
    plain_write = store.checkpoint

    def timed_write(*args: Any) -> Any:
        t0 = time.monotonic()
        try:
            return plain_write(*args)
        finally:
            carried.append(time.monotonic() - t0)
    store.checkpoint = timed_write  # type: ignore[method-assign]
    stop = threading.Event()
    commits: list[float] = []

    def children() -> None:
        """One checkpoint per task per interval, spread over it."""
        claims = keeper.held()
        seq = 0
        while not stop.is_set():
            seq += 1
            for claim in claims:
                if stop.wait(INTERVAL / LEASES):
                    return
                text = json.dumps({"next": seq, "pad": "x" * max(0, size - 22)},
                                  separators=(",", ":"))
                if wait:
                    t0 = time.monotonic()
                    child_store.checkpoint(holder, [CheckpointWrite(
                        claim.task_id, claim.epoch, claim.token, seq, text)])
                    commits.append(time.monotonic() - t0)
                else:
                    assert claim.slot is not None
                    table.checkpoints.put(claim.slot, claim.task_id, claim.epoch, seq, text)

    writer = threading.Thread(target=children, daemon=True)
    keeper.start()
    try:
        if size:
            writer.start()
        time.sleep(2 * INTERVAL)  # renewing and writing steadily before the count starts
        renewals0, latencies0 = keeper.counters.renewals, len(keeper.counters.renew_latency)
        carried.clear()
        commits.clear()
        stats.reset()
        t0 = time.monotonic()
        time.sleep(duration)
        rows = stats.read()
        elapsed = time.monotonic() - t0
        renewals = keeper.counters.renewals - renewals0
        latencies = sorted(keeper.counters.renew_latency[latencies0:])
    finally:
        stop.set()
        keeper.renewer.signal_stop()
        keeper.watchdog.signal_stop()
        keeper.stop(release=False)
        if writer.is_alive():
            writer.join(5)
        store.close()
        child_store.close()
    statements = sum(r["calls"] for r in rows)
    intervals = elapsed / INTERVAL
    turns = sorted(latencies[i] + (carried[i] if i < len(carried) else 0.0)
                   for i in range(len(latencies)))
    return {
        "variant": variant, "seconds": elapsed, "renewals": renewals,
        "statements_per_interval": statements / intervals,
        "checkpoint_statements_per_interval": sum(
            r["calls"] for r in rows if "checkpoint" in r["query"].lower()) / intervals,
        "renew_p50_ms": pct(latencies, 0.5), "renew_p99_ms": pct(latencies, 0.99),
        "turn_p99_ms": pct(turns, 0.99),
        "carry_p99_ms": pct(sorted(carried), 0.99) if carried else None,
        "commit_p50_ms": pct(sorted(commits), 0.5) if commits else None,
        "commit_p99_ms": pct(sorted(commits), 0.99) if commits else None,
        "carried": keeper.counters.checkpoints, "lost": keeper.listener.lost,  # type: ignore[attr-defined]
        "top": sorted(((r["calls"] / intervals, " ".join(r["query"].split())[:110])
                       for r in rows), reverse=True)[:4],
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return float(values[min(len(values) - 1, int(q * len(values)))]) * 1000


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    duration = 3.0 if quick else 20.0
    server = infra.PrivatePostgres({"shared_preload_libraries": "pg_stat_statements",
                                    "pg_stat_statements.track_utility": "on"}).init()
    points = []
    try:
        infra.migrate(server.url)
        stats = PgStats(server)
        try:
            for variant in VARIANTS:
                infra.log(f"checkpoints: {LABELS[variant]}, {LEASES} running leases")
                point = measure(server, stats, variant, duration)
                infra.log(f"  {point['statements_per_interval']:.2f} statements per interval, "
                          f"renew p99 {point['renew_p99_ms']:.1f} ms")
                points.append(point)
        finally:
            stats.close()
    finally:
        server.destroy()
    base = points[0]
    for point in points:
        point["statements_ratio"] = (point["statements_per_interval"]
                                     / max(base["statements_per_interval"], 1e-9))
        point["renew_p99_ratio"] = point["renew_p99_ms"] / max(base["renew_p99_ms"], 1e-9)
    return {"points": points, "leases": LEASES, "ttl": TTL, "interval": INTERVAL,
            "duration": duration}


def markdown(data: dict[str, Any], lines: list[str]) -> None:
    """Section 14 of docs/benchmarks.md."""
    lines += [(__doc__ or "").split("\n\n", 1)[1].strip(), "",
              f"{data['leases']} running leases, renewal every {data['interval']:g} s, "
              f"{data['duration']:g} s counted per variant.", "",
              "| Checkpoints | statements per interval | vs none | of them checkpoint "
              "writes | renew p50 / p99 ms | renew + carry p99 ms | wait=True commit "
              "p50 / p99 ms | carried | leases lost |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in data["points"]:
        commit = ("—" if p["commit_p50_ms"] is None
                  else f"{p['commit_p50_ms']:.1f} / {p['commit_p99_ms']:.1f}")
        lines.append(
            f"| {LABELS[p['variant']]} | {p['statements_per_interval']:.2f} | "
            f"{p['statements_ratio']:.2f}\u00d7 | {p['checkpoint_statements_per_interval']:.2f} | "
            f"{p['renew_p50_ms']:.1f} / {p['renew_p99_ms']:.1f} | {p['turn_p99_ms']:.1f} | "
            f"{commit} | {p['carried']} | {p['lost']} |")
    lines.append("")
    for p in data["points"]:
        lines.append(f"Most frequent statements, {LABELS[p['variant']]}: " + "; ".join(
            f"{calls:.2f}/interval `{text}`" for calls, text in p["top"]))
        lines.append("")
    if median_renew := statistics.median(p["renew_p99_ms"] for p in data["points"]):
        lines.append(f"(median renew p99 over the variants: {median_renew:.1f} ms)")
