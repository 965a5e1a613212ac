"""The Celery app the acceptance tests run in real ``celery worker -P pulse`` processes.

Configured entirely from the environment the test sets:
``PULSE_TEST_BROKER``, ``PULSE_TEST_STORE``, ``PULSE_TEST_QUEUE`` and
``PULSE_TEST_CONF`` (a JSON object of extra Celery settings).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

import celery_pulse
from celery_pulse import LeaseLost, current_lease

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


# -- tasks for the lease acceptance tests (tests/acceptance/test_leases.py) -------------
# Each writes one line per event into ``path`` ("start <epoch> <pid> ...", "lost <wall time>",
# "end <epoch>", ...), so the test can count executions and time what the task saw.

def mark(path: str, *words: object) -> None:
    """Append one line ``words...`` to ``path`` (flushed on close)."""
    with open(path, "a") as fh:
        fh.write(" ".join(str(w) for w in words) + "\n")


def until_told(path: str, poll: float = 0.02) -> None:
    """Wait (at most 60 s, without checking the lease) until ``<path>.go`` exists."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path + ".go") and time.monotonic() < deadline:
        time.sleep(poll)


_engines: dict[str, Any] = {}


def store_engine() -> Any:
    """An engine on the store's database (one per process: children are forked)."""
    import sqlalchemy as sa

    key = f"{os.getpid()}:{app.conf.pulse_store_url}"
    if key not in _engines:
        _engines[key] = sa.create_engine(app.conf.pulse_store_url, poolclass=sa.pool.NullPool)
    return _engines[key]


def _watch(path: str, seconds: float) -> int:
    """Run ``seconds`` under the lease, checking it every 20 ms; record what happened."""
    lease = current_lease()
    epoch = lease.epoch if lease else 0
    mark(path, "start", epoch, os.getpid(), repr(time.time()))
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if lease is not None:
                lease.check()
            time.sleep(0.02)
    except LeaseLost:
        mark(path, "lost", repr(time.time()), epoch)
        raise
    mark(path, "end", epoch)
    return epoch


@app.task(name="pulseapp.leased_sleep")
def leased_sleep(seconds: float, path: str) -> int:
    """Sleep under the lease; LeaseLost (signal or check) is recorded with its wall time."""
    return _watch(path, seconds)


@app.task(name="pulseapp.late_sleep", acks_late=True)
def late_sleep(seconds: float, path: str) -> int:
    """``leased_sleep`` with ``acks_late=True``."""
    return _watch(path, seconds)


@app.task(name="pulseapp.charge")
def charge(path: str, seconds: float, value: str) -> str:
    """A review-policy body (not idempotent) that ends on its own: "start", then
    ``value`` after ``seconds`` (no lease check: it never learns of a loss)."""
    mark(path, "start", os.getpid())
    time.sleep(seconds)
    mark(path, "end")
    return value


@app.task(name="pulseapp.late_charge", acks_late=True)
def late_charge(path: str, seconds: float, value: str) -> str:
    """``charge`` with ``acks_late=True`` (re-dispatch policy)."""
    return str(charge(path, seconds, value))


@app.task(name="pulseapp.fenced_writer")
def fenced_writer(path: str, table: str, seconds: float) -> int:
    """Insert a row into ``table`` every ~50 ms, each inside ``lease.fenced(conn)``."""
    import sqlalchemy as sa

    lease = current_lease()
    assert lease is not None, "not running under a pulse lease"
    mark(path, "start", lease.epoch, os.getpid())
    insert = sa.text(f"INSERT INTO {table} (task_id, epoch, seq) VALUES (:t, :e, :s)")
    seq = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            try:
                with store_engine().connect() as conn, lease.fenced(conn):
                    conn.execute(insert, {"t": lease.task_id, "e": lease.epoch, "s": seq})
                seq += 1
            except sa.exc.DBAPIError as exc:  # e.g. the fenced transaction timed out
                mark(path, "db-error", type(exc.orig).__name__)
            time.sleep(0.05)
    except LeaseLost as exc:
        # "store": the fenced transaction was refused by the store; "local": the
        # worker's revocation or the local deadline.
        by_store = "refused" in str(exc) or "expired before" in str(exc)
        mark(path, "lost", repr(time.time()), lease.epoch, seq, "store" if by_store else "local")
        raise
    mark(path, "end", lease.epoch, seq)
    return seq


@app.task(name="pulseapp.stubborn")
def stubborn(path: str, seconds: float) -> None:
    """Catches and ignores LeaseLost: only the hard stop can end it early."""
    mark(path, "start", os.getpid())
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.05)
            mark(path, "tick", repr(time.time()))
        except LeaseLost:
            mark(path, "ignored", repr(time.time()))
    mark(path, "end")


@app.task(name="pulseapp.retry_once", bind=True, max_retries=3)
def retry_once(self: Any, path: str) -> int:
    """Retries once (no countdown), then succeeds; records the epoch of each attempt."""
    lease = current_lease()
    epoch = lease.epoch if lease else 0
    mark(path, "attempt", self.request.retries, epoch)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return epoch


# -- tasks for the request-lifecycle tests (tests/acceptance/test_lifecycle.py) ------------
@app.task(name="pulseapp.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="pulseapp.replace_add", bind=True)
def replace_add(self: Any, x: int, y: int) -> None:
    """Replaces itself with ``add(x, y)``: the replacement is published under this task id."""
    raise self.replace(add.s(x, y))


@app.task(name="pulseapp.reject_once", bind=True, acks_late=True)
def reject_once(self: Any, path: str) -> int:
    """``Reject(requeue=True)`` on its first run, then succeeds; records both epochs.

    ``acks_late``: as under plain Celery, a message acknowledged at the start has
    nothing left to requeue.
    """
    from celery.exceptions import Reject

    lease = current_lease()
    epoch = lease.epoch if lease else 0
    redelivered = bool(self.request.delivery_info.get("redelivered"))
    if not os.path.exists(path):
        mark(path, "rejected", epoch, redelivered)
        raise Reject("not yet", requeue=True)
    mark(path, "ran", epoch, redelivered)
    return epoch


@app.task(name="pulseapp.chord_part", acks_late=True)
def chord_part(x: int, path: str, seconds: float) -> int:
    """Epoch 1 runs ``seconds`` under the lease; later epochs wait for ``<path>.go``."""
    lease = current_lease()
    epoch = lease.epoch if lease else 0
    if epoch <= 1:
        _watch(path, seconds)
        return x
    mark(path, "start", epoch, os.getpid(), repr(time.time()))
    until_told(path)
    mark(path, "end", epoch)
    return x


@app.task(name="pulseapp.total")
def total(values: list[int]) -> int:
    return sum(values)


@app.task(name="pulseapp.die_once", acks_late=True, reject_on_worker_lost=True)
def die_once(path: str) -> int:
    """Its pool process dies (SIGKILL, as the OOM killer would) on the first run."""
    import signal

    lease = current_lease()
    epoch = lease.epoch if lease else 0
    if not os.path.exists(path):
        mark(path, "killed", epoch)
        os.kill(os.getpid(), signal.SIGKILL)
    mark(path, "ran", epoch)
    return epoch


@app.task(name="pulseapp.slow_once", acks_late=True, acks_on_timeout=False, time_limit=1)
def slow_once(path: str) -> int:
    """Runs into its hard time limit on the first run (requeued, as ``acks_late`` without
    ``acks_on_timeout`` asks), then finishes at once."""
    lease = current_lease()
    epoch = lease.epoch if lease else 0
    first = not os.path.exists(path)
    mark(path, "start", epoch)
    if first:
        time.sleep(30)
    return epoch


# -- tasks for the result backend tests (tests/acceptance/test_result_backend.py) ---------
@app.task(name="pulseapp.fail")
def fail(message: str) -> None:
    raise ValueError(message)


@app.task(name="pulseapp.epoch_when_told")
def epoch_when_told(path: str) -> int:
    """Records its start, waits (without checking its lease) for ``<path>.go``, returns
    its epoch: a body that would finish even after its lease was taken over."""
    lease = current_lease()
    epoch = lease.epoch if lease else 0
    mark(path, "start", epoch, os.getpid())
    until_told(path, 0.01)
    mark(path, "end", epoch)
    return epoch



@app.task(name="pulseapp.store_opened_here")
def store_opened_here(folder: str, together: int) -> tuple[int, bool]:
    """(this pool process's pid, whether the result backend opened the store here), once
    ``together`` probes have started (each leaves a file in ``folder``)."""
    mark(os.path.join(folder, str(os.getpid())), "here")
    deadline = time.monotonic() + 20
    while len(os.listdir(folder)) < together and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.getpid(), bool(app.backend.opened_here())


@app.task(name="pulseapp.record_total")
def record_total(values: list[int], path: str) -> int:
    """A chord callback that records each run (the test counts them)."""
    mark(path, "total", sum(values), os.getpid())
    return sum(values)
