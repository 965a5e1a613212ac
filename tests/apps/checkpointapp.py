"""The Celery app of the checkpoint acceptance tests (tests/acceptance/test_checkpoints.py).

Configured from the environment like :mod:`tests.apps.recoverapp`. ``walk`` processes
items ``start..total-1`` in order, ``start`` being the cursor of the task's last
checkpoint (``current_lease().last_checkpoint``), and records a checkpoint every
``every`` items. Each step is one journal line, written with one ``write``::

    begin <task_id> <epoch> <start> <epoch of the checkpoint read, 0: none> <time>
    item <task_id> <epoch> <index> <time>
    checkpoint <task_id> <epoch> <cursor> <time>     (``checkpoint()`` returned)
    lost <task_id> <epoch> <index> <time>            (LeaseLost: at a checkpoint, or
                                                     raised into the body by the worker)
    end <task_id> <epoch> <total> <time>
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

import celery_pulse
from celery_pulse import LeaseLost, current_lease

app = Celery("checkpointapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=os.environ.get("PULSE_TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    worker_prefetch_multiplier=1,
)
app.conf.update(json.loads(os.environ.get("PULSE_TEST_CONF", "{}")))
celery_pulse.install(app)


def journal(path: str, *fields: Any) -> None:
    line = " ".join(str(f) for f in (*fields, f"{time.time():.6f}")) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@app.task(name="checkpointapp.walk", bind=True, acks_late=True)
def walk(self: Any, path: str, total: int = 1000, every: int = 50, pause: float = 0.01,
         wait: bool = False) -> int:
    lease = current_lease()
    assert lease is not None
    task_id, epoch = self.request.id, lease.epoch
    last = lease.last_checkpoint
    start = int(last.value["next"]) if last is not None else 0
    journal(path, "begin", task_id, epoch, start, last.epoch if last is not None else 0)
    index = start
    try:
        for index in range(start, total):
            journal(path, "item", task_id, epoch, index)
            time.sleep(pause)
            if (index + 1) % every == 0:
                lease.checkpoint({"next": index + 1, "epoch": epoch}, wait=wait)
                journal(path, "checkpoint", task_id, epoch, index + 1)
    except LeaseLost:
        journal(path, "lost", task_id, epoch, index)
        raise
    journal(path, "end", task_id, epoch, total)
    return total


@app.task(name="checkpointapp.retrying", bind=True, acks_late=True, max_retries=1)
def retrying(self: Any, path: str, cursor: int) -> int:
    """Checkpoints ``cursor``, then retries once (``self.retry``, no countdown): the retry
    is a later attempt of the task, and resumes from the checkpoint."""
    lease = current_lease()
    assert lease is not None
    last = lease.last_checkpoint
    journal(path, "begin", self.request.id, lease.epoch,
            last.value["next"] if last is not None else 0, last.epoch if last is not None else 0)
    if last is None:
        lease.checkpoint({"next": cursor, "epoch": lease.epoch})  # carried as the body ends
        raise self.retry(countdown=0)
    journal(path, "end", self.request.id, lease.epoch, last.value["next"])
    return int(last.value["next"])
