"""The Celery app the acceptance tests run in real ``celery worker -P pulse`` processes.

Configured entirely from the environment the test sets:
``PULSE_TEST_BROKER``, ``PULSE_TEST_STORE``, ``PULSE_TEST_QUEUE`` and
``PULSE_TEST_CONF`` (a JSON object of extra Celery settings).
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery

import celery_pulse

app = Celery("pulseapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
queue = os.environ.get("PULSE_TEST_QUEUE", "celery")
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=queue,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
app.conf.update(json.loads(os.environ.get("PULSE_TEST_CONF", "{}")))
celery_pulse.install(app)


@app.task(name="pulseapp.touch")
def touch(path: str, text: str = "") -> str:
    """Side effect visible to the test: create a file."""
    with open(path, "a") as fh:
        fh.write(text + "\n")
    return path


@app.task(name="pulseapp.sleep")
def sleep(seconds: float, path: str | None = None) -> float:
    if path:
        touch(path, "start")
    time.sleep(seconds)
    if path:
        touch(path, "end")
    return seconds
