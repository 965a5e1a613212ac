"""Memory of the worker's parent over a long run: bytes of RSS per task, per store.

Method: pre-publish N no-op tasks and a final ``bench.stop`` to a fresh RabbitMQ queue,
start one ``-c 2`` worker on it (``-P pulse`` on each store, and plain ``-P prefork``),
and sample the parent's ``VmRSS`` (``/proc/<pid>/status``) and the queue's depth every
quarter of a second until ``bench.stop`` ran. Tasks done = N + 1 - depth (off by the
few prefetched at most). The growth per task is the least-squares slope of RSS over
tasks done in the second half of the run (the first half warms up: imports, caches,
pools, the malloc arenas of the threads), and the plain difference end - middle over
the tasks in between beside it. Only the parent is measured: the pool children are
plain billiard processes on every pool.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any

from benchmarks import infra

CONCURRENCY = 2
#: MariaDB last: the slowest of them here.
VARIANTS = ("prefork", "pulse-postgres", "pulse-sqlite", "pulse-mariadb")
#: Tasks per run: the documented run is the full one (100,000); ``--quick`` is a smoke run.
#: ``PULSE_BENCH_MEMORY_TASKS`` overrides both (``PULSE_BENCH_MEMORY_VARIANTS``: which
#: workers, comma-separated).
FULL, QUICK = 100_000, 3_000
#: Acceptance (issue 35): parent growth over the second half, bytes per task, every store.
LIMIT = 50.0
SAMPLE_EVERY = 0.25


def tasks(quick: bool) -> int:
    return int(os.environ.get("PULSE_BENCH_MEMORY_TASKS") or (QUICK if quick else FULL))


def vm_rss(pid: int) -> int:
    """The resident set of ``pid`` in bytes (``VmRSS``)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class Depth:
    """The queue's depth, over one broker connection kept for the run."""

    def __init__(self, broker: str, queue: str) -> None:
        from kombu import Connection

        self.conn = Connection(broker)
        self.queue = infra.kombu_queue(queue)(self.conn.default_channel)

    def __call__(self) -> int:
        _, depth, _ = self.queue.queue_declare(passive=True)
        return int(depth)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def slope(points: list[tuple[int, int]]) -> float:
    """The least-squares slope of ``(x, y)`` points (0 for fewer than two distinct x)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def growth(samples: list[tuple[float, int, int]], n: int) -> dict[str, float]:
    """Bytes per task over the second half of ``samples`` (time, done, rss)."""
    second = [(done, rss) for _, done, rss in samples if done >= n // 2]
    if len(second) < 2:
        raise RuntimeError(f"too few samples in the second half ({len(second)}): raise N")
    (d0, r0), (d1, r1) = second[0], second[-1]
    return {"slope": slope(second), "diff": (r1 - r0) / max(1, d1 - d0),
            "rss_half_mb": r0 / 2**20, "rss_end_mb": r1 / 2**20}


class Vacuum:
    """``VACUUM ANALYZE`` of a PostgreSQL run's claims every minute, where the server's
    autovacuum is off (as on the benchmark machine): without it, 100,000 tasks leave
    tens of thousands of dead rows and stale statistics, the completions' update turns
    into a scan and the run slows to a crawl. A production server vacuums on its own."""

    EVERY = 60.0

    def __init__(self, url: str | None) -> None:
        import sqlalchemy as sa

        self.engine = None
        self.due = time.monotonic() + self.EVERY
        if url and url.startswith("postgresql"):
            engine = sa.create_engine(url, isolation_level="AUTOCOMMIT",
                                      poolclass=sa.pool.NullPool)
            with engine.connect() as conn:
                if conn.exec_driver_sql("SHOW autovacuum").scalar() == "off":
                    self.engine = engine
                    infra.log("  autovacuum is off: the run vacuums pulse_claims every minute")

    def __call__(self) -> None:
        if self.engine is not None and time.monotonic() >= self.due:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("VACUUM ANALYZE pulse_claims")
            self.due = time.monotonic() + self.EVERY


def run_one(scratch: infra.Scratch, database_url: str, variant: str, n: int,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """One run of ``n`` no-op tasks on ``variant``; its samples and growth."""
    broker = infra.RABBIT_URL
    queue = f"bench-mem-{uuid.uuid4().hex[:10]}"
    stop_file = scratch.path("stop")
    pool = "pulse" if variant.startswith("pulse") else "prefork"
    with contextlib.ExitStack() as stack:
        store = (stack.enter_context(infra.fresh_store(variant.split("-", 1)[1], scratch,
                                                       database_url))
                 if pool == "pulse" else None)
        infra.declare_queue(broker, queue)
        stack.callback(infra.delete_queue, broker, queue)
        infra.publish(broker, queue, [("bench.noop", [])] * n
                      + [("bench.stop", [str(stop_file)])])
        vacuum = Vacuum(store)
        depth = Depth(broker, queue)
        stack.callback(depth.close)
        started = stack.enter_context(infra.workers())
        worker = infra.Worker(scratch, f"mem-{variant}", pool=pool, concurrency=CONCURRENCY,
                              broker=broker, queue=queue, store=store, env=env)
        started.append(worker)
        ready = worker.wait_ready(timeout=60)
        samples: list[tuple[float, int, int]] = []
        deadline = time.monotonic() + max(300.0, n / 20)
        while not (stop_file.exists() and stop_file.stat().st_size > 0):
            worker.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: {n} tasks not done in time:\n"
                                   f"{worker.log()[-3000:]}")
            samples.append((time.time(), n + 1 - depth(), vm_rss(worker.pid)))
            vacuum()
            time.sleep(SAMPLE_EVERY)
        samples.append((time.time(), n, vm_rss(worker.pid)))
        worker.check_undisturbed()
        elapsed = float(stop_file.read_text().split()[-1]) - ready
        worker.kill()
    return {"variant": variant, "n": n, "elapsed_s": elapsed, "rate": n / elapsed,
            "rss_start_mb": samples[0][2] / 2**20, **growth(samples, n),
            "samples": samples[:: max(1, len(samples) // 200)]}


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    database_url = infra.ensure_bench_database()
    n = tasks(quick)
    runs = []
    chosen = os.environ.get("PULSE_BENCH_MEMORY_VARIANTS")  # e.g. "prefork,pulse-sqlite"
    for variant in chosen.split(",") if chosen else VARIANTS:
        infra.log(f"memory {variant}: {n} no-op tasks")
        result, disturbed = infra.retrying(
            lambda v=variant: run_one(scratch, database_url, v, n), f"memory {variant}")
        result["disturbed_attempts"] = disturbed
        infra.log(f"  {result['slope']:.0f} B/task (slope), {result['diff']:.0f} (end - N/2) "
                  f"over the second half: {result['rss_start_mb']:.1f} -> "
                  f"{result['rss_half_mb']:.1f} -> {result['rss_end_mb']:.1f} MB, "
                  f"{result['rate']:.0f} tasks/s")
        runs.append(result)
    return {"runs": runs, "n": n, "limit": LIMIT, "concurrency": CONCURRENCY,
            "ok": all(r["diff"] <= LIMIT for r in runs if r["variant"] != "prefork")}


def markdown(data: dict[str, Any], lines: list[str]) -> None:
    """The section's table (the report calls this)."""
    from benchmarks.report import STORE_LABEL, table

    rows = [[STORE_LABEL.get(r["variant"], r["variant"]), f"{r['rate']:.0f}",
             f"{r['rss_start_mb']:.1f}", f"{r['rss_half_mb']:.1f}", f"{r['rss_end_mb']:.1f}",
             f"{r['slope']:.0f}", f"{r['diff']:.0f}"] for r in data["runs"]]
    lines += [(__doc__ or "").split("\n\n", 1)[1].strip(), "",
              f"{data['n']:,} no-op tasks on one `-c {data['concurrency']}` worker each "
              f"(RabbitMQ). Acceptance (issue 35): growth over the second half ≤ "
              f"{data['limit']:g} B/task on every store.", "",
              table(rows, ["Worker", "tasks/s", "RSS at ready MB", "RSS at N/2 MB",
                           "RSS at the end MB", "B/task, 2nd half (slope)",
                           "B/task, 2nd half (end - N/2)"]), ""]
