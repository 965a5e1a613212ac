"""The procrastinate app of the peer benchmark (a PostgreSQL job queue, measured fairly).

Configured from the environment: ``BENCH_PROC_DSN`` (a libpq connection string whose
``options`` select the run's own schema). Tasks are plain sync functions, as the
Celery ones; ``bench.begin`` and ``bench.stop`` write their wall-clock time.
"""

from __future__ import annotations

import os
import time

import procrastinate

from benchmarks.apps import journal

app = procrastinate.App(connector=procrastinate.PsycopgConnector(
    conninfo=os.environ.get("BENCH_PROC_DSN", "")))


@app.task(name="bench.begin")
def begin(path: str) -> None:
    journal(path, "begin")


@app.task(name="bench.noop")
def noop() -> None:
    return None


@app.task(name="bench.sleep")
def sleep(ms: float) -> None:
    time.sleep(ms / 1000.0)


@app.task(name="bench.stop")
def stop(path: str) -> None:
    journal(path, "stop")
