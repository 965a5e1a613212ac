"""The Celery app of the concurrency-permit acceptance tests (tests/acceptance/test_permits.py).

Configured from the environment exactly like :mod:`tests.apps.pulseapp`:
``PULSE_TEST_BROKER``, ``PULSE_TEST_STORE``, ``PULSE_TEST_QUEUE`` and
``PULSE_TEST_CONF`` (a JSON object of extra Celery settings, e.g.
``pulse_concurrency_limits``). ``PERMITAPP_BAD`` declares one bad task option (the
startup checks are tested with it): ``zero`` (``pulse_concurrency=0``) or ``key`` (a
``pulse_concurrency_key`` that is not callable).

Every task appends one line per event to a journal file the test reads, with a single
``write`` on an ``O_APPEND`` descriptor (lines of concurrent processes never interleave)::

    <event> <task name> <task_id> <key> <epoch> <worker hostname> <pid> <attempt> <unix time>

``event`` is ``start`` (the body began), ``end`` (it returned) or ``lost`` (it ended on
``LeaseLost``, ``permitapp.gated`` only); ``key`` is the
permit partition (the ``customer`` kwarg) or ``-``; ``attempt`` is a fresh random
marker per execution of a body, so a start and its end pair up even when a task runs
twice; the time is ``time.time()`` taken by the body itself (every worker runs on the
test's host: one clock).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from celery import Celery

import celery_pulse
from celery_pulse import LeaseLost, current_lease

app = Celery("permitapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
queue = os.environ.get("PULSE_TEST_QUEUE", "celery")
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=queue,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
app.conf.update(json.loads(os.environ.get("PULSE_TEST_CONF", "{}")))
celery_pulse.install(app)


def journal(path: str, event: str, task: Any, attempt: str, key: object = "-") -> None:
    """Append one event line with a single ``write`` (O_APPEND: lines never interleave)."""
    lease = current_lease()
    epoch = lease.epoch if lease is not None else 0
    line = (f"{event} {task.name} {task.request.id} {key} {epoch} {task.request.hostname} "
            f"{os.getpid()} {attempt} {time.time():.6f}\n")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _run(task: Any, path: str, seconds: float, key: object = "-") -> float:
    attempt = uuid.uuid4().hex[:12]
    journal(path, "start", task, attempt, key)
    time.sleep(seconds)
    journal(path, "end", task, attempt, key)
    return seconds


@app.task(name="permitapp.limited", bind=True, pulse_concurrency=2)
def limited(self: Any, path: str, seconds: float) -> float:
    """At most 2 at once across the cluster (the task option)."""
    return _run(self, path, seconds)


@app.task(name="permitapp.free", bind=True)
def free(self: Any, path: str, seconds: float) -> float:
    """No limit: runs alongside the limited kinds."""
    return _run(self, path, seconds)


@app.task(name="permitapp.per_customer", bind=True, pulse_concurrency=1,
          pulse_concurrency_key=lambda args, kwargs: kwargs["customer"])
def per_customer(self: Any, path: str, seconds: float, customer: int) -> float:
    """At most 1 at once per ``customer`` (a partitioned limit)."""
    return _run(self, path, seconds, customer)


@app.task(name="permitapp.gated", bind=True, acks_late=True)
def gated(self: Any, path: str, gates: str, seconds: float) -> float:
    """Runs until the file ``<gates>/<task id>.<epoch>`` or ``<gates>/all`` exists, or
    ``seconds`` pass. It never checks its lease, so a body whose lease was taken over
    finishes unless its worker stops it first (``LeaseLost``, journalled as ``lost``).
    No limit of its own: the tests limit it with ``pulse_concurrency_limits``.
    ``acks_late``: an attempt lost with its worker is re-dispatched by Recover rather
    than sent to review."""
    attempt = uuid.uuid4().hex[:12]
    lease = current_lease()
    epoch = lease.epoch if lease is not None else 0
    journal(path, "start", self, attempt)
    mine = os.path.join(gates, f"{self.request.id}.{epoch}")
    every = os.path.join(gates, "all")
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and not (os.path.exists(mine)
                                                   or os.path.exists(every)):
            time.sleep(0.02)
    except LeaseLost:  # the worker found the lease lost and stopped the body
        journal(path, "lost", self, attempt)
        raise
    journal(path, "end", self, attempt)
    return seconds


_bad = os.environ.get("PERMITAPP_BAD")
if _bad == "zero":
    @app.task(name="permitapp.bad_zero", pulse_concurrency=0)
    def bad_zero() -> None:
        """A limit of 0 could never run: refused at startup."""

elif _bad == "key":
    @app.task(name="permitapp.bad_key", pulse_concurrency=1, pulse_concurrency_key="customer")
    def bad_key() -> None:
        """A partition key that is not callable: refused at startup."""


@app.task(name="permitapp.rated", bind=True, pulse_rate_limit="20/s")
def rated(self: Any, path: str, seconds: float) -> float:
    """At most 20 starts in any second across the cluster (a rate limit)."""
    return _run(self, path, seconds)


@app.task(name="permitapp.rated_per_customer", bind=True, pulse_rate_limit="10/s",
          pulse_rate_limit_key=lambda args, kwargs: kwargs["customer"])
def rated_per_customer(self: Any, path: str, seconds: float, customer: int) -> float:
    """At most 10 starts a second per ``customer`` (a partitioned rate)."""
    return _run(self, path, seconds, customer)
