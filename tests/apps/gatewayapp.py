"""A gateway worker's app (issue 18): no store URL, no broker; only the gateway's URL,
a credentials file and the test CA, from the environment."""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

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
app.conf.update(json.loads(os.environ.get("PULSE_TEST_REMOTE_CONF") or "{}"))
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


@app.task(name="gatewayapp.flaky", bind=True, max_retries=5)
def flaky(self: Any, folder: str, fails: int, countdown: float) -> int:
    """Records each run (a file per run), and retries until it has failed ``fails``
    times: the retry is published by the gateway, from the finish."""
    lease = current_lease()
    assert lease is not None
    runs = len(os.listdir(folder)) + 1
    with open(os.path.join(folder, f"{runs}-{lease.epoch}-{time.time()}"), "w"):
        pass
    if runs <= fails:
        raise self.retry(countdown=countdown)
    return runs


@app.task(name="gatewayapp.plus")
def plus(x: int, y: int) -> int:
    return x + y


@app.task(name="gatewayapp.elsewhere")
def elsewhere() -> None:
    """Publishes to a queue that isn't this worker's: refused, saying why."""
    plus.apply_async((1, 2), queue="somebody-elses-queue")


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


def _interval(folder: str, seconds: float, key: str) -> int:
    """Works ``seconds``, then records ``start end epoch key`` (a file per run)."""
    lease = current_lease()
    assert lease is not None
    began = time.time()
    time.sleep(seconds)
    with open(os.path.join(folder, uuid.uuid4().hex), "w") as fh:
        fh.write(f"{began} {time.time()} {lease.epoch} {key}")
    return lease.epoch


@app.task(name="gatewayapp.limited", pulse_concurrency=2)
def limited(folder: str, seconds: float) -> int:
    """At most 2 at once across the cluster (the gateway takes the permit)."""
    return _interval(folder, seconds, "")


@app.task(name="gatewayapp.per_key", pulse_concurrency=1,
          pulse_concurrency_key=lambda args, kwargs: args[2])
def per_key(folder: str, seconds: float, key: str) -> int:
    """At most 1 at once per ``key``."""
    return _interval(folder, seconds, key)


if app.conf.get("test_newer_deploy"):  # a task only the newer deploy's workers have

    @app.task(name="gatewayapp.newer", bind=True)
    def newer(self: Any) -> str:
        """The worker that ran it (its node name)."""
        return str(self.request.hostname)


@app.task(name="gatewayapp.rated", pulse_rate_limit="5/s")
def rated(folder: str, seconds: float) -> int:
    """At most 5 starts in any second across the cluster (the gateway counts them)."""
    return _interval(folder, seconds, "")
