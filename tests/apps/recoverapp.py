"""The Celery app of the Recover acceptance tests (tests/acceptance/test_recover.py).

Configured from the environment exactly like :mod:`tests.apps.pulseapp`:
``PULSE_TEST_BROKER``, ``PULSE_TEST_STORE``, ``PULSE_TEST_QUEUE`` and
``PULSE_TEST_CONF`` (a JSON object of extra Celery settings).

Every task appends one line per event to a journal file the test reads::

    <event> <task_id> <epoch> <worker hostname> <pid> <unix time>

``event`` is ``start`` (the body began) or ``end`` (it returned). The epoch is the
lease's (``current_lease()``), so the test sees which grant ran the body.

``late`` and ``plain`` wait ``seconds`` between the two lines, or less: they stop
waiting as soon as the file ``gate`` exists, so the test can hold a first attempt
(to kill its worker mid-task) and let a re-run finish at once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from celery import Celery

import celery_pulse
from celery_pulse import current_lease

app = Celery("recoverapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
queue = os.environ.get("PULSE_TEST_QUEUE", "celery")
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=queue,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
app.conf.update(json.loads(os.environ.get("PULSE_TEST_CONF", "{}")))
celery_pulse.install(app)


def journal(path: str, event: str, task: Any) -> None:
    """Append one event line with a single ``write`` (O_APPEND: lines never interleave)."""
    lease = current_lease()
    epoch = lease.epoch if lease is not None else 0
    line = (f"{event} {task.request.id} {epoch} {task.request.hostname} {os.getpid()} "
            f"{time.time():.6f}\n")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _run(task: Any, path: str, seconds: float, gate: str | None) -> float:
    """Journal ``start``, wait ``seconds`` (or until the file ``gate`` exists), journal ``end``."""
    journal(path, "start", task)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (gate and os.path.exists(gate)):
        time.sleep(0.02)
    journal(path, "end", task)
    return seconds


@app.task(name="recoverapp.late", bind=True, acks_late=True)
def late(self: Any, path: str, seconds: float = 0.0, gate: str | None = None) -> float:
    """acks_late: a started-then-lost attempt is re-dispatched (policy ``redispatch``)."""
    return _run(self, path, seconds, gate)


@app.task(name="recoverapp.plain", bind=True, acks_late=False)
def plain(self: Any, path: str, seconds: float = 0.0, gate: str | None = None) -> float:
    """Not acks_late: a started-then-lost attempt needs review (policy ``review``)."""
    return _run(self, path, seconds, gate)


@app.task(name="recoverapp.doomed", bind=True, acks_late=True)
def doomed(self: Any, path: str) -> None:
    """Kills the whole worker it runs in (main process and pool) on every attempt."""
    journal(path, "start", self)
    os.killpg(os.getpgid(0), signal.SIGKILL)
