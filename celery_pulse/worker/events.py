"""Celery events from a pulse worker: pulse's own, the attempt in every task event, and
the ends of attempts that lost their lease.

The rules, before the code:

* Everything goes through the consumer's own event dispatcher, on the consumer's loop
  thread (broker channels are not thread-safe), and only when it is enabled (``-E``:
  without task events the dispatcher sends the ``worker`` group only).
* Celery's ``EventDispatcher.send`` sets ``hostname`` itself (from the dispatcher). An
  event on another worker's behalf (Recover's verdict on an attempt that worker lost)
  sets the dispatcher's hostname for that one send, on the loop thread, and puts it back:
  Flower's worker column stays the lost holder's and no phantom node appears.
* A send that fails is logged at WARNING once per event type, then at DEBUG: events are
  for watching, never in the way of the work.
* Task events of a leased request carry ``pulse_epoch`` and ``pulse_attempt`` (the claim's
  attempts count): ``task-received`` through :class:`ReceivedEventer` (Celery's strategy
  sends it), every later one through the request's :class:`AttemptEvents`.
* A stale attempt (its lease lost, or its local deadline passed) never sends
  ``task-succeeded``, ``task-failed``, ``task-retried`` or ``task-revoked``: Flower's
  state machine would merge them into the current attempt's state (a FAILURE after a
  SUCCESS keeps its fields, a RETRY always applies). Its end goes out as
  ``pulse-attempt-ended`` instead.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from celery_pulse.leases import LOST, LocalClaim
from celery_pulse.worker.loop import LoopCaller

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.runtime")

#: Seconds an ``emit(wait=...)`` does not wait after one timed out.
NO_WAIT = 30.0
#: The event a stale attempt's end is sent as.
ATTEMPT_ENDED = "pulse-attempt-ended"
#: Celery's task events that end an attempt in Flower, and the outcome each names.
ENDS = {"task-succeeded": "succeeded", "task-failed": "failed", "task-retried": "retried",
        "task-revoked": "revoked"}


def is_stale(claim: LocalClaim, is_live: Callable[[LocalClaim], bool]) -> bool:
    """Whether ``claim``'s attempt no longer holds its lease, as this worker knows it."""
    return claim.state == LOST or claim.hard_stopped or not is_live(claim)


def attempt_ended(claim: LocalClaim, outcome: str, exception: str | None = None
                  ) -> dict[str, Any]:
    """The fields of ``pulse-attempt-ended`` for ``claim``'s stale attempt."""
    fields: dict[str, Any] = {"epoch": claim.epoch, "attempt": claim.attempts,
                              "outcome": outcome,
                              "reason": claim.lost_reason or "lease lost"}
    if exception is not None:
        fields["exception"] = exception
    return fields


class AttemptEvents:
    """A leased request's ``send_event``, set on the request by the pool.

    Adds the attempt to each task event; turns a stale attempt's end into
    ``pulse-attempt-ended``. It replaces the request's method, not its dispatcher:
    Celery points the request's ``eventer`` at a new dispatcher after a broker
    reconnect, and a running task's end goes out through that one, still rewritten.
    """

    __slots__ = ("claim", "is_live", "request")

    def __init__(self, request: Any, claim: LocalClaim,
                 is_live: Callable[[LocalClaim], bool]) -> None:
        self.request = weakref.ref(request)  # the request holds this: no cycle
        self.claim = claim
        self.is_live = is_live

    def __call__(self, type: str, **fields: Any) -> Any:
        request = self.request()
        if request is None:
            return None
        eventer = request.eventer
        if not (eventer and eventer.enabled and request.task.send_events):
            return None  # as Celery's own ``Request.send_event``
        claim = self.claim
        outcome = ENDS.get(type)
        if outcome is not None and is_stale(claim, self.is_live):
            logger.info("pulse: task %s epoch %d ended %s as a stale attempt: sent as %s",
                        claim.task_id, claim.epoch, outcome, ATTEMPT_ENDED)
            return eventer.send(ATTEMPT_ENDED, uuid=request.id, **attempt_ended(
                claim, outcome, fields.get("exception")))
        if type.startswith("task-"):
            fields.update(pulse_epoch=claim.epoch, pulse_attempt=claim.attempts)
        return eventer.send(type, uuid=request.id, **fields)


class ReceivedEventer:
    """The dispatcher Celery's strategy for leased tasks is built with.

    The strategy sends ``task-received`` while the intake hands it the granted claim
    (:func:`handing`); that event gets the claim's attempt. The pool gives each request
    its :class:`AttemptEvents` for the events after that.
    """

    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher
        self.claim: LocalClaim | None = None

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.dispatcher, "enabled", False))

    def send(self, type: str, uuid: str | None = None, **fields: Any) -> Any:
        claim = self.claim
        if claim is not None and uuid == claim.task_id and type.startswith("task-"):
            fields.update(pulse_epoch=claim.epoch, pulse_attempt=claim.attempts)
        return self.dispatcher.send(type, uuid=uuid, **fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dispatcher, name)


class ConsumerView:
    """The consumer as Celery's strategy factory sees it: its own event dispatcher
    replaced by ``eventer``, everything else the consumer's."""

    def __init__(self, consumer: Any, eventer: Any,
                 on_request: Callable[[Any], None] | None = None) -> None:
        self._consumer = consumer
        self.event_dispatcher = eventer
        if on_request is not None:
            handle = consumer.on_task_request

            def on_task_request(request: Any) -> Any:
                on_request(request)
                return handle(request)

            #: What the strategy hands each new request to (for a process), seen first.
            self.on_task_request = on_task_request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def strategy_view(consumer: Any, received: ReceivedEventer | None,
                  on_request: Callable[[Any], None] | None = None
                  ) -> tuple[Any, ReceivedEventer | None]:
    """The consumer to build Celery's strategy with, and the :class:`ReceivedEventer` it
    sends through (kept while the consumer's dispatcher is the same; a new one after a
    reconnect made a new dispatcher). ``on_request(request)``: called with each request
    the strategy hands over for a process."""
    dispatcher = getattr(consumer, "event_dispatcher", None)
    if dispatcher is None:
        if on_request is None:
            return consumer, received
        return ConsumerView(consumer, None, on_request), received
    if received is None or received.dispatcher is not dispatcher:
        received = ReceivedEventer(dispatcher)
    return ConsumerView(consumer, received, on_request), received


@contextlib.contextmanager
def handing(received: ReceivedEventer | None, claim: LocalClaim) -> Iterator[None]:
    """While Celery's strategy creates ``claim``'s request (and sends ``task-received``)."""
    if received is None:
        yield
        return
    received.claim = claim
    try:
        yield
    finally:
        received.claim = None


class WorkerEvents:
    """Sends a worker's events through its consumer's dispatcher (see the module's rules)."""

    def __init__(self, hostname: str, loop: Callable[[], LoopCaller],
                 consumer: Callable[[], Any]) -> None:
        self.hostname = hostname
        self._loop = loop
        self._consumer = consumer
        self._warned: set[str] = set()
        self._no_wait_until = 0.0

    def dispatcher(self) -> Any:
        """The consumer's dispatcher if it sends events now, else None."""
        dispatcher = getattr(self._consumer(), "event_dispatcher", None)
        if dispatcher is None or not getattr(dispatcher, "enabled", False):
            return None
        return dispatcher

    def emit(self, event: str, *, hostname: str | None = None, wait: float = 0.0,
             **fields: Any) -> None:
        """Send ``event`` from any thread (on the loop), as ``hostname`` (default: this
        worker). With ``wait``, block up to that many seconds until it was handed to the
        broker: Recover sends a lost attempt's end before it re-publishes the task, so a
        receiver sees it before the new attempt's events."""
        if self.dispatcher() is None:
            return
        sent = threading.Event()

        def send() -> None:
            try:
                self._send(event, hostname or self.hostname, fields, flush=wait > 0)
            finally:
                sent.set()
        self._loop().call(send)
        if wait <= 0 or time.monotonic() < self._no_wait_until:
            return
        if not sent.wait(wait):
            # The loop is busy or stuck (a broker reconnect): Recover's batch must not
            # wait that long for every task in it. It stops waiting for a while.
            self._no_wait_until = time.monotonic() + NO_WAIT
            logger.debug("pulse: %s event not sent within %gs: not waiting for events "
                         "for %gs", event, wait, NO_WAIT)

    def _send(self, event: str, hostname: str, fields: dict[str, Any], flush: bool) -> None:
        dispatcher = self.dispatcher()
        if dispatcher is None:
            return
        own = dispatcher.hostname
        try:
            dispatcher.hostname = hostname  # read by send() as it builds the event
            try:
                dispatcher.send(event, **fields)
            finally:
                dispatcher.hostname = own
            if flush:  # task events are buffered until the loop's next turn
                dispatcher.flush()
        except Exception as exc:
            if event in self._warned:
                logger.debug("pulse: could not send %s event", event, exc_info=True)
            else:
                self._warned.add(event)
                logger.warning("pulse: could not send %s event (%r); further failures of "
                               "this event type are logged at DEBUG", event, exc)
