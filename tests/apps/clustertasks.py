"""Shared tasks of the pytest-celery cluster tests (tests/acceptance/test_pytest_celery.py).

``shared_task``s, so they bind to whichever app imports them: the test's app and the
pytest-celery worker nodes' app alike. Each appends ``<event> <task_id> <epoch>
<worker> <unix time>`` lines to a journal file the test reads (one ``write`` per line,
O_APPEND: lines never interleave).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task

from celery_pulse import LeaseLost, current_lease


def journal(path: str, event: str, task: Any) -> None:
    lease = current_lease()
    epoch = lease.epoch if lease is not None else 0
    line = f"{event} {task.request.id} {epoch} {task.request.hostname} {time.time():.6f}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _hold(task: Any, path: str, gate: str) -> str:
    """Journal ``start``, wait for the file ``gate`` (or ``LeaseLost``), journal ``end``."""
    journal(path, "start", task)
    lease = current_lease()
    try:
        while not os.path.exists(gate):
            if lease is not None:
                lease.check()
            time.sleep(0.02)
    except LeaseLost:
        journal(path, "lost", task)
        raise
    journal(path, "end", task)
    return "done"


@shared_task(bind=True, acks_late=True, name="clustertasks.late")
def late(self: Any, path: str, gate: str) -> str:
    """Safe to repeat: a lost attempt is re-dispatched."""
    return _hold(self, path, gate)


@shared_task(bind=True, acks_late=False, name="clustertasks.plain")
def plain(self: Any, path: str, gate: str) -> str:
    """Not safe to repeat: a lost attempt goes to review."""
    return _hold(self, path, gate)
