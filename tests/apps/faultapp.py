"""Tasks for the fault-injection suite: every step leaves a mark in a history table.

``start``/``end``/``fence_rejected`` events go to a history database that the
nemesis never touches; the side effect itself goes to the store's database through
``lease.fenced(conn)``, check-then-insert, so it can commit at most once per task.
Every event names the task and the execution (``attempt``: a fresh marker per run of
a body, so a start and its end pair up even when a task runs twice under one epoch).

``faultapp.limited`` (``pulse_concurrency=2``) also records proof marks for the
history checker's limit check (``checker.permit_intervals``): ``held`` just before
each ``lease.check()`` of its wait loop, and ``fenced`` inside the fenced block (the
claim row locked under this epoch). A mark proves the permit was held at its time
only once the body got past the check that follows it; the checker judges that.
Configured by environment: PULSE_TEST_* like pulseapp, plus PULSE_FAULT_HISTORY
(history DB URL) and PULSE_FAULT_SKEW (seconds added to time.time in this process:
the store clock must make it irrelevant).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

skew = float(os.environ.get("PULSE_FAULT_SKEW", "0") or 0)
if skew:
    _real_time = time.time
    time.time = lambda: _real_time() + skew  # type: ignore[assignment]

import sqlalchemy as sa  # noqa: E402
from celery import Celery  # noqa: E402
from celery.exceptions import Retry  # noqa: E402

import celery_pulse  # noqa: E402
from celery_pulse import LeaseLost, current_lease  # noqa: E402

app = Celery("faultapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=os.environ.get("PULSE_TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
)
app.conf.update(json.loads(os.environ.get("PULSE_TEST_CONF", "{}")))
if os.environ.get("PULSE_FAULT_TICK"):
    app.conf.beat_schedule = {"tick": {"task": "faultapp.tick",
                                       "schedule": float(os.environ["PULSE_FAULT_TICK"])}}
celery_pulse.install(app)

_engines: dict[str, sa.Engine] = {}


def _engine(url: str) -> sa.Engine:
    key = f"{os.getpid()}:{url}"
    if key not in _engines:
        _engines[key] = sa.create_engine(url, pool_size=1, max_overflow=1,
                                         connect_args={"connect_timeout": 3})
    return _engines[key]


#: Seconds between two ``held`` marks of a body that records them.
HELD_EVERY = 0.3


def record(kind: str, task_id: str, epoch: int, extra: str = "", name: str = "",
           attempt: str = "") -> None:
    """One history event, committed at once; ``at`` is the history server's clock (one
    clock for every worker, whatever ``PULSE_FAULT_SKEW`` does to this process)."""
    with _engine(os.environ["PULSE_FAULT_HISTORY"]).begin() as conn:
        conn.execute(sa.text(
            "insert into fault_events (kind, task_id, epoch, worker, pid, at, extra, name, "
            "attempt) values (:k, :t, :e, :w, :p, clock_timestamp(), :x, :n, :a)"),
            {"k": kind, "t": task_id, "e": epoch, "w": os.environ.get("PULSE_FAULT_NODE", "?"),
             "p": os.getpid(), "x": extra, "n": name, "a": attempt})


def _body(task: Any, seconds: float, marks: bool = False) -> str:
    """Wait ``seconds`` checking the lease, then write the effect fenced. With ``marks``
    also record the proof marks of the limit check (see the module's docstring): each
    mark is written *before* the check that must pass for the body to go on."""
    lease = current_lease()
    assert lease is not None, "not running under a pulse lease"
    task_id, epoch, attempt = task.request.id, lease.epoch, uuid.uuid4().hex[:12]

    def mark(kind: str, extra: str = "") -> None:
        record(kind, task_id, epoch, extra, task.name, attempt)

    mark("start", str(task.request.retries or 0))
    deadline = time.monotonic() + seconds
    next_mark = time.monotonic() + HELD_EVERY
    while time.monotonic() < deadline:
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        if marks and time.monotonic() >= next_mark:
            mark("held")
            next_mark = time.monotonic() + HELD_EVERY
        lease.check()
    try:
        with _engine(os.environ["PULSE_TEST_STORE"]).connect() as conn, lease.fenced(conn):
            if marks:  # the guard passed: the claim row stays locked until the commit
                mark("fenced")
            seen = conn.execute(sa.text("select count(*) from fault_effects where task_id = :t"),
                                {"t": task_id}).scalar_one()
            if not seen:
                conn.execute(sa.text("insert into fault_effects (task_id, epoch) values (:t, :e)"),
                             {"t": task_id, "e": lease.epoch})
    except LeaseLost:
        mark("fence_rejected")
        raise
    except sa.exc.DBAPIError as exc:
        # The store is down (nemesis), or read-only after a failover (the connection
        # invalidated): try again later under a new reservation.
        if not (isinstance(exc, (sa.exc.OperationalError, sa.exc.InterfaceError))
                or exc.connection_invalidated):
            raise
        raise task.retry(exc=exc, countdown=1, max_retries=20) from exc
    mark("end")  # only after the fenced block committed
    return task_id


@app.task(bind=True, acks_late=True, name="faultapp.short")
def short(self: Any) -> str:
    return _body(self, 0.2)


@app.task(bind=True, acks_late=True, name="faultapp.long")
def long(self: Any, seconds: float) -> str:
    return _body(self, seconds)


@app.task(bind=True, acks_late=True, name="faultapp.quick")
def quick(self: Any, seconds: float = 0.0) -> str:
    """A no-op (0 s) or a few milliseconds of work, and the fenced effect."""
    return _body(self, seconds)


@app.task(bind=True, acks_late=False, name="faultapp.quick_review")
def quick_review(self: Any, seconds: float = 0.0) -> str:
    """:func:`quick` acknowledged early (a lost run goes to review, never re-run)."""
    return _body(self, seconds)


@app.task(bind=True, acks_late=True, name="faultapp.limited", pulse_concurrency=2)
def limited(self: Any, seconds: float) -> str:
    """At most 2 at once across the cluster (``acks_late``: a lost run is re-dispatched,
    and waits for a permit again)."""
    return _body(self, seconds, marks=True)


@app.task(bind=True, acks_late=False, name="faultapp.review")
def review(self: Any, seconds: float) -> str:
    return _body(self, seconds)


@app.task(bind=True, acks_late=True, name="faultapp.flaky")
def flaky(self: Any) -> str:
    if self.request.retries < 2:
        raise self.retry(countdown=0.3, max_retries=5)
    return _body(self, 0.2)


@app.task(bind=True, name="faultapp.tick")
def tick(self: Any) -> None:
    lease = current_lease()
    record("tick", self.request.id, lease.epoch if lease else -1)


__all__ = ["Retry", "app"]
