"""Cluster-wide rate limits (issue 39): what a rate costs, and how close to it a binding
one runs.

One ``-P pulse -c 2`` worker (RabbitMQ, a fresh PostgreSQL store per run) works through
N pre-published tasks of one kind, as the permits section does, in four variants run
one after another in each repeat:

* ``unlimited``: no limit (the baseline);
* ``rate-never-binds``: ``pulse_rate_limits`` of 100,000 a second, which never binds:
  the pure cost of deciding and recording each start in the store;
* ``rate-hour-never-binds``: 10,000,000 an hour, which never binds either, over a window
  that holds every start of the run (a rate decided by counting its window would read
  them all at each start; decided on the key's bound, it costs what a short window does);
* ``rate-binds``: 200 a second (no-op) or 50 a second (10 ms), below what the worker
  does unlimited: the achieved rate against the limit, and each start's delay past the
  moment the window let it start (start ``k`` may come one window after start
  ``k - N``: the delay is how much later it came; the bodies' own start times, median
  and 99th percentile).

Rate = N / (last body's end - ``worker_ready``); ratio = median of per-repeat ratios to
``unlimited``.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

from benchmarks import infra, permits
from benchmarks.permits import Workload

#: Variant -> (count, per) of the rate, per workload key prefix (None: unlimited).
NEVER = "100000/s"
NEVER_HOUR = "10000000/h"
BINDS = {"noop": (200, "s"), "sleep": (50, "s")}
VARIANTS = ("unlimited", "rate-never-binds", "rate-hour-never-binds", "rate-binds")


def _conf(variant: str, workload: Workload) -> dict[str, Any] | None:
    if variant == "unlimited":
        return None
    if variant == "rate-never-binds":
        return {"pulse_rate_limits": {workload.task: NEVER}}
    if variant == "rate-hour-never-binds":
        return {"pulse_rate_limits": {workload.task: NEVER_HOUR}}
    count, per = BINDS[workload.key.split("-")[0]]
    return {"pulse_rate_limits": {workload.task: f"{count}/{per}"}}


def delays_ms(starts: list[float], count: int, window: float) -> tuple[float, float] | None:
    """Median and 99th percentile of how long after the window allowed it each start
    came (start ``k`` is allowed one window after start ``k - count``)."""
    ordered = sorted(starts)
    late = [1000 * (ordered[k] - (ordered[k - count] + window))
            for k in range(count, len(ordered))]
    if len(late) < 2:
        return None
    return statistics.median(late), statistics.quantiles(late, n=100)[-1]


def run(scratch: infra.Scratch, quick: bool) -> dict[str, Any]:
    database_url = infra.ensure_bench_database()
    repeats = 1 if quick else 2
    runs: list[dict[str, Any]] = []
    for workload in permits.workloads(quick):
        for rep in range(repeats):
            for variant in VARIANTS:
                infra.log(f"rates {workload.key} {variant} (#{rep + 1}/{repeats})")
                result, disturbed = infra.retrying(
                    functools.partial(permits.run_one, scratch, database_url, variant,
                                      workload, _conf(variant, workload) or {}),
                    f"rates {workload.key} {variant}")
                starts = result.pop("starts")
                if variant == "rate-binds":
                    count, _ = BINDS[workload.key.split("-")[0]]
                    result["limit_per_s"] = count
                    result["delay_ms"] = delays_ms(starts, count, 1.0)
                result.update(repeat=rep, disturbed_attempts=disturbed)
                infra.log(f"  {result['rate']:.0f} tasks/s in {result['elapsed_s']:.2f}s"
                          + (f"; start delay past the window p50/p99 "
                             f"{result['delay_ms'][0]:.1f}/{result['delay_ms'][1]:.1f} ms"
                             if result.get("delay_ms") else ""))
                runs.append(result)
    return {"runs": runs, "summary": summarise(runs), "repeats": repeats,
            "concurrency": permits.CONCURRENCY, "never": NEVER, "never_hour": NEVER_HOUR,
            "binds": BINDS,
            "workloads": {w.key: w.label for w in permits.workloads(quick)}}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload]
        base = {r["repeat"]: r["rate"] for r in mine if r["variant"] == "unlimited"}
        for variant in VARIANTS:
            rows = [r for r in mine if r["variant"] == variant]
            delays = [r["delay_ms"] for r in rows if r.get("delay_ms")]
            out.append({
                "workload": workload, "variant": variant, "n": rows[0]["n"],
                "rate": statistics.median(r["rate"] for r in rows),
                "ratio": statistics.median(r["rate"] / base[r["repeat"]] for r in rows),
                "limit_per_s": rows[0].get("limit_per_s"),
                "delay_ms": ([statistics.median(d[0] for d in delays),
                              max(d[1] for d in delays)] if delays else None),
                "cpu_ms_per_task": {k: statistics.median(r["cpu_ms_per_task"][k] for r in rows)
                                    for k in ("parent", "children", "store")}})
    return out
