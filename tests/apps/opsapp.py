"""App for the operations tests (Flower, drain, metrics); env-configured like pulseapp."""

from __future__ import annotations

import json
import os
import time

from celery import Celery

import celery_pulse
from celery_pulse import LeaseLost, current_lease

app = Celery("opsapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=os.environ.get("PULSE_TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
)
app.conf.update(json.loads(os.environ.get("PULSE_TEST_CONF", "{}")))
celery_pulse.install(app)


@app.task(name="opsapp.hold")
def hold(seconds: float, marker: str, pad: str = "") -> str:
    """Runs until done or until its lease is lost (then LeaseLost propagates)."""
    lease = current_lease()
    assert lease is not None
    with open(marker, "a") as fh:
        fh.write(f"start {lease.epoch}\n")
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(0.1)
            lease.check()
    except LeaseLost:
        with open(marker, "a") as fh:
            fh.write("lost\n")
        raise
    with open(marker, "a") as fh:
        fh.write("end\n")
    return "done"


@app.task(name="opsapp.noop")
def noop() -> None:
    return None
