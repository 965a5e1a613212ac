"""Reservation at receipt: the claim row, not the broker, owns a task once it is acked.

Per delivery (on the consumer loop):

1. a delivery of a task id whose reservation is in flight waits for that one to
   settle (one holder never asks twice for one task);
2. a task we already hold locally is a duplicate if it is the same publication
   (``pulse_pub`` header; without one: same or older ``retries``); a new publication
   (a retry, ``Task.replace``, an id sent again) waits until that attempt has ended
   (:mod:`.end_waiters`);
3. otherwise the reservation is queued for the next group commit, and the message
   stays unacknowledged meanwhile;
4. granted -> ack, then hand the message to Celery's own strategy with ``ack`` and
   ``reject`` bound to the claim (:class:`~.verdict.CeleryVerdict`): they tell pulse
   how Celery ended the request (:mod:`.exits`); refused -> ack and drop (duplicate,
   finished, or budget spent), or wait for a live attempt of another publication to
   end; store unreachable -> no ack, stop consuming, retry (:mod:`.store_health`).

What the intake needs of the worker is :class:`~.ports.WorkerForIntake`.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

from celery_pulse.errors import Contended, PulseError, Unstorable
from celery_pulse.leases import LocalClaim
from celery_pulse.messages import capture, mark_redelivered, policy_for, publication_of
from celery_pulse.store.base import Grant, Refusal, ReserveRequest
from celery_pulse.worker import screen
from celery_pulse.worker.end_waiters import EndWaiters
from celery_pulse.worker.events import ReceivedEventer, handing, strategy_view
from celery_pulse.worker.gate import ConsumeGate
from celery_pulse.worker.loop import LoopCaller
from celery_pulse.worker.ports import WorkerForIntake
from celery_pulse.worker.store_health import (
    CONTENDED_RETRY,
    StoreHealth,
    count_contention,
    reserve_blocking,
)
from celery_pulse.worker.verdict import CeleryVerdict, bound_claim

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.intake")

#: The consume gate's reason while over the prefetch limit (brokers without holding).
PREFETCH_LIMIT = "prefetch limit"


class Intake:
    """Wraps Celery's strategy for each task type of one consumer."""

    def __init__(self, pulse: WorkerForIntake, consumer: Any) -> None:
        self.pulse = pulse
        self.consumer = consumer
        self.keeper = pulse.keeper
        self.loop: LoopCaller = pulse.loop
        self.pending = 0
        self._semaphore: Any = None
        #: Task ids whose reservation is in flight -> deliveries of the same id that
        #: arrived meanwhile (decided once it settles).
        self.inflight: dict[str, list[tuple[Any, ...]]] = {}
        #: Task ids held locally -> deliveries of a new publication waiting for the end.
        self.waiting_for_end = EndWaiters(self.loop)
        #: Deliveries over the prefetch limit, not acknowledged, in arrival order.
        self.waiting: collections.deque[tuple[Any, ...]] = collections.deque()
        self.health = StoreHealth(lambda: self.gate)
        self._hold: bool | None = None
        #: Consumption paused at the prefetch limit (brokers where deliveries aren't held).
        self.paused_at_limit = False
        self._max_bytes = screen.BodyLimit(lambda: self.keeper.store.max_message_bytes())
        self.received: ReceivedEventer | None = None  # for task-received (.events)

    def wrap(self, task: Any, inner: Callable[..., Any]) -> Callable[..., Any]:
        settings = self.pulse.settings
        policy = policy_for(task, settings.on_lost)
        max_attempts = int(getattr(task, "pulse_max_attempts", None) or settings.max_attempts)
        # A rate-limited task may wait in Celery's token bucket after it is granted:
        # its start is never folded into the reservation.
        may_fold = not (getattr(task, "rate_limit", None)
                        and not getattr(self.consumer, "disable_rate_limits", False))
        bad_name = screen.name_problem(task.name)
        if bad_name:
            logger.error("pulse: task %.80s... can't be leased (%s): its deliveries will be "
                         "rejected", task.name, bad_name)

        def handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                    admitted: bool = False, **kwargs: Any) -> None:
            try:
                return leased(message, body, ack, reject, callbacks, admitted, **kwargs)
            except Exception as exc:  # a bug met by one delivery: never the worker's end
                if getattr(message, "acknowledged", False):
                    logger.exception("pulse: intake failed on a settled delivery of %s",
                                     task.name)
                else:
                    logger.debug("pulse: intake failed on a delivery", exc_info=True)
                    self._rejected(message, task.name, f"pulse could not take it: {exc!r:.200}")
                return None

        def leased(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                   admitted: bool = False, **kwargs: Any) -> None:
            headers = message.headers
            if isinstance(headers, dict) and "id" not in headers and "task" not in headers:
                # Task protocol 1 (the id is in the body): not leased, Celery's own.
                return inner(message, body, ack, reject, callbacks, **kwargs)  # type: ignore[no-any-return]
            why = bad_name or screen.problem(headers, screen.body_size(message),
                                             self._max_bytes())
            if why:
                self._rejected(message, task.name, why)
                return None
            task_id = headers["id"]
            retries = int(headers.get("retries") or 0)
            publication = publication_of(headers)
            if task_id in self.inflight:
                self.inflight[task_id].append((message, body, None, None, callbacks))
                return None
            local = self.keeper.get(task_id)
            # Only a live local lease decides here: one past its deadline may already be
            # re-dispatched by Recover (after a pause, this delivery can be that copy),
            # so the store decides instead.
            if local is not None and self.keeper.is_live(local):
                if (local.publication == publication if publication
                        else retries <= local.retries):
                    self.pulse.ack(message)
                    self.pulse.duplicate(task_id, task.name, self.keeper.holder, local.epoch,
                                         "already held by this worker")
                    return None
                # A new publication of a task we still hold (a retry, a replacement):
                # it runs once that attempt has ended.
                self.waiting_for_end.park(task_id, handler, (message, body, None, None, callbacks))
                return None
            if not admitted and (self.waiting or self._over_prefetch_limit(headers)):
                if self._holds_over_limit():
                    if not self.gate.is_open:
                        # Paused (fenced, draining, store down): those held went back to
                        # the broker when it paused; so does one that came after.
                        if self._give_back(message):
                            logger.warning("pulse: gave a delivery back to the broker "
                                           "(consumption paused)")
                        return None
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
                self.gate.close(PREFETCH_LIMIT)
            # A limited task starts with its permits: folded into its reservation with
            # them when a process is free (if the store can, .ahead), else started ahead
            # with them only when no process is free for it.
            routing_key = (message.delivery_info or {}).get("routing_key")
            limited = bool(self.pulse.rules.declared
                           and self.pulse.rules.limited(task, routing_key))
            may_wait = bool(may_fold and not headers.get("eta") and self.loop.hub is not None)
            free = may_wait and self._free_process()
            permits = self.pulse.ahead.fold_limited(free, self.pulse.rules.fixed_needs(
                task, routing_key)) if limited and may_wait and self.keeper.store.folds_permits else ()
            start = may_wait and (bool(permits) if limited else self.pulse.ahead.fold(free))
            may_wait = may_wait and not (limited and free and not permits)
            request = ReserveRequest(task_id, task.name, capture(message), policy,
                                     max_attempts, retries, publication, start, permits)
            # Lingering for company pays only under load: the first of a burst goes at
            # once, like one a free process waits for; the rest batch up behind it (on
            # SQLite the first too, while the processes have jobs started ahead).
            urgent = free or not (self.pending or self.pulse.ahead.lingers())
            self.pending += 1
            self.inflight[task_id] = []

            def on_result(result: Any, sent: float) -> None:
                self.loop.call(self._settle, result, sent, request, message, body, callbacks,
                               inner, handler, may_wait, limited)

            if self.loop.hub is None:
                reserve_blocking(self.keeper, request, on_result, self.health,
                                 lambda: self.pulse.stopping)
            else:
                self.keeper.submit_reserve(request, on_result, urgent=urgent)
            return None

        return handler

    def strategy_consumer(self) -> Any:
        """The consumer Celery's strategy is built with (:func:`.events.strategy_view`)."""
        view, self.received = strategy_view(
            self.consumer, self.received,
            self.request_made if self.pulse.rules.declared else None)
        return view

    def request_made(self, request: Any) -> None:
        """Celery made a leased request and queues it for a process: its permits are
        decided now (the pool would, later), so it can be started ahead with them."""
        claim = bound_claim(request)
        if claim is not None and claim.permits is None:
            claim.permits = self.pulse.permits(request)

    @property
    def gate(self) -> ConsumeGate:
        """The consumer's gate (the worker binds it before it builds an intake)."""
        gate = self.pulse.gate
        if gate is None:
            raise RuntimeError("pulse: the intake runs before its worker was bound")
        return gate

    def claim_ended(self, task_id: str) -> None:
        """On the loop: an attempt of ``task_id`` held here ended; look at its waiters."""
        self.waiting_for_end.ended(task_id)

    def drain_waiting(self) -> None:
        """Reserve held deliveries while there is room under the prefetch limit."""
        while self.waiting and not self._over_prefetch_limit({}):
            handler, *args = self.waiting.popleft()
            handler(*args, admitted=True)

    def reopen_if_room(self) -> None:
        """Resume consuming (paused at the prefetch limit) once there is room."""
        if not self._over_prefetch_limit({}):
            self.paused_at_limit = False
            self.gate.open(PREFETCH_LIMIT)

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
            requeued += self._give_back(message)
        if requeued:
            logger.warning("pulse: gave %d held delivery(ies) back to the broker", requeued)
        return requeued

    def forget_waiting(self) -> int:
        """After a broker reconnect: their delivery tags are dead; the broker resends them."""
        dropped = len(self.waiting)
        self.waiting.clear()
        dropped += self.waiting_for_end.forget()
        for task_id in self.inflight:
            dropped += len(self.inflight[task_id])
            self.inflight[task_id] = []
        return dropped

    def _free_process(self) -> bool:
        """Whether a pool process is free for one more job once its grant is back.

        Then the reservation is granted as running at once (the start folded into it):
        Celery's strategy hands the request to the pool within the same loop turn as
        the grant, through the worker's semaphore (one permit per pool process). Only
        with the event loop; a job that would wait is reserved and started later.
        """
        if self.loop.hub is None:
            return False
        if self._semaphore is None:
            controller = getattr(self.consumer, "controller", None)
            self._semaphore = getattr(controller, "semaphore", None) or False
        if self._semaphore is False:
            return False
        free: int = self._semaphore.value - len(getattr(self._semaphore, "_waiting", ()))
        return bool(free > self.pulse.ahead.folding)

    def _over_prefetch_limit(self, headers: Any) -> bool:
        """True when reserving one more would exceed ``prefetch multiplier x concurrency``.

        ETA/countdown tasks do not count (as in Celery).
        """
        limit = int(self.pulse.prefetch_limit or 0)
        if not limit or headers.get("eta"):
            return False
        # Tasks waiting for a concurrency permit don't hold back the others (up to
        # ``pulse_permit_backlog`` of them).
        waiting: int = (self.keeper.unstarted() + self.pending
                        - self.pulse.waiting_for_permits())
        return waiting >= limit

    def _settle(self, result: Any, sent: float, request: ReserveRequest, message: Any,
                body: Any, callbacks: Any, inner: Callable[..., Any],
                handler: Callable[..., Any], may_wait: bool = False,
                limited: bool = False) -> None:
        """On the loop thread: act on the reservation's outcome."""
        self.pending -= 1
        same_id = self.inflight.pop(request.task_id, [])
        claim: LocalClaim | None = None
        try:
            if isinstance(result, Grant):
                self.health.answered()
                scheduled = bool((message.headers or {}).get("eta"))
                claim = self.keeper.add(result, sent, request.retries, scheduled,
                                        start_in_background=request.policy == "redispatch",
                                        publication=request.publication,
                                        message=request.message)
                self.keeper.counters.reserved += 1
                self.pulse.ack(message)
                if result.attempts > 1:
                    # A later attempt of this publication (requeued or recovered): it was
                    # delivered before, as a broker's requeue would say.
                    mark_redelivered(message)
                self._hand_to_celery(claim, inner, message, body, callbacks)
            elif isinstance(result, Refusal):
                self.health.answered()
                self._refused(result, request, message, body, callbacks, handler)
            elif isinstance(result, Unstorable):
                self.health.answered()  # the store answered: about this delivery alone
                self._rejected(message, request.task_name, result.message)
            elif isinstance(result, Contended):
                count_contention(self.keeper.counters, request, result)
                self._again(CONTENDED_RETRY, handler, message, body, callbacks)
            else:
                self.health.failed(result if isinstance(result, PulseError)
                                   else PulseError(str(result)))
                if self.loop.hub is not None:
                    self._again(self.health.backoff, handler, message, body, callbacks)
        finally:
            # A limited claim goes ahead only with its permits decided (as Celery made its
            # request: :meth:`request_made`); never started ahead without them.
            self.pulse.ahead.settled(claim, request.start, may_wait and claim is not None
                                     and not claim.scheduled
                                     and (not limited or claim.permits is not None),
                                     request.permits, isinstance(result, Grant) and result.started)
            for args in same_id:  # now decided against the settled reservation
                self.loop.call(handler, *args)
            self.pulse.admit_waiting()

    def _again(self, delay: float, handler: Callable[..., Any], message: Any, body: Any,
               callbacks: Any) -> None:
        """Reserve an admitted delivery again after ``delay``, as admitted: it counted
        under the prefetch limit already. Held back over the limit instead, the retry that
        would tell the store is back could wait behind a paused consumer for good."""
        self.loop.later(delay, functools.partial(handler, admitted=True), message, body,
                        None, None, callbacks)

    def _rejected(self, message: Any, task_name: str, why: str) -> None:
        """Settle a delivery nobody will run (see :mod:`.screen`), and count it."""
        self.keeper.counters.rejected += 1
        screen.reject(message, task_name, why)

    @staticmethod
    def _give_back(message: Any) -> bool:
        """Requeue an unacknowledged delivery; whether the broker took it back."""
        try:
            message.reject(requeue=True)
        except Exception as exc:  # the channel is gone: the broker redelivers anyway
            logger.debug("pulse: could not requeue a held delivery: %r", exc)
            return False
        return True

    def _hand_to_celery(self, claim: LocalClaim, inner: Callable[..., Any], message: Any,
                        body: Any, callbacks: Any) -> None:
        """Celery's own strategy, with ack/reject bound to the claim.

        If the strategy raises (an invalid message, a bad header), Celery will never run
        the request: the claim ends ``failed`` instead of being renewed forever.
        """
        exits = self.pulse.exits
        try:
            with handing(self.received, claim):  # its task-received carries the attempt
                inner(message, body, CeleryVerdict(exits, claim, "ack", self.consumer),
                      CeleryVerdict(exits, claim, "reject", self.consumer), callbacks)
        except Exception as exc:
            exits.refused_by_strategy(claim, exc)

    def _refused(self, refusal: Refusal, request: ReserveRequest, message: Any, body: Any,
                 callbacks: Any, handler: Callable[..., Any]) -> None:
        newer = (request.publication != refusal.publication if request.publication
                 else request.retries > refusal.retries)
        if refusal.reason == "taken" and newer:
            # A new publication (a retry, a replacement, an id sent again) while an
            # attempt of the previous one is still live: it runs once that one ends.
            self._again(0.25, handler, message, body, callbacks)
            return
        self.pulse.ack(message)
        if refusal.reason == "exhausted":
            self.pulse.exhausted(request.task_id, request.task_name)
            return
        what = "already finished" if refusal.reason == "terminal" else "held by another worker"
        self.pulse.duplicate(request.task_id, request.task_name, refusal.holder, refusal.epoch,
                             f"{what} ({refusal.state})")
