"""The ops app plus a task the Pulse page tests stop and release from outside."""

from __future__ import annotations

import os
import time

from celery import Task

from celery_pulse import current_lease
from tests.apps.opsapp import app

__all__ = ["app"]


@app.task(name="pageapp.gated", bind=True)
def gated(self: Task, gate: str, journal: str) -> str:
    """Journals its start (worker, epoch), then runs until the file ``gate`` exists."""
    lease = current_lease()
    assert lease is not None
    with open(journal, "a") as fh:
        fh.write(f"start {self.request.hostname} {lease.epoch}\n")
    while not os.path.exists(gate):
        time.sleep(0.05)
        lease.check()
    with open(journal, "a") as fh:
        fh.write(f"end {self.request.hostname} {lease.epoch}\n")
    return "released"


@app.task(name="pageapp.late", bind=True, acks_late=True)
def late(self: Task, seconds: float, journal: str) -> str:
    """acks_late (a lost attempt is re-dispatched): journals its start and end (worker,
    epoch) and runs ``seconds``, checking its lease (a stale attempt ends in LeaseLost)."""
    lease = current_lease()
    assert lease is not None
    with open(journal, "a") as fh:
        fh.write(f"start {self.request.hostname} {lease.epoch}\n")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
        lease.check()
    with open(journal, "a") as fh:
        fh.write(f"end {self.request.hostname} {lease.epoch}\n")
    return "charged"
