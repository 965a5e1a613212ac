"""The task: charge an order, once, with its ORM write fenced by the task's lease."""

import os
import time
from typing import Any

from celery import shared_task
from django.db import connection

from celery_pulse import current_lease
from example_django.orders.models import Charge


@shared_task(acks_late=True)
def charge(order: str, folder: str | None = None) -> int:
    """Charge ``order``. The write commits only while this attempt holds its lease: an
    attempt paused past its lease and taken over writes nothing, ever.

    ``folder`` (tests): the attempt says it started (``started-<epoch>``) and waits for
    a ``go`` file before writing, so a test can pause it at that point."""
    lease = current_lease()
    assert lease is not None
    if folder:
        open(os.path.join(folder, f"started-{lease.epoch}"), "w").close()
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.05)
    with lease.fenced(connection):
        Charge.objects.create(order=order, task_id=lease.task_id, epoch=lease.epoch)
    return lease.epoch


@shared_task(bind=True)
def tick(self: Any, path: str) -> str:
    """A periodic task of django-celery-beat's: records each run with one O_APPEND write
    (task id, worker, pid, time), so a test can count the runs of every slot."""
    line = f"{self.request.id} {self.request.hostname} {os.getpid()} {time.time():.6f}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return str(self.request.id)
