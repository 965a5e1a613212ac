"""App for the malformed-message tests: a task that records its runs, and one whose
name is longer than the claims table's column (a user's mistake, registered all the same)."""

from __future__ import annotations

import json
import os

from celery import Celery

import celery_pulse

app = Celery("intakeapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=os.environ.get("PULSE_TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
)
app.conf.update(json.loads(os.environ.get("PULSE_TEST_CONF", "{}")))
celery_pulse.install(app)

#: 300 characters: over the 255 the claims table keeps for a task name.
LONG_NAME = "intakeapp." + "x" * 290


@app.task(name="intakeapp.mark")
def mark(marker: str, pad: str = "") -> int:
    """Appends a line per run to ``marker``; returns the argument's size."""
    with open(marker, "a") as fh:
        fh.write("ran\n")
    return len(pad)


@app.task(name=LONG_NAME)
def long_named(marker: str) -> None:
    with open(marker, "a") as fh:
        fh.write("ran\n")
