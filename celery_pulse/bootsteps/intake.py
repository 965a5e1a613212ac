"""Reservation at receipt: the claim row, not the broker, owns a task once it is acked.

Per delivery (on the consumer loop):

1. a delivery of a task id whose reservation is in flight waits for that one to
   settle (one holder never asks twice for one task);
2. a task we already hold locally is a duplicate if it is the same publication
   (``pulse_pub`` header; without one: same or older ``retries``); a new publication
   (a retry, ``Task.replace``, an id sent again) waits until that attempt has ended;
3. otherwise the reservation is queued for the next group commit, and the message
   stays unacknowledged meanwhile;
4. granted -> ack, then hand the message to Celery's own strategy with ``ack`` and
   ``reject`` bound to the claim (:class:`CeleryVerdict`): they tell pulse how Celery
   ended the request (dropped as revoked or expired, rejected, requeued); refused ->
   ack and drop (duplicate, finished, or budget spent), or wait for a live attempt of
   another publication to end; store unreachable -> no ack, stop consuming, retry.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

from celery_pulse.bootsteps import screen
from celery_pulse.bootsteps.loop import LoopCaller
from celery_pulse.errors import Contended, PulseError, Unstorable
from celery_pulse.leases import LocalClaim
from celery_pulse.store.base import FAILED, Grant, Message, Refusal, ReserveRequest

logger = logging.getLogger(__name__)

_DROP_PROPERTIES = ("delivery_tag", "delivery_info", "body_encoding")
#: The consume gate's reason while over the prefetch limit (brokers without holding).
PREFETCH_LIMIT = "prefetch limit"
#: Message header naming the publication (stamped by pulse's ``before_task_publish``).
PUBLICATION_HEADER = "pulse_pub"
#: Header a publisher sets to choose the publication itself (a beat slot: its copies
#: published by two leaders are one publication). The stamp moves it to
#: ``PUBLICATION_HEADER``, so a retry that copies the request's headers doesn't keep it.
FIXED_PUBLICATION_HEADER = "pulse_pub_fixed"
#: A delivery waiting for an attempt of its task id to end looks again this often
#: (seconds), in case no end is reported (the end normally wakes it at once).
WAIT_POLL = 1.0
#: Seconds before a delivery whose reservation met contention is reserved again. The
#: store already retried it (other workers held its rows meanwhile): not an outage, so
#: consumption goes on and this one delivery waits a little.
CONTENDED_RETRY = 0.05


class CeleryVerdict:
    """Celery's ``on_ack``/``on_reject`` for one leased request, bound to its claim.

    The message was acknowledged at reservation; what Celery says here is how it ends
    the request: an ``ack`` before the job reached the pool means Celery dropped it
    (revoked or expired), a ``reject`` says requeue or drop. The pool also finds the
    claim of a request here (``bound_claim``), never by task id alone.
    """

    __slots__ = ("claim", "kind", "pulse")

    def __init__(self, pulse: Any, claim: LocalClaim, kind: str) -> None:
        self.pulse = pulse
        self.claim = claim
        self.kind = kind

    def __call__(self, _logger: Any = None, _errors: Any = None, requeue: bool = False) -> None:
        self.pulse.celery_verdict(self.claim, self.kind, requeue)


def bound_claim(request: Any) -> LocalClaim | None:
    """The claim a Celery request was created for (None: not a leased request)."""
    verdict = getattr(request, "_on_ack", None)
    return verdict.claim if isinstance(verdict, CeleryVerdict) else None


def _mark_redelivered(message: Any) -> None:
    info = getattr(message, "delivery_info", None)
    if isinstance(info, dict):
        info["redelivered"] = True


def _size(message: Any) -> int:
    body = message.body
    return len(body) if isinstance(body, (bytes, bytearray, str)) else 0


def publication_of(headers: Any) -> str | None:
    value = headers.get(PUBLICATION_HEADER) or headers.get(FIXED_PUBLICATION_HEADER)
    return str(value)[:64] if value else None


class _Waiting:
    """A delivery parked until an attempt of its task id ends (fired once)."""

    __slots__ = ("args", "fired", "handler")

    def __init__(self, handler: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.handler = handler
        self.args = args
        self.fired = False


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
        self._semaphore: Any = None
        #: Task ids whose reservation is in flight -> deliveries of the same id that
        #: arrived meanwhile (decided once it settles).
        self.inflight: dict[str, list[tuple[Any, ...]]] = {}
        #: Task ids held locally -> deliveries of a new publication waiting for the end.
        self.waiting_for_end: dict[str, list[_Waiting]] = {}
        #: Deliveries over the prefetch limit, not acknowledged, in arrival order.
        self.waiting: collections.deque[tuple[Any, ...]] = collections.deque()
        self._store_down = False
        self._backoff = 0.1
        self._hold: bool | None = None
        #: Consumption paused at the prefetch limit (brokers where deliveries aren't held).
        self.paused_at_limit = False
        self._body_limit: tuple[int | None] | None = None

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
            why = bad_name or screen.problem(headers, _size(message), self._max_bytes())
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
                self._wait_for_end(task_id, handler, (message, body, None, None, callbacks))
                return None
            if not admitted and (self.waiting or self._over_prefetch_limit(headers)):
                if self._holds_over_limit():
                    if not self.pulse.gate.is_open:
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
                self.pulse.gate.close(PREFETCH_LIMIT)
            # A task under a concurrency limit starts only once it has its permits: never
            # folded into its reservation, nor started ahead of the pool.
            routing_key = (message.delivery_info or {}).get("routing_key")
            may_wait = bool(may_fold and not headers.get("eta") and self.loop.hub is not None
                            and not self.pulse.rules.limited(task, routing_key))
            free = may_wait and self._free_process()
            start = may_wait and bool(self.pulse.ahead.fold(free))
            request = ReserveRequest(task_id, task.name, capture(message), policy,
                                     max_attempts, retries, publication, start)
            # Lingering for company pays only under load: the first of a burst goes at
            # once, like one a free process waits for; the rest batch up behind it.
            urgent = free or not self.pending
            self.pending += 1
            self.inflight[task_id] = []

            def on_result(result: Any, sent: float) -> None:
                self.loop.call(self._settle, result, sent, request, message, body, callbacks,
                               inner, handler, may_wait)

            if self.loop.hub is None:
                self._reserve_blocking(request, on_result)
            else:
                self.keeper.submit_reserve(request, on_result, urgent=urgent)
            return None

        return handler

    def _wait_for_end(self, task_id: str, handler: Callable[..., Any],
                      args: tuple[Any, ...]) -> None:
        entry = _Waiting(handler, args)
        self.waiting_for_end.setdefault(task_id, []).append(entry)
        self.loop.later(WAIT_POLL, self._fire, task_id, entry)

    def claim_ended(self, task_id: str) -> None:
        """On the loop: an attempt of ``task_id`` held here ended; look at its waiters.

        Without a hub (Celery's synchronous loop) this may be called from a pool or store
        thread: the waiters' own poll (``WAIT_POLL``) picks them up instead.
        """
        if self.loop.hub is None:
            return
        for entry in self.waiting_for_end.pop(task_id, []):
            self._fire(task_id, entry)

    def _fire(self, task_id: str, entry: _Waiting) -> None:
        if entry.fired:
            return
        entry.fired = True
        waiters = self.waiting_for_end.get(task_id)
        if waiters is not None:
            waiters[:] = [w for w in waiters if w is not entry]
            if not waiters:
                del self.waiting_for_end[task_id]
        entry.handler(*entry.args)

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
            requeued += self._give_back(message)
        if requeued:
            logger.warning("pulse: gave %d held delivery(ies) back to the broker", requeued)
        return requeued

    def forget_waiting(self) -> int:
        """After a broker reconnect: their delivery tags are dead; the broker resends them."""
        dropped = len(self.waiting)
        self.waiting.clear()
        for entries in self.waiting_for_end.values():
            for entry in entries:
                entry.fired = True
                dropped += 1
        self.waiting_for_end.clear()
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

    def _reserve_blocking(self, request: ReserveRequest,
                          on_result: Callable[[Any, float], None]) -> None:
        """Without an event loop: reserve inline (backpressure by blocking the consumer)."""
        import time

        while True:
            try:
                results, sent = self.keeper.reserve_now([request])
                on_result(results[0], sent)
                return
            except Contended as exc:
                self._contended(request, exc)
                if self.pulse.stopping:
                    return
                time.sleep(CONTENDED_RETRY)
                continue
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

    def _contended(self, request: ReserveRequest, exc: Contended) -> None:
        self.keeper.counters.contended += 1
        logger.warning("pulse: reserving %s[%s] met contention in the store, trying again: "
                       "%s", request.task_name, request.task_id, exc)

    def _store_ok(self) -> None:
        self._backoff = 0.1
        if self._store_down:
            self._store_down = False
            logger.warning("pulse: store reachable again: reserving")
            self.pulse.gate.open("store unreachable")

    def _settle(self, result: Any, sent: float, request: ReserveRequest, message: Any,
                body: Any, callbacks: Any, inner: Callable[..., Any],
                handler: Callable[..., Any], may_wait: bool = False) -> None:
        """On the loop thread: act on the reservation's outcome."""
        self.pending -= 1
        same_id = self.inflight.pop(request.task_id, [])
        claim: LocalClaim | None = None
        try:
            if isinstance(result, Grant):
                self._store_ok()
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
                    _mark_redelivered(message)
                self._hand_to_celery(claim, inner, message, body, callbacks)
            elif isinstance(result, Refusal):
                self._store_ok()
                self._refused(result, request, message, body, callbacks, handler)
            elif isinstance(result, Unstorable):
                self._store_ok()  # the store answered: about this delivery alone
                self._rejected(message, request.task_name, result.message)
            elif isinstance(result, Contended):
                self._contended(request, result)
                self._again(CONTENDED_RETRY, handler, message, body, callbacks)
            else:
                self._store_error(result if isinstance(result, PulseError)
                                  else PulseError(str(result)))
                if self.loop.hub is not None:
                    self._again(self._backoff, handler, message, body, callbacks)
        finally:
            self.pulse.ahead.settled(claim, request.start, may_wait and claim is not None
                                     and not claim.scheduled)
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

    def _max_bytes(self) -> int | None:
        """The largest body the store keeps in one claim (the worker asked it at start:
        a store that asks the server remembers the answer)."""
        if self._body_limit is None:
            try:
                self._body_limit = (self.keeper.store.max_message_bytes(),)
            except PulseError as exc:  # asked again with the next delivery
                logger.debug("pulse: could not ask the store its message limit: %s", exc)
                return None
        return self._body_limit[0]

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
        try:
            inner(message, body, CeleryVerdict(self.pulse, claim, "ack"),
                  CeleryVerdict(self.pulse, claim, "reject"), callbacks)
        except Exception as exc:
            logger.error("pulse: Celery refused task %s (%r): failed, not run",
                         claim.task_id, exc)
            self.pulse.end_unstarted(claim, FAILED, f"refused by Celery: {exc!r}"[:500])

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
