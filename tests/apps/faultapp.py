"""Tasks for the fault-injection suite: every step leaves a mark in a history table.

``start``/``end``/``fence_rejected`` events go to a history database that the
nemesis never touches; the side effect itself goes to the store's database through
``lease.fenced(conn)``, check-then-insert, so it can commit at most once per task.
Configured by environment: PULSE_TEST_* like pulseapp, plus PULSE_FAULT_HISTORY
(history DB URL) and PULSE_FAULT_SKEW (seconds added to time.time in this process:
the store clock must make it irrelevant).
"""

from __future__ import annotations

import json
import os
import time
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


def record(kind: str, task_id: str, epoch: int, extra: str = "") -> None:
    with _engine(os.environ["PULSE_FAULT_HISTORY"]).begin() as conn:
        conn.execute(sa.text(
            "insert into fault_events (kind, task_id, epoch, worker, pid, at, extra) "
            "values (:k, :t, :e, :w, :p, clock_timestamp(), :x)"),
            {"k": kind, "t": task_id, "e": epoch, "w": os.environ.get("PULSE_FAULT_NODE", "?"),
             "p": os.getpid(), "x": extra})


def _body(task: Any, seconds: float) -> str:
    lease = current_lease()
    assert lease is not None, "not running under a pulse lease"
    task_id = task.request.id
    record("start", task_id, lease.epoch, str(task.request.retries or 0))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
        lease.check()
    try:
        with _engine(os.environ["PULSE_TEST_STORE"]).connect() as conn, lease.fenced(conn):
            seen = conn.execute(sa.text("select count(*) from fault_effects where task_id = :t"),
                                {"t": task_id}).scalar_one()
            if not seen:
                conn.execute(sa.text("insert into fault_effects (task_id, epoch) values (:t, :e)"),
                             {"t": task_id, "e": lease.epoch})
    except LeaseLost:
        record("fence_rejected", task_id, lease.epoch)
        raise
    except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
        # The store is down (nemesis): try again later under a new reservation.
        raise task.retry(exc=exc, countdown=1, max_retries=20) from exc
    record("end", task_id, lease.epoch)
    return task_id


@app.task(bind=True, acks_late=True, name="faultapp.short")
def short(self: Any) -> str:
    return _body(self, 0.2)


@app.task(bind=True, acks_late=True, name="faultapp.long")
def long(self: Any, seconds: float) -> str:
    return _body(self, seconds)


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
