"""Tasks for the broker connection loss and soft shutdown tests
(tests/acceptance/test_connection_loss.py), on the acceptance tests' app.

Each writes ``start <epoch>`` when it starts and ``end <epoch>`` when it finishes into its
own file, so the test counts how often it ran and under which attempt.
"""

from __future__ import annotations

from celery_pulse import current_lease
from tests.apps.pulseapp import app, mark, until_told

__all__ = ["app"]


def _epoch() -> int:
    lease = current_lease()
    return lease.epoch if lease else 0


@app.task(name="connlossapp.late_until_told", acks_late=True)
def late_until_told(path: str) -> int:
    """An ``acks_late`` task that runs until ``<path>.go`` exists (at most 60 s)."""
    epoch = _epoch()
    mark(path, "start", epoch)
    until_told(path)
    mark(path, "end", epoch)
    return epoch


@app.task(name="connlossapp.record")
def record(path: str) -> int:
    """Runs at once (sent with a countdown: an ETA task the worker keeps reserved)."""
    epoch = _epoch()
    mark(path, "start", epoch)
    mark(path, "end", epoch)
    return epoch
