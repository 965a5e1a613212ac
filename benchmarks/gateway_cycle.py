"""Section 10's slot cycle: how long each task holds one of its worker's slots, and where.

A worker holds at most its capacity of tasks at once (its prefetch waiting, besides one
running in each process), each from its reservation until its finish is applied. So its
throughput is at most capacity / (the time a slot is held), whatever the CPU: Little's
law. This reads that
time from the store's own record of each claim of a run (``reserved_at``,
``started_at``, ``finished_at``, by the store's clock), over the middle half of the run's
claims (the steady state): the reservation to the start (for a remote worker: the
gateway's reservation, the attempt's record, the assignment, the worker's start ahead
and its round at the gateway), the start to the finish (waiting for a pool process,
the body, the finish's way to the store), and the whole.
"""

from __future__ import annotations

import statistics
from typing import Any

import sqlalchemy as sa

PARTS = (("reserve_start_ms", "reservation → start"), ("start_finish_ms", "start → finish"),
         ("held_ms", "reservation → finish (a slot held)"))


def measure(store: str, queue: str) -> dict[str, float]:
    """Medians (ms) of the parts of the slot cycle of ``queue``'s claims."""
    from celery_pulse.store.sql import open_store

    opened = open_store(store)
    try:
        with opened.engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT reserved_at, started_at, finished_at FROM pulse_claims "
                "WHERE queue = :queue AND started_at IS NOT NULL AND finished_at IS NOT NULL "
                "AND reserved_at IS NOT NULL ORDER BY reserved_at"), {"queue": queue}).all()
    finally:
        opened.close()
    steady = rows[len(rows) // 4: 3 * len(rows) // 4] or rows
    if not steady:
        return {}
    return {"reserve_start_ms": 1000 * statistics.median(s - r for r, s, _ in steady),
            "start_finish_ms": 1000 * statistics.median(f - s for _, s, f in steady),
            "held_ms": 1000 * statistics.median(f - r for r, _, f in steady),
            "claims": len(steady)}


def markdown(summary: list[dict[str, Any]], lines: list[str], concurrency: int) -> None:
    """The cycle of the direct worker and of one remote worker, per workload: each holds
    Celery's prefetch (multiplier 4 x ``concurrency``) waiting, besides one task running
    in each process."""
    rows = [row for row in summary if row.get("cycle")]
    if not rows:  # reports from before it was measured
        return
    capacity = (4 + 1) * concurrency
    lines += ["", "Where a slot's time goes (medians over the middle half of each run's "
              f"tasks, by the store's clock). Each worker holds at most {capacity} tasks: "
              "Celery's prefetch (multiplier 4 x `-c`) waiting, besides one running in each "
              "process. So it runs at most that many over the time a slot is held:", "",
              "| Workload | worker | " + " | ".join(label for _, label in PARTS)
              + " | capacity / held |", "| --- | --- | " + "--- | " * len(PARTS) + "--- |"]
    for row in rows:
        for variant, label in (("direct", "direct"), ("gateway", "remote")):
            cycle = row["cycle"].get(variant) or {}
            if not cycle:
                continue
            cells = " | ".join(f"{cycle[key]:.1f} ms" for key, _ in PARTS)
            bound = capacity / (cycle["held_ms"] / 1000) if cycle["held_ms"] > 0 else 0.0
            lines.append(f"| {row['label']} | {label} | {cells} | {bound:,.0f}/s |")
