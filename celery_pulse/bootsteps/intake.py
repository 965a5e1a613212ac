"""Reservation at receipt: the claim row, not the broker, owns a task once it is acked.

Per delivery (on the consumer loop):

1. a task we already hold locally (same or older ``retries``) is a duplicate;
2. otherwise the reservation is queued for the next group commit, and the message
   stays unacknowledged meanwhile;
3. granted -> ack, then hand the message to Celery's own strategy (with no-op
   ack/reject, since it is acked already); refused -> ack and drop (duplicate,
   finished, or budget spent); store unreachable -> no ack, stop consuming, retry.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from celery_pulse.bootsteps.loop import LoopCaller
from celery_pulse.errors import PulseError
from celery_pulse.leases import LOST
from celery_pulse.store.base import Grant, Message, Refusal, ReserveRequest

logger = logging.getLogger(__name__)

_DROP_PROPERTIES = ("delivery_tag", "delivery_info", "body_encoding")
#: The consume gate's reason while over the prefetch limit (brokers without holding).
PREFETCH_LIMIT = "prefetch limit"


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def capture(message: Any) -> Message:
    """The message as delivered, byte-exact, minus delivery-specific bits."""
    properties = {k: v for k, v in (message.properties or {}).items()
                  if k not in _DROP_PROPERTIES}
    delivery = {k: v for k, v in (message.delivery_info or {}).items()
                if k in ("exchange", "routing_key", "priority", "redelivered")}
    body = message.body
    if isinstance(body, str):
        body = body.encode(message.content_encoding or "utf-8")
    return Message(body, dict(message.headers or {}), properties, delivery,
                   message.content_type or "", message.content_encoding or "")


def policy_for(task: Any, default: str | None) -> str:
    """``pulse_on_lost`` of the task, else the setting, else by acks_late/idempotent."""
    explicit = getattr(task, "pulse_on_lost", None) or default
    if explicit:
        return str(explicit)
    if getattr(task, "acks_late", False) or getattr(task, "pulse_idempotent", False):
        return "redispatch"
    return "review"


class Intake:
    """Wraps Celery's strategy for each task type of one consumer."""

    def __init__(self, pulse: Any, consumer: Any) -> None:
        self.pulse = pulse
        self.consumer = consumer
        self.keeper = pulse.keeper
        self.loop: LoopCaller = pulse.loop
        self.pending = 0
        #: Deliveries over the prefetch limit, not acknowledged, in arrival order.
        self.waiting: collections.deque[tuple[Any, ...]] = collections.deque()
        self._store_down = False
        self._backoff = 0.1
        self._hold: bool | None = None
        #: Consumption paused at the prefetch limit (brokers where deliveries aren't held).
        self.paused_at_limit = False

    def wrap(self, task: Any, inner: Callable[..., Any]) -> Callable[..., Any]:
        settings = self.pulse.settings
        policy = policy_for(task, settings.on_lost)
        max_attempts = int(getattr(task, "pulse_max_attempts", None) or settings.max_attempts)

        def handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                    admitted: bool = False, **kwargs: Any) -> None:
            headers = message.headers or {}
            task_id = headers.get("id")
            if not task_id:  # task protocol 1: not leased
                return inner(message, body, ack, reject, callbacks, **kwargs)  # type: ignore[no-any-return]
            retries = int(headers.get("retries") or 0)
            local = self.keeper.get(task_id)
            if local is not None and local.state != LOST:
                if retries <= local.retries:
                    message.ack()
                    self.pulse.duplicate(task_id, task.name, self.keeper.holder, local.epoch,
                                         "already held by this worker")
                    return None
                # A retry of a task we still run: wait until that attempt completes.
                self.loop.later(0.2, handler, message, body, ack, reject, callbacks)
                return None
            if not admitted and (self.waiting or self._over_prefetch_limit(headers)):
                if self._holds_over_limit():
                    # Keep it unacknowledged (the broker still owns it) until a
                    # reservation starts. Unacked deliveries count against the broker's
                    # own prefetch limit (basic.qos), so the broker stops sending by
                    # itself: no consumer toggling per task.
                    self.waiting.append((handler, message, body, ack, reject, callbacks))
                    return None
                # This broker would keep an unacknowledged delivery of a killed worker
                # until its visibility timeout: reserve it (a little over the limit)
                # and stop consuming until there is room again.
                self.paused_at_limit = True
                self.pulse.gate.close(PREFETCH_LIMIT)
            request = ReserveRequest(task_id, task.name, capture(message), policy,
                                     max_attempts, retries)
            self.pending += 1

            def on_result(result: Any, sent: float) -> None:
                self.loop.call(self._settle, result, sent, request, message, body, callbacks,
                               inner, handler)

            if self.loop.hub is None:
                self._reserve_blocking(request, on_result)
            else:
                self.keeper.submit_reserve(request, on_result)
            return None

        return handler

    def drain_waiting(self) -> None:
        """Reserve held deliveries while there is room under the prefetch limit."""
        while self.waiting and not self._over_prefetch_limit({}):
            handler, *args = self.waiting.popleft()
            handler(*args, admitted=True)

    def reopen_if_room(self) -> None:
        """Resume consuming (paused at the prefetch limit) once there is room."""
        if not self._over_prefetch_limit({}):
            self.paused_at_limit = False
            self.pulse.gate.open(PREFETCH_LIMIT)

    def _holds_over_limit(self) -> bool:
        """Whether deliveries over the prefetch limit may wait unacknowledged.

        Only where the broker gives a dead connection's unacknowledged messages back at
        once (AMQP). Redis keeps them until ``visibility_timeout`` (an hour by default),
        so there a held delivery of a SIGKILLed worker would be as good as lost.
        """
        if self._hold is None:
            connection = getattr(self.consumer, "connection", None)
            transport = getattr(connection, "transport", None)
            self._hold = getattr(transport, "driver_type", None) == "amqp"
        return self._hold

    def requeue_waiting(self) -> int:
        """Consumption stopped (fenced, draining, store down): give held deliveries back.

        They were never acknowledged or reserved; requeued, another worker takes them
        instead of them waiting here until this one resumes.
        """
        requeued = 0
        while self.waiting:
            _handler, message, *_rest = self.waiting.popleft()
            try:
                message.reject(requeue=True)
                requeued += 1
            except Exception as exc:  # the channel is gone: the broker redelivers anyway
                logger.debug("pulse: could not requeue a held delivery: %r", exc)
        if requeued:
            logger.warning("pulse: gave %d held delivery(ies) back to the broker", requeued)
        return requeued

    def forget_waiting(self) -> int:
        """After a broker reconnect: their delivery tags are dead; the broker resends them."""
        dropped = len(self.waiting)
        self.waiting.clear()
        return dropped

    def _over_prefetch_limit(self, headers: Any) -> bool:
        """True when reserving one more would exceed ``prefetch multiplier x concurrency``.

        ETA/countdown tasks do not count (as in Celery).
        """
        limit = int(self.pulse.prefetch_limit or 0)
        if not limit or headers.get("eta"):
            return False
        waiting: int = self.keeper.unstarted() + self.pending
        return waiting >= limit

    def _reserve_blocking(self, request: ReserveRequest,
                          on_result: Callable[[Any, float], None]) -> None:
        """Without an event loop: reserve inline (backpressure by blocking the consumer)."""
        import time

        while True:
            try:
                results, sent = self.keeper.reserve_now([request])
                on_result(results[0], sent)
                return
            except PulseError as exc:
                self._store_error(exc)
                if self.pulse.stopping:
                    return
                time.sleep(self._backoff)

    def _store_error(self, exc: PulseError) -> None:
        if not self._store_down:
            self._store_down = True
            logger.error("pulse: cannot reserve tasks (%s): not acknowledging, "
                         "pausing consumption until the store answers", exc)
            self.pulse.gate.close("store unreachable")
        self._backoff = min(self._backoff * 2, 2.0)

    def _store_ok(self) -> None:
        self._backoff = 0.1
        if self._store_down:
            self._store_down = False
            logger.warning("pulse: store reachable again: reserving")
            self.pulse.gate.open("store unreachable")

    def _settle(self, result: Any, sent: float, request: ReserveRequest, message: Any,
                body: Any, callbacks: Any, inner: Callable[..., Any],
                handler: Callable[..., Any]) -> None:
        """On the loop thread: act on the reservation's outcome."""
        self.pending -= 1
        try:
            if isinstance(result, Grant):
                self._store_ok()
                scheduled = bool((message.headers or {}).get("eta"))
                self.keeper.add(result, sent, request.retries, scheduled,
                                start_in_background=request.policy == "redispatch")
                self.keeper.counters.reserved += 1
                self.pulse.ack(message)
                inner(message, body, _noop, _noop, callbacks)
            elif isinstance(result, Refusal):
                self._store_ok()
                self._refused(result, request, message, body, callbacks, handler)
            else:
                self._store_error(result if isinstance(result, PulseError)
                                  else PulseError(str(result)))
                if self.loop.hub is not None:
                    self.loop.later(self._backoff, handler, message, body, None, None, callbacks)
        finally:
            self.pulse.admit_waiting()

    def _refused(self, refusal: Refusal, request: ReserveRequest, message: Any, body: Any,
                 callbacks: Any, handler: Callable[..., Any]) -> None:
        if refusal.reason == "taken" and request.retries > refusal.retries:
            # A retry published while the previous attempt is still finishing.
            self.loop.later(0.25, handler, message, body, None, None, callbacks)
            return
        self.pulse.ack(message)
        if refusal.reason == "exhausted":
            self.pulse.exhausted(request.task_id, request.task_name)
            return
        what = "already finished" if refusal.reason == "terminal" else "held by another worker"
        self.pulse.duplicate(request.task_id, request.task_name, refusal.holder, refusal.epoch,
                             f"{what} ({refusal.state})")
