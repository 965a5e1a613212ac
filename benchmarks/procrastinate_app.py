"""The procrastinate app of the peer benchmark (a PostgreSQL job queue, measured fairly).

Configured from the environment: ``BENCH_PROC_DSN`` (a libpq connection string whose
``options`` select the run's own schema). The tasks are the Celery app's own functions,
run sync; ``bench.begin`` and ``bench.stop`` write their wall-clock time.
"""

from __future__ import annotations

import os

import procrastinate

from benchmarks import apps
from benchmarks.apps import journal

app = procrastinate.App(connector=procrastinate.PsycopgConnector(
    conninfo=os.environ.get("BENCH_PROC_DSN", "")))

# The very task bodies the Celery workers run (a Celery task's ``run`` is its function).
app.task(name="bench.noop")(apps.noop.run)
app.task(name="bench.sleep")(apps.sleep.run)
app.task(name="bench.stop")(apps.stop.run)


@app.task(name="bench.begin")
def begin(path: str) -> None:
    journal(path, "begin")
