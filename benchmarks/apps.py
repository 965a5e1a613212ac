"""The Celery app every benchmark runs in real ``celery worker`` / beat processes.

Configured entirely from the environment the runner sets:

* ``BENCH_BROKER``: broker URL; ``BENCH_STORE``: pulse store URL (unset: plain Celery);
* ``BENCH_QUEUE``: the default queue; ``BENCH_CONF``: JSON object of extra settings;
* ``BENCH_READY_FILE``: the ``worker_ready`` signal appends ``time.time()`` there;
* ``BENCH_BEAT_EVERY``: adds one beat entry ``tick`` every that many seconds;
* ``BENCH_REDBEAT``: when set, beat uses RedBeat on ``BENCH_REDBEAT`` (a Redis URL).

Every task that the runner times writes its own wall-clock time (one ``os.write``
with ``O_APPEND``, so lines of concurrent processes never interleave). The ``span_*``
tasks write when their body began and ended (the permits section counts how many ran
at once from them); their limits come from ``pulse_concurrency_limits`` in
``BENCH_CONF``, so a limited and an unlimited run execute the very same task.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

from celery import Celery
from celery.signals import worker_ready

import celery_pulse
from celery_pulse import LeaseLost, current_lease

app = Celery("benchapp", broker=os.environ.get("BENCH_BROKER", "memory://"))
queue = os.environ.get("BENCH_QUEUE", "celery")
app.conf.update(
    task_default_queue=queue,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
if os.environ.get("BENCH_STORE"):
    app.conf.pulse_store_url = os.environ["BENCH_STORE"]
if os.environ.get("BENCH_BEAT_EVERY"):
    app.conf.beat_schedule = {
        "tick": {"task": "bench.tick", "schedule": timedelta(seconds=float(os.environ[
            "BENCH_BEAT_EVERY"])), "options": {"queue": queue}}}
if os.environ.get("BENCH_REDBEAT"):
    app.conf.redbeat_redis_url = os.environ["BENCH_REDBEAT"]
    app.conf.beat_scheduler = "redbeat.RedBeatScheduler"
app.conf.update(json.loads(os.environ.get("BENCH_CONF", "{}")))
celery_pulse.install(app)


def journal(path: str, *words: object) -> None:
    """Append one line ``words... <time>`` to ``path`` with a single write."""
    line = " ".join(str(w) for w in words) + f" {time.time():.6f}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@worker_ready.connect
def _ready(sender: Any = None, **_kwargs: Any) -> None:
    path = os.environ.get("BENCH_READY_FILE")
    if path:
        journal(path, "ready", os.getpid())


@app.task(name="bench.noop")
def noop() -> None:
    return None


@app.task(name="bench.sleep")
def sleep(ms: float) -> None:
    time.sleep(ms / 1000.0)


@app.task(name="bench.noop_late", acks_late=True)
def noop_late() -> None:
    """``noop`` with ``acks_late``: Recover re-dispatches it whether it started or not."""
    return None


@app.task(name="bench.sleep_late", acks_late=True)
def sleep_late(ms: float) -> None:
    time.sleep(ms / 1000.0)


#: This process's descriptor of each span journal (opened at its first span): one
#: ``write`` per task, no ``open``/``close``, so recording costs the body next to nothing.
_SPAN_FDS: dict[str, int] = {}


def span(path: str, started: float) -> None:
    """Append ``<started> <now>`` (the body's start and end) to ``path`` in one write."""
    ended = time.time()
    fd = _SPAN_FDS.get(path)
    if fd is None:
        fd = _SPAN_FDS[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{started:.6f} {ended:.6f}\n".encode())


@app.task(name="bench.span_noop")
def span_noop(path: str) -> None:
    """``noop`` that records when its body ran (the permits section limits this kind)."""
    span(path, time.time())


@app.task(name="bench.span_sleep")
def span_sleep(path: str, ms: float) -> None:
    """``sleep`` that records when its body ran (the permits section limits this kind)."""
    started = time.time()
    time.sleep(ms / 1000.0)
    span(path, started)


@app.task(name="bench.stop")
def stop(path: str) -> None:
    """The last message of a throughput run: its start time ends the measurement."""
    journal(path, "stop")


def _hold(task: Any, path: str, seconds: float) -> None:
    lease = current_lease()
    journal(path, "start", task.request.id, lease.epoch if lease else 0, task.request.hostname,
            os.getpid())
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)
    journal(path, "end", task.request.id, lease.epoch if lease else 0)


@app.task(name="bench.late", bind=True, acks_late=True)
def late(self: Any, path: str, seconds: float) -> None:
    """acks_late: a started-then-lost attempt is re-dispatched."""
    _hold(self, path, seconds)


@app.task(name="bench.plain", bind=True, acks_late=False)
def plain(self: Any, path: str, seconds: float) -> None:
    """Default acks (early): a started-then-lost attempt goes to review under pulse."""
    _hold(self, path, seconds)


@app.task(name="bench.touch", bind=True)
def touch(self: Any, path: str) -> None:
    journal(path, "touch", self.request.id, self.request.hostname)


@app.task(name="bench.watch", bind=True)
def watch(self: Any, path: str, seconds: float) -> None:
    """Checks its lease every 10 ms; records when LeaseLost arrives (signal or check)."""
    lease = current_lease()
    journal(path, "start", os.getpid())
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if lease is not None:
                lease.check()
            time.sleep(0.01)
    except LeaseLost:
        journal(path, "lost", os.getpid())
        raise
    journal(path, "end", os.getpid())


@app.task(name="bench.stubborn", bind=True)
def stubborn(self: Any, path: str, seconds: float) -> None:
    """Catches and ignores LeaseLost: only the hard stop ends it early."""
    journal(path, "start", os.getpid())
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.01)
        except LeaseLost:
            journal(path, "ignored", os.getpid())
    journal(path, "end", os.getpid())


@app.task(name="bench.tick", bind=True)
def tick(self: Any) -> None:
    """The beat entry's task (the runner reads its messages off the queue, not this)."""
    return None
