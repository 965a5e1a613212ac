"""Sending a worker's events (``celery_pulse.worker.events``) through a real Celery
``EventDispatcher`` (on kombu's in-memory transport). That events reach a real receiver
over RabbitMQ and Redis is tests/acceptance/test_events.py's."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_pulse.worker.events import WorkerEvents
from celery_pulse.worker.loop import LoopCaller


@pytest.fixture
def dispatcher() -> Iterator[Any]:
    app = Celery("events-unit", broker="memory://")
    connection = app.connection_for_write()
    dispatcher = app.events.Dispatcher(connection, hostname="w1@h", enabled=True)
    yield dispatcher
    dispatcher.close()
    connection.release()
    app.close()


def _events(dispatcher: Any) -> WorkerEvents:
    consumer = SimpleNamespace(event_dispatcher=dispatcher)
    return WorkerEvents("w1@h", lambda: LoopCaller(None), lambda: consumer)


def test_a_send_failure_is_a_warning_once_per_event_type_then_debug(
        dispatcher: Any, caplog: pytest.LogCaptureFixture) -> None:
    events = _events(dispatcher)
    caplog.set_level(logging.DEBUG, logger="celery_pulse.bootsteps.runtime")
    for _ in range(3):  # ``pid`` is a field Celery sets itself: TypeError, every time
        events.emit("pulse-broken", pid=1)
    events.emit("pulse-also-broken", pid=1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "pulse-broken" in warnings[0] and "pulse-also-broken" in warnings[1]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG
             and "could not send pulse-broken" in r.getMessage()]
    assert len(debug) == 2


def test_an_event_on_another_workers_behalf_leaves_the_dispatchers_hostname_as_it_was(
        dispatcher: Any, caplog: pytest.LogCaptureFixture) -> None:
    events = _events(dispatcher)
    caplog.set_level(logging.WARNING, logger="celery_pulse.bootsteps.runtime")
    events.emit("pulse-lease-lost", uuid="t1", epoch=1, reason="x", running=True)
    events.emit("task-failed", hostname="lost@h", uuid="t1", exception="NeedsReview('x')",
                wait=1.0)
    assert dispatcher.hostname == "w1@h"
    assert not caplog.records  # both sent: no hostname keyword clash any more


class _Request:
    """What ``AttemptEvents`` reads of Celery's request: its id, eventer and task."""

    def __init__(self, eventer: Any) -> None:
        self.id = "t1"
        self.eventer = eventer
        self.task = SimpleNamespace(send_events=True)


def _sent(dispatcher: Any, send: Any) -> list[dict[str, Any]]:
    """The events ``send()`` published on the dispatcher's exchange (read back by a real
    kombu consumer of the in-memory broker)."""
    from kombu import Exchange, Queue

    queue = Queue("unit-events", Exchange("celeryev", type="topic"), routing_key="#")
    with dispatcher.connection.SimpleQueue(queue) as simple:
        send()
        out = []
        while True:
            try:
                message = simple.get(timeout=0.2)
            except simple.Empty:
                return out
            message.ack()
            out.append(message.payload)


def test_a_live_attempts_task_events_carry_its_epoch_and_attempt(dispatcher: Any) -> None:
    from celery_pulse.leases import LocalClaim
    from celery_pulse.worker.events import AttemptEvents

    claim = LocalClaim("t1", 3, "token", deadline=1e12, attempts=2)
    request = _Request(dispatcher)
    events = AttemptEvents(request, claim, lambda c: True)
    (event,) = _sent(dispatcher, lambda: events("task-succeeded", result="1", runtime=0.1))
    assert (event["type"], event["uuid"], event["pulse_epoch"], event["pulse_attempt"]) == (
        "task-succeeded", "t1", 3, 2)


@pytest.mark.parametrize("how", ["lost", "past its deadline"])
def test_a_stale_attempts_end_is_sent_as_pulse_attempt_ended(dispatcher: Any, how: str
                                                             ) -> None:
    from celery_pulse.leases import LOST, LocalClaim
    from celery_pulse.worker.events import AttemptEvents

    claim = LocalClaim("t1", 1, "token", deadline=1e12, attempts=1, lost_reason="taken over")
    if how == "lost":
        claim.state = LOST
    request = _Request(dispatcher)  # held here: AttemptEvents keeps only a weak reference
    events = AttemptEvents(request, claim, lambda c: how == "lost")
    for type_, outcome in (("task-succeeded", "succeeded"), ("task-failed", "failed"),
                           ("task-retried", "retried"), ("task-revoked", "revoked")):
        (event,) = _sent(dispatcher, lambda t=type_: events(t, exception="LeaseLost('x')"))
        assert event["type"] == "pulse-attempt-ended", event
        assert (event["uuid"], event["epoch"], event["outcome"], event["reason"]) == (
            "t1", 1, outcome, "taken over")


class _StuckHub:
    """An event loop that never runs what it is handed (a loop blocked by a reconnect)."""

    def call_soon(self, fn: Any, *args: Any) -> None:
        pass


def test_a_stuck_loop_makes_recover_wait_once_not_for_every_task(dispatcher: Any) -> None:
    import time

    consumer = SimpleNamespace(event_dispatcher=dispatcher)
    loop = LoopCaller(_StuckHub())
    events = WorkerEvents("w1@h", lambda: loop, lambda: consumer)
    began = time.monotonic()
    events.emit("task-retried", hostname="lost@h", uuid="t1", wait=0.3)
    first = time.monotonic() - began
    began = time.monotonic()
    for task_id in ("t2", "t3", "t4"):
        events.emit("task-retried", hostname="lost@h", uuid=task_id, wait=0.3)
    rest = time.monotonic() - began
    assert first >= 0.3 and rest < 0.3, (first, rest)
