"""A gateway worker's app (issue 18): no store URL, no broker; only the gateway's URL,
a credentials file and the test CA, from the environment."""

from __future__ import annotations

import os
import time

from celery import Celery

import celery_pulse
from celery_pulse import LeaseLost, current_lease

app = Celery("gatewayapp")
app.conf.update(
    pulse_gateway_url=os.environ.get("PULSE_TEST_GATEWAY_URL"),
    pulse_gateway_credentials=os.environ.get("PULSE_TEST_GATEWAY_CREDENTIALS"),
    pulse_gateway_ca=os.environ.get("PULSE_TEST_GATEWAY_CA"),
    task_default_queue=os.environ.get("PULSE_TEST_QUEUE", "celery"),
)
celery_pulse.install(app)


@app.task(name="gatewayapp.add")
def add(x: int, y: int) -> dict[str, int]:
    lease = current_lease()
    assert lease is not None
    return {"sum": x + y, "epoch": lease.epoch, "pid": os.getpid()}


@app.task(name="gatewayapp.meet")
def meet(folder: str, others: int, timeout: float = 20.0) -> int:
    """Waits until ``others`` more tasks run beside it (a file per process in ``folder``):
    only a worker running them at once, in processes of their own, gets past it."""
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + timeout
    while len(os.listdir(folder)) <= others:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{others} other task(s) never ran beside this one")
        time.sleep(0.02)
    return os.getpid()


@app.task(name="gatewayapp.fail")
def fail(message: str) -> None:
    raise ValueError(message)


@app.task(name="gatewayapp.hold")
def hold(seconds: float, marker: str) -> str:
    """Runs until done, or until its lease is lost (LeaseLost, written to the marker)."""
    with open(marker, "a") as fh:
        fh.write("start\n")
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(0.05)
    except LeaseLost:
        with open(marker, "a") as fh:
            fh.write("lost\n")
        raise
    return "held"


@app.task(name="gatewayapp.retrying", bind=True)
def retrying(self: object) -> None:
    """A retry publishes: a gateway worker has no broker to publish to."""
    raise self.retry(countdown=0)  # type: ignore[attr-defined]


@app.task(name="gatewayapp.stubborn")
def stubborn(marker: str, seconds: float) -> None:
    """Catches and ignores LeaseLost: only the hard stop can end it early."""
    with open(marker, "a") as fh:
        fh.write(f"start {os.getpid()}\n")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.05)
        except LeaseLost:
            with open(marker, "a") as fh:
                fh.write("ignored\n")
    with open(marker, "a") as fh:
        fh.write("end\n")


@app.task(name="gatewayapp.tally")
def tally(folder: str, index: int, seconds: float) -> int:
    """Records each run of ``index`` (one file per run: a run twice leaves two), then
    works for ``seconds``."""
    lease = current_lease()
    assert lease is not None
    with open(os.path.join(folder, f"{index}-{os.getpid()}-{lease.epoch}"), "w") as fh:
        fh.write(f"{time.time()}\n")
    time.sleep(seconds)
    return index
