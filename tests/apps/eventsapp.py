"""The Celery app of the event acceptance tests (tests/acceptance/test_events.py).

Configured from the environment exactly like :mod:`tests.apps.recoverapp`:
``PULSE_TEST_BROKER``, ``PULSE_TEST_STORE``, ``PULSE_TEST_QUEUE`` and ``PULSE_TEST_CONF``.

Every body appends ``<event> <task_id> <epoch> <worker hostname> <unix time>`` to a
journal file (``start``, then ``end`` if it returned). ``late`` and ``plain`` wait until
the file ``<gate>.<epoch>`` exists (at most ``seconds``): the test holds one attempt and
lets another, under a later epoch, finish at once. ``limited`` waits for ``<gate>``
alone (the tests limit it to one at a time with ``pulse_concurrency_limits``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

import celery_pulse
from celery_pulse import current_lease

app = Celery("eventsapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
queue = os.environ.get("PULSE_TEST_QUEUE", "celery")
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=queue,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
app.conf.update(json.loads(os.environ.get("PULSE_TEST_CONF", "{}")))
celery_pulse.install(app)


def _epoch() -> int:
    lease = current_lease()
    return lease.epoch if lease is not None else 0


def journal(path: str, event: str, task: Any) -> None:
    """Append one line with a single ``write`` (O_APPEND: lines never interleave)."""
    line = f"{event} {task.request.id} {_epoch()} {task.request.hostname} {time.time():.6f}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _run(task: Any, path: str, seconds: float, gate: str) -> str:
    journal(path, "start", task)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not os.path.exists(gate):
        time.sleep(0.02)
    journal(path, "end", task)
    return "done"


@app.task(name="eventsapp.late", bind=True, acks_late=True)
def late(self: Any, path: str, seconds: float, gate: str) -> str:
    """acks_late: a started-then-lost attempt is re-dispatched."""
    return _run(self, path, seconds, f"{gate}.{_epoch()}")


@app.task(name="eventsapp.plain", bind=True, acks_late=False)
def plain(self: Any, path: str, seconds: float, gate: str) -> str:
    """Default acks: a started-then-lost attempt needs review."""
    return _run(self, path, seconds, f"{gate}.{_epoch()}")


@app.task(name="eventsapp.limited", bind=True)
def limited(self: Any, path: str, seconds: float, gate: str) -> str:
    """Limited by the test's ``pulse_concurrency_limits``."""
    return _run(self, path, seconds, gate)


@app.task(name="eventsapp.once", bind=True, acks_late=True, pulse_max_attempts=1)
def once(self: Any, path: str, seconds: float, gate: str) -> str:
    """acks_late with a budget of one attempt: a lost attempt leaves none to re-dispatch."""
    return _run(self, path, seconds, f"{gate}.{_epoch()}")
