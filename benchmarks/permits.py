"""Concurrency permits (issue 19): the throughput cost of a limited task kind.

One ``-P pulse -c 2`` worker (RabbitMQ, a fresh PostgreSQL store per run) works through
N pre-published tasks of one kind, as in the throughput section, in four variants run
one after another in each repeat:

* ``unlimited``: no limit declared anywhere (the baseline);
* ``limit-1000``: the same task limited to 1,000 at once, a limit that never binds:
  the pure cost of taking and giving back a permit;
* ``limit-2``: limited to the worker's concurrency (binds as often as the pool is full);
* ``limit-1``: one at a time across the cluster (timed tasks: about half the rate).

The limit is declared by ``pulse_concurrency_limits`` (the setting is the task option
``pulse_concurrency`` by another name), so every variant runs the very same task. Each
body writes when it began and ended (one ``write`` on a descriptor it keeps open), which
gives the end of the measurement and how many bodies ran at once. A ``stop`` task
published last would not do here: unlimited, it may start while limited tasks still
wait in the worker. Rate = N / (last body's end - ``worker_ready``); ratio = median of
per-repeat ratios to ``unlimited``. After the last body, the runner waits for every claim
to be final, then reads from the store the permits still held and the claims still
waiting for one (both must be 0) and the hold rows left (past attempts, which hold
nothing, kept until their key's next start or retention). For ``limit-1`` it also
gives the hand-over: the time from one body's end to the next body's start (median and
95th percentile).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks import infra, throughput
from celery_pulse.store.sql import open_store

CONCURRENCY = throughput.CONCURRENCY
X = "\u00d7"  # multiplication sign
#: Variant -> the limit declared for the task kind (None: none at all).
VARIANTS: dict[str, int | None] = {"unlimited": None, "limit-1000": 1000,
                                   f"limit-{CONCURRENCY}": CONCURRENCY, "limit-1": 1}
BASELINE = "unlimited"
#: A run whose journal gains no line for this long is stuck (reported, not waited out).
STALL = throughput.STALL
#: How long the runner waits, after the last body ended, for every claim to be final.
SETTLE = 30.0


#: The throughput section's workload (same fields: key, label, task, args, n).
Workload = throughput.Workload


def workloads(quick: bool) -> list[Workload]:
    """No-op and 10 ms bodies: the sizes of the throughput section's main workloads (quick
    runs: fewer, the limited rows run at a fraction of the unlimited rate)."""
    if quick:
        return [Workload("noop-300", "300 no-op", "bench.span_noop", (), 300),
                Workload("sleep-100", f"100 {X} 10 ms", "bench.span_sleep", (10,), 100)]
    return [Workload("noop-2000", "2,000 no-op", "bench.span_noop", (), 2000),
            Workload("sleep-1000", f"1,000 {X} 10 ms", "bench.span_sleep", (10,), 1000)]


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most bodies running at the same time (an end before a start at equal times)."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def handover_ms(spans: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Median and 95th percentile of the ms from one body's end to the next body's start,
    bodies ordered by start (meaningful when they run one at a time: the permit's trip
    from one task to the next)."""
    ordered = sorted(spans)
    gaps = [1000 * (b[0] - a[1]) for a, b in itertools.pairwise(ordered)]
    if len(gaps) < 2:
        return None
    return statistics.median(gaps), statistics.quantiles(gaps, n=20)[-1]


class Journal:
    """Reads the spans the bodies append, new bytes only (cheap to poll)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.tail = b""
        self.spans: list[tuple[float, float]] = []

    def poll(self) -> int:
        """Read what was appended since the last call; the number of spans so far."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return 0
        self.offset += len(chunk)
        *lines, self.tail = (self.tail + chunk).split(b"\n")
        for line in lines:
            start, end = line.split()
            self.spans.append((float(start), float(end)))
        return len(self.spans)


def store_state(url: str) -> dict[str, int]:
    """Claims still live, permits held, claims waiting for one, and hold rows (any)."""
    store = open_store(url)
    try:
        counts = store.claim_counts()
        usage = store.permit_usage()
        with store.engine.connect() as conn:
            rows = int(conn.execute(sa.text("SELECT count(*) FROM pulse_permit_holds")).scalar_one())
    finally:
        store.close()
    return {"live": counts.get("reserved", 0) + counts.get("running", 0),
            "succeeded": counts.get("succeeded", 0),
            "held": sum(u.running for u in usage), "waiting": sum(u.waiting for u in usage),
            "hold_rows": rows}


def run_one(scratch: infra.Scratch, database_url: str, variant: str, workload: Workload,
            conf: dict[str, Any] | None = None) -> dict[str, Any]:
    """One measured run of ``workload`` under ``variant``'s limit (or, given ``conf``,
    under that configuration: benchmarks/rates.py); returns its figures."""
    broker_url = infra.BROKERS["rabbitmq"]
    queue = f"bench-pm-{uuid.uuid4().hex[:10]}"
    path = scratch.path("spans")
    limit = VARIANTS.get(variant)
    if conf is None and limit is not None:
        conf = {"pulse_concurrency_limits": {workload.task: limit}}
    meter = throughput.PgBackends(database_url)
    with contextlib.ExitStack() as stack:
        stack.callback(meter.close)
        store = stack.enter_context(infra.fresh_store("postgres", scratch, database_url))
        infra.declare_queue(broker_url, queue)
        stack.callback(infra.delete_queue, broker_url, queue)
        infra.publish(broker_url, queue, [(workload.task, [str(path), *workload.args])]
                      * workload.n)
        started = stack.enter_context(infra.workers())
        worker = infra.Worker(scratch, f"pm-{variant}", pool="pulse", concurrency=CONCURRENCY,
                              broker=broker_url, queue=queue, store=store, conf=conf)
        started.append(worker)
        ready = worker.wait_ready(timeout=60)
        parent0, children0 = throughput._cpu_split(worker)
        store0 = meter.cpu()
        journal = Journal(path)
        seen, changed = 0, time.monotonic()

        def done() -> bool:
            nonlocal seen, changed
            worker.check_alive()
            count = journal.poll()
            if count >= workload.n:
                return True
            if count != seen:
                seen, changed = count, time.monotonic()
            elif time.monotonic() - changed > STALL:
                worker.check_undisturbed()
                raise RuntimeError(f"{variant} ran no task for {STALL:g}s after {count} of "
                                   f"{workload.n}:\n{worker.log()[-3000:]}")
            return False
        infra.wait_for(done, max(120.0, workload.n / 10), f"{workload.key} on {variant}", 0.02)
        worker.check_undisturbed()
        parent1, children1 = throughput._cpu_split(worker)
        store1 = meter.cpu()
        spans = journal.spans
        elapsed = max(end for _, end in spans) - ready
        seen_all = time.monotonic()
        state: dict[str, int] = store_state(store)

        def settled() -> bool:
            nonlocal state
            worker.check_alive()
            state = store_state(store)
            return state["live"] == 0
        with contextlib.suppress(TimeoutError):  # reported (live > 0), not raised
            infra.wait_for(settled, SETTLE, "every claim to be final", 0.2)
        settle = time.monotonic() - seen_all
        worker.kill()
    n = workload.n
    return {
        "variant": variant, "limit": limit, "workload": workload.key, "n": n,
        "elapsed_s": elapsed, "rate": n / elapsed, "startup_s": ready - worker.started,
        "most_at_once": most_at_once(spans), "spans": len(spans),
        "handover_ms": handover_ms(spans) if limit == 1 else None,
        "starts": sorted(start for start, _ in spans),
        "cpu_ms_per_task": {
            "parent": 1000 * infra.cpu_delta(parent0, parent1) / n,
            "children": 1000 * infra.cpu_delta(children0, children1) / n,
            "store": 1000 * infra.cpu_delta(store0, store1) / n},
        "live_left": state["live"], "held_left": state["held"],
        "waiting_left": state["waiting"], "hold_rows_left": state["hold_rows"],
        "succeeded": state["succeeded"], "settle_s": settle,
    }


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    database_url = infra.ensure_bench_database()
    repeats = 1 if quick else 3
    runs: list[dict[str, Any]] = []
    for workload in workloads(quick):
        for rep in range(repeats):
            for variant in VARIANTS:
                infra.log(f"permits {workload.key} {variant} (#{rep + 1}/{repeats})")
                result, disturbed = infra.retrying(
                    functools.partial(run_one, scratch, database_url, variant, workload),
                    f"permits {workload.key} {variant}")
                result["repeat"] = rep
                result["disturbed_attempts"] = disturbed
                del result["starts"]  # benchmarks/rates.py's (the bodies' start times)
                infra.log(f"  {result['rate']:.0f} tasks/s in {result['elapsed_s']:.2f}s, "
                          f"at most {result['most_at_once']} at once, "
                          f"{result['held_left']} held / {result['waiting_left']} waiting / "
                          f"{result['live_left']} live left (started in "
                          f"{result['startup_s']:.1f}s, settled in {result['settle_s']:.1f}s)")
                runs.append(result)
    return {"runs": runs, "summary": summarise(runs), "concurrency": CONCURRENCY,
            "repeats": repeats, "limits": VARIANTS,
            "disturbed_attempts": sum(r["disturbed_attempts"] for r in runs),
            "workloads": {w.key: w.label for w in workloads(quick)}}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, variant): median rate, median per-repeat ratio to ``unlimited``, the
    most bodies at once over every repeat, and the worst leftovers in the store."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload]
        base = {r["repeat"]: r["rate"] for r in mine if r["variant"] == BASELINE}
        for variant in VARIANTS:
            rows = [r for r in mine if r["variant"] == variant]
            if not rows:
                continue
            ratios = [r["rate"] / base[r["repeat"]] for r in rows if r["repeat"] in base]
            out.append({
                "workload": workload, "variant": variant, "limit": VARIANTS[variant],
                "n": rows[0]["n"], "repeats": len(rows),
                "rate": statistics.median(r["rate"] for r in rows),
                "rates": [r["rate"] for r in rows],
                "ratio": statistics.median(ratios) if ratios else None,
                "most_at_once": max(r["most_at_once"] for r in rows),
                "handover_ms": (
                    [statistics.median(r["handover_ms"][i] for r in rows) for i in (0, 1)]
                    if all(r["handover_ms"] is not None for r in rows) else None),
                "cpu_ms_per_task": {k: statistics.median(r["cpu_ms_per_task"][k] for r in rows)
                                    for k in ("parent", "children", "store")},
                **{k: max(r[k] for r in rows)
                   for k in ("live_left", "held_left", "waiting_left", "hold_rows_left")},
            })
    return out
