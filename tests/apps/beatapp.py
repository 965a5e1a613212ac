"""The Celery app of the beat acceptance tests (tests/acceptance/test_beat.py).

Configured from the environment like :mod:`tests.apps.pulseapp`:
``PULSE_TEST_BROKER``, ``PULSE_TEST_STORE``, ``PULSE_TEST_QUEUE`` and
``PULSE_TEST_CONF`` (a JSON object of extra Celery settings). JSON cannot hold a
Celery schedule object, so the schedule is built here from two keys that are
popped from that JSON before it reaches ``app.conf``:

* ``test_beat``: ``{entry name: seconds}``, one interval entry per item, each
  running :func:`tick` with the journal path as its only argument;
* ``test_journal``: the journal file (default ``$PULSE_TEST_JOURNAL`` or ``ticks.log``).

``PULSE_TEST_BEAT_EVERY=1.0`` (environment) adds a single entry ``tick`` when
``test_beat`` is absent.

:func:`tick` appends one line per execution to the journal::

    <task_id> <worker hostname> <pid> <unix time>

so the test counts executions per slot task id (a slot that fired twice would
show up twice, or as two slot rows for one period).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

from celery import Celery

import celery_pulse

_conf: dict[str, Any] = json.loads(os.environ.get("PULSE_TEST_CONF", "{}"))
_beat: dict[str, float] = _conf.pop("test_beat", None) or {}
JOURNAL: str = _conf.pop("test_journal", None) or os.environ.get("PULSE_TEST_JOURNAL", "ticks.log")
if not _beat and os.environ.get("PULSE_TEST_BEAT_EVERY"):
    _beat = {"tick": float(os.environ["PULSE_TEST_BEAT_EVERY"])}

app = Celery("beatapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
queue = os.environ.get("PULSE_TEST_QUEUE", "celery")
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=queue,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    beat_schedule={name: {"task": "beatapp.tick", "schedule": timedelta(seconds=every),
                          "args": [JOURNAL]} for name, every in _beat.items()},
)
app.conf.update(_conf)
celery_pulse.install(app)


@app.task(name="beatapp.tick", bind=True)
def tick(self: Any, path: str) -> str:
    """Record this execution with a single O_APPEND write (lines never interleave)."""
    line = f"{self.request.id} {self.request.hostname} {os.getpid()} {time.time():.6f}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return str(self.request.id)
