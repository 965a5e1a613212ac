"""A limited task's wake-up across workers, with and without LISTEN (issue 36).

Two ``-P pulse -c 1`` workers, each on a queue of its own, one task kind limited to 1
at once (``pulse_concurrency_limits``). Each round publishes a body (400 ms, then 2 s) to
worker A's queue and, 150 ms later, one to worker B's: one of them waits for the permit in its
worker while the other runs. Nothing in the waiting worker ends to wake it: only the
other worker's signal (PostgreSQL's NOTIFY, heard on a LISTEN connection) or its own
retry (from 50 ms, doubling up to 1 s) does. The wake-up delay is the second body's
start minus the first body's end (one clock: both workers on this host). Variants:

* ``direct``: PostgreSQL directly (LISTEN on a pool connection);
* ``pgbouncer``: through PgBouncer in transaction mode, no listener URL: waiters poll;
* ``pgbouncer+listen``: the same, with ``pulse_store_listen_url`` naming the server
  directly (the LISTEN connection bypasses the pooler).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from benchmarks import infra
from tests.helpers.pgbouncer import PgBouncer, pgb_database

TASK = "bench.span_sleep"
#: Body lengths: the waiter's retry backoff (50 ms doubling to 1 s) is short at first, at
#: its 1 s ceiling once it has waited a couple of seconds.
BODIES_MS = (400, 2000)
#: The second publication follows the first by this long (the first is running by then).
LAG_S = 0.15
VARIANTS = ("direct", "pgbouncer", "pgbouncer+listen")


def _spans(path: Any) -> list[tuple[float, float]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [(float(a), float(b)) for a, b in (line.split() for line in text.splitlines())]


def run_variant(scratch: infra.Scratch, variant: str, direct_url: str, pooled_url: str,
                rounds: int, body_ms: int) -> dict[str, Any]:
    """``rounds`` hand-overs between two workers; the delays in ms."""
    broker = infra.BROKERS["rabbitmq"]
    store = direct_url if variant == "direct" else pooled_url
    conf: dict[str, Any] = {"pulse_concurrency_limits": {TASK: 1}}
    if variant == "pgbouncer+listen":
        conf["pulse_store_listen_url"] = direct_url
    queues = [f"bench-wake-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    delays: list[float] = []
    with contextlib.ExitStack() as stack:
        for queue in queues:
            infra.declare_queue(broker, queue)
            stack.callback(infra.delete_queue, broker, queue)
        started = stack.enter_context(infra.workers())
        ws = [infra.Worker(scratch, f"wake-{variant}-{i}".replace("+", "-"), pool="pulse",
                           concurrency=1, broker=broker, queue=q, store=store, conf=conf,
                           loglevel="info")
              for i, q in enumerate(queues)]
        started.extend(ws)
        for w in ws:
            w.wait_ready(timeout=60)
        for _ in range(rounds):
            path = scratch.path("wake")
            infra.publish(broker, queues[0], [(TASK, [str(path), body_ms])])
            time.sleep(LAG_S)
            infra.publish(broker, queues[1], [(TASK, [str(path), body_ms])])
            infra.wait_for(lambda p=path: any(w.check_alive() for w in ws) or len(_spans(p)) == 2,
                           30, f"a hand-over ({variant})")
            first, second = sorted(_spans(path))
            delays.append(1000 * (second[0] - first[1]))
        logs = "".join(w.log() for w in ws)
    return {"variant": variant, "body_ms": body_ms, "rounds": rounds, "delays_ms": delays,
            "median_ms": statistics.median(delays),
            "p95_ms": (min(statistics.quantiles(delays, n=20)[-1], max(delays))
                       if len(delays) >= 2 else delays[0]),
            "max_ms": max(delays),
            "mode_logged": "store pooler mode transaction" in logs if variant != "direct"
            else "store pooler mode none" in logs}


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    rounds = 3 if quick else 20
    bouncer = PgBouncer("transaction").start()
    try:
        with pgb_database(bouncer) as pooled_url:
            database = sa.make_url(pooled_url).database
            direct_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"
            infra.migrate(direct_url)
            cases = []
            for body_ms in BODIES_MS[:1] if quick else BODIES_MS:
                for variant in VARIANTS:
                    infra.log(f"wake-up {variant}, {body_ms} ms bodies: {rounds} hand-overs")
                    case = run_variant(scratch, variant, direct_url, pooled_url, rounds, body_ms)
                    infra.log(f"  median {case['median_ms']:.0f} ms, p95 "
                              f"{case['p95_ms']:.0f} ms, max {case['max_ms']:.0f} ms")
                    cases.append(case)
    finally:
        bouncer.stop()
    return {"cases": cases, "lag_s": LAG_S}


def markdown(data: dict[str, Any], lines: list[str]) -> None:
    """The section of docs/benchmarks.md."""
    header = ["Store connection", "Body", "Hand-overs", "Wake-up median", "p95", "max"]
    rows = [[c["variant"], f"{c['body_ms']} ms", str(c["rounds"]), f"{c['median_ms']:.0f} ms",
             f"{c['p95_ms']:.0f} ms", f"{c['max_ms']:.0f} ms"] for c in data["cases"]]
    lines += [f"Two `-P pulse -c 1` workers on queues of their own, one task kind limited to 1. "
              f"Each round: a body to worker A, another to worker B "
              f"{data['lag_s'] * 1000:.0f} ms later; the one that finds the permit taken "
              f"waits in its worker. Wake-up = its body's start minus the other body's end. "
              f"`pgbouncer`: PgBouncer in transaction mode, no LISTEN (the waiter retries "
              f"from 50 ms, doubling up to 1 s); `pgbouncer+listen`: the same with "
              f"`pulse_store_listen_url` naming the server directly.", "",
              "| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
              *("| " + " | ".join(r) + " |" for r in rows), ""]
