"""Retention that keeps up (issue 35): no-op tasks at the highest rate one worker reaches,
with a short ``pulse_retention`` and purge interval, on each store.

Before, a pass deleted at most 500 finished claims, one pass a minute: above 8.3 tasks/s
the claims table grew without end. Measured here, per store: the task rate; the purge
rate (finished claims deleted per second, from the worker's ``pulse.retention`` stat and
from the count over the run); the largest number of finished claims past retention + one
purge interval seen while the tasks ran (sampled every 0.5 s); and that number once the
tasks are done and one more interval went by, which must be 0.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa

from benchmarks import infra
from celery_pulse.store.base import FINISHED_STATES
from celery_pulse.store.sql import open_store
from celery_pulse.store.sql.tables import claims

RETENTION = 5.0
INTERVAL = 5.0
CONF = {"pulse_retention": RETENTION, "pulse_purge_interval": INTERVAL}
STORES = ("postgres", "mariadb", "sqlite")
STORE_NAMES = {"postgres": "PostgreSQL", "mariadb": "MariaDB", "sqlite": "SQLite"}


class Sampler(threading.Thread):
    """Counts finished claims past retention + one interval every 0.5 s (the largest)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.store = open_store(url)
        self.worst = 0
        self.done = threading.Event()

    def past(self) -> int:
        now = self.store.conns.now
        stmt = sa.select(sa.func.count()).select_from(claims).where(
            claims.c.state.in_(FINISHED_STATES),
            claims.c.finished_at < now - (RETENTION + INTERVAL))
        with self.store.conns.read() as conn:
            return int(conn.execute(stmt).scalar_one())

    def run(self) -> None:
        while not self.done.wait(0.5):
            with contextlib.suppress(Exception):
                self.worst = max(self.worst, self.past())


def stats_of(broker: str, queue: str, store: str, kind: str) -> dict[str, Any]:
    """The worker's ``pulse`` stats section (``celery inspect stats``)."""
    name = f"retention-{kind}@bench"
    out = infra.celery_cli(broker, queue, "inspect", "stats", "-d", name, "--json", store=store,
                           conf=CONF)
    section: dict[str, Any] = json.loads(out)[name]["pulse"]
    return section


def one_store(scratch: infra.Scratch, kind: str, database_url: str, n: int) -> dict[str, Any]:
    broker = infra.RABBIT_URL
    queue = f"bench-retention-{uuid.uuid4().hex[:10]}"
    stop_file = scratch.path(f"retention-stop-{kind}")
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(infra.fresh_store(kind, scratch, database_url))
        infra.declare_queue(broker, queue)
        stack.callback(infra.delete_queue, broker, queue)
        infra.publish(broker, queue, [("bench.noop", [])] * n + [("bench.stop", [str(stop_file)])])
        sampler = Sampler(store)
        stack.callback(sampler.store.close)
        started = stack.enter_context(infra.workers())
        worker = infra.Worker(scratch, f"retention-{kind}", pool="pulse", concurrency=2,
                              broker=broker, queue=queue, store=store, conf=CONF)
        started.append(worker)
        ready = worker.wait_ready(timeout=60)
        sampler.start()
        stack.callback(sampler.done.set)
        infra.wait_for(lambda: stop_file.exists() or worker.check_alive(), 600, "the run to end",
                       0.05)
        ended = time.time()
        worst = sampler.worst
        during = int(stats_of(broker, queue, store, kind)["recover"]["purged"])
        # Every task is done: one more interval (and a pass's budget) and nothing may be left.
        infra.wait_for(lambda: sampler.past() == 0 or None, RETENTION + 2 * INTERVAL + 5,
                       "the last finished claims to be purged")
        time.sleep(INTERVAL + 1.0)  # measuring: no claim may reappear past the bound
        final = sampler.past()
        pulse = stats_of(broker, queue, store, kind)
        left = open_store(store)
        try:
            remaining = left.claim_counts()
        finally:
            left.close()
    purged = int(pulse["recover"]["purged"])
    run_s = ended - ready
    result = {"store": kind, "tasks": n, "run_s": run_s, "task_rate": n / run_s,
              "purged": purged, "purged_during": during, "purge_rate": during / run_s,
              "purge_rate_stat": pulse["retention"]["purged_per_second"],
              "lag_stat": pulse["retention"]["lag"], "worst_past_bound": worst,
              "final_past_bound": final, "claims_left": sum(remaining.get(s, 0)
                                                            for s in FINISHED_STATES)}
    infra.log(f"  {kind}: {n} tasks in {run_s:.1f}s ({result['task_rate']:.0f}/s), purged "
              f"{during} meanwhile ({result['purge_rate']:.0f}/s), {purged} in all, worst past "
              f"bound {worst}, at the end {final}")
    return result


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    database_url = infra.ensure_bench_database()
    # Quick (the test suite's run, under its time guard): PostgreSQL only, 1,000 tasks.
    n, stores = (1_000, STORES[:1]) if quick else (8_000, STORES)
    return {"conf": CONF, "cases": [one_store(scratch, kind, database_url, n)
                                    for kind in stores]}


def summary_rows(data: dict[str, Any]) -> list[list[str]]:
    """The summary table's rows (What, pulse, Baseline, Ratio / detail, Target, Verdict)."""
    return [[f"Retention, {c['tasks']:,} no-op at {c['task_rate']:,.0f} tasks/s, "
             f"{STORE_NAMES[c['store']]}: finished claims past retention + interval at the end",
             f"{c['final_past_bound']:,}", "—", f"purged {c['purge_rate']:,.0f}/s meanwhile",
             "0", "met" if c["final_past_bound"] == 0 else "**missed**"]
            for c in data["cases"]]


def markdown(data: dict[str, Any], lines: list[str]) -> None:
    """The section of docs/benchmarks.md."""
    rows = [[STORE_NAMES[c["store"]], f"{c['tasks']:,}", f"{c['task_rate']:,.0f}/s",
             f"{c['purge_rate']:,.0f}/s", f"{c['purge_rate_stat']:,.0f}/s", f"{c['purged']:,}",
             f"{c['worst_past_bound']:,}",
             f"{c['final_past_bound']:,}", "met" if c["final_past_bound"] == 0 else "**missed**"]
            for c in data["cases"]]
    header = ["Store", "No-op tasks", "Task rate", "Purge rate (while the tasks ran)",
              "Purge rate (stat, last minute)", "Purged in all",
              "Most past retention + interval (during)", "Past retention + interval (end)",
              "Target: 0 at the end"]
    lines += [f"One `-P pulse -c 2` worker (beat on: the leader purges), RabbitMQ, settings "
              f"{data['conf']}. Purge rate while the tasks ran: finished claims the worker "
              f"purged (`pulse.recover.purged`, read with `celery inspect stats` right after "
              f"the last task, a call that takes a few seconds) over the run's length (the "
              f"last {RETENTION:g} s of tasks are still inside retention then); the stat "
              f"is `pulse.retention.purged_per_second` read after the tail was purged. The "
              f"old purge's ceiling was 500 a minute (8.3/s). \"Past retention + "
              f"interval\" counts finished claims older than {RETENTION + INTERVAL:g} s by the "
              f"store clock (sampled every 0.5 s while the tasks ran, then once more an "
              f"interval after the last one).", "",
              "| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
              *("| " + " | ".join(r) + " |" for r in rows), ""]
