"""The gateway's broker and store side: deliveries reserved for a remote worker, and its
start, renew and finish turned into the store's fenced operations.

The rules, before any code:

* **Reserved at receipt, as in a direct worker.** A :class:`Feeder` (one thread per
  instance that declared capacity) consumes the instance's queue and reserves each
  delivery in the store for the instance (its *holder* name) before acknowledging it to
  the broker: from then on the claim row owns the task, and the gateway dying loses
  nothing. If the store can't be reached the delivery goes back to the broker and the
  feeder waits: never unowned work.
* **Within capacity.** The broker may send a feeder as many deliveries ahead as the
  instance's declared capacity (its prefetch, as a direct worker's): those it has sent
  are reserved together while the instance has free slots (capacity minus attempts
  held), in one statement, and their attempts recorded in one more. Deliveries beyond
  the free slots wait unacknowledged for a finish to free one, at most ``HOLD_FOR``;
  then they go back to the broker and the feeder stops consuming until there is room,
  so an instance never sits for long on a task another one could run. Unacknowledged,
  they are the broker's: a feeder that stops (its instance gone) hands them back.
* **Only what it can run.** A delivery no capability of the instance covers goes back
  to the broker for one that does (:mod:`.routing`).
* **Not before its time.** A delivery with an ETA, and a new publication of a task
  whose previous attempt is still live, wait unacknowledged until due (:mod:`.waiting`).
* **Fenced by the store.** ``task.start``, ``task.renew`` and ``task.finish`` are the
  store's ``start_many``, ``renew`` and ``complete`` for the attempt's (task id, epoch,
  token): a stale attempt can't start, renew or finish; its late finish is kept as
  evidence only. ``UNKNOWN`` ends the claim in ``needs_review``.
* **Past its deadline, or revoked: ended.** A reserved delivery whose Celery ``expires``
  has passed, or whose id Celery's broadcast revoked (:mod:`.revokes`), is never
  assigned: its claim ends revoked (:mod:`.expiry`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery_pulse.errors import PulseError, StoreUnavailable
from celery_pulse.gateway.expiry import REVOKED_REASON, NeverRun, expired
from celery_pulse.gateway.frames import new_id
from celery_pulse.gateway.protocol import is_retry, is_revoke
from celery_pulse.gateway.refs import wire_task_id
from celery_pulse.gateway.routing import ELSEWHERE_AFTER, Elsewhere
from celery_pulse.gateway.session import Attempt
from celery_pulse.gateway.waiting import TAKEN_AGAIN, Waiting, eta_in, newer
from celery_pulse.messages import capture, policy_for, publication_of
from celery_pulse.store.base import (
    FAILED,
    NEEDS_REVIEW,
    RETRY,
    REVOKED,
    SUCCEEDED,
    Completion,
    Grant,
    Permit,
    Refusal,
    ReserveRequest,
    ResultRecord,
    Store,
)
from celery_pulse.store.records import LOST_TOKEN

logger = logging.getLogger(__name__)

#: How long a delivery an instance has no room for waits for a slot before it goes back
#: to the broker (a busy instance frees one within milliseconds; a full one gives it up).
HOLD_FOR = 1.0

#: A start's answer when a permit it needs is not free (still reserved, not started).
WAITING = "WAITING"

#: The protocol's outcomes, as claim outcomes.
OUTCOMES = {"SUCCEEDED": SUCCEEDED, "FAILED": FAILED, "UNKNOWN": NEEDS_REVIEW}


def claim_outcome(outcome: str, error_code: str | None) -> str:
    """A finish's outcome as the claim's: Celery's revoke is ``revoked``, its retry
    ``retry`` (open for the next attempt the finish published), not failed."""
    if is_revoke(outcome, error_code):
        return REVOKED
    return RETRY if is_retry(outcome, error_code) else OUTCOMES[outcome]


def consume_until_stopped(stop: threading.Event, consume: Callable[[], None], what: str
                          ) -> None:
    """Run ``consume`` (a broker consumer's loop) until ``stop``; when the broker goes
    away, again after a backoff (0.5 s doubling to 10 s), never spinning."""
    backoff = 0.5
    while not stop.is_set():
        try:
            consume()
            backoff = 0.5
        except Exception as exc:
            if stop.is_set():
                return
            logger.warning("pulse gateway: %s failed (%r); again in %.1fs", what, exc, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    """A delivery reserved for an instance: what ``task.assign`` carries."""

    attempt: Attempt
    message: Any  # celery_pulse.store.base.Message


class Feeder(threading.Thread):
    """Consumes one queue for one instance while it has room (see the module's rules)."""

    def __init__(self, app: Any, store: Store, holder: str, queue: str, *, lease_ttl: float,
                 on_lost: str | None, max_attempts: int, free: Callable[[], int],
                 on_assign: Callable[[Assignment], None],
                 record: Callable[[list[Attempt]], None] | None = None,
                 prefetch: int = 1, revoked: Callable[[str], bool] | None = None,
                 covers: Callable[[str], bool] | None = None, rate: float = 0.0) -> None:
        super().__init__(name=f"pulse-gateway-feeder-{queue}", daemon=True)
        self.app, self.store, self.holder, self.queue = app, store, holder, queue
        self.lease_ttl, self.on_lost, self.max_attempts = lease_ttl, on_lost, max_attempts
        self.free, self.on_assign, self.record = free, on_assign, record
        #: Deliveries the broker may send ahead (the instance's capacity): received in
        #: one drain, reserved in one statement.
        self.prefetch = prefetch
        self._batch: list[tuple[Any, ReserveRequest]] = []
        #: Held back until due: an ETA, or a new publication of a live task (.waiting).
        self._waiting = Waiting()
        self._stop = threading.Event()
        self._room = threading.Event()
        self._never_run = NeverRun(app, store, holder)
        #: Whether Celery's broadcast revoked a task id (.revokes), if heard.
        self.revoked = revoked
        #: Whether the instance's capabilities cover a task; the others go back (.routing).
        self.covers, self._elsewhere = covers, Elsewhere()
        #: At most ``rate`` dispatch rounds a second (0: no pacing); what arrives
        #: meanwhile joins the next round.
        self.pace, self._paced_until = (1.0 / rate if rate > 0 else 0.0), 0.0

    def stop(self) -> None:
        self._stop.set()
        self._room.set()

    def room(self) -> None:
        """A slot may have freed up: look again now rather than at the next poll."""
        self._room.set()

    def run(self) -> None:
        consume_until_stopped(self._stop, self._consume, f"consuming {self.queue}")

    def _consume(self) -> None:
        queue = self.app.amqp.queues[self.queue]  # declared as a Celery worker would
        with self.app.connection_for_read() as conn, conn.Consumer(
                [queue], on_message=self._on_message, accept=self.app.conf.accept_content,
                prefetch_count=max(1, self.prefetch), auto_declare=True) as consumer:
            consuming, full_since, held = True, None, 0
            while not self._stop.is_set():
                now = time.monotonic()
                self._batch.extend(self._waiting.due(now))
                for message in self._elsewhere.due(now):
                    message.requeue()  # for an instance that can run it
                if len(self._waiting) + len(self._elsewhere) != held:  # held ones don't
                    held = len(self._waiting) + len(self._elsewhere)  # take the room
                    consumer.qos(prefetch_count=max(1, self.prefetch) + held)
                if self._batch:
                    room = self.free()
                    if room > 0:
                        full_since = None
                        early = self._paced_until - time.monotonic()
                        if early > 0:  # paced: the batch grows until the round is due
                            self._stop.wait(early)
                            self._drain_ready(conn)
                            continue
                        self._flush(room)
                        self._paced_until = time.monotonic() + self.pace
                        continue
                    # Full: what was received waits, unacknowledged, for a finish to
                    # free a slot (room() wakes this at once), but not for long: held
                    # past HOLD_FOR it goes back, and consuming stops until there is room.
                    full_since = full_since or time.monotonic()
                    if time.monotonic() - full_since > HOLD_FOR:
                        for message, _ in self._batch:
                            message.requeue()
                        self._batch, full_since = [], None
                        if consuming:
                            consumer.cancel()
                            consuming = False
                        continue
                    self._room.wait(0.05)
                    self._room.clear()
                    self._drain_ready(conn)
                    continue
                if not consuming:
                    if self.free() <= 0:
                        self._room.wait(0.5)
                        self._room.clear()
                        self._drain_ready(conn)  # the connection's own frames
                        continue
                    consumer.consume()
                    consuming = True
                try:
                    conn.drain_events(timeout=self._elsewhere.wait(
                        time.monotonic(), self._waiting.wait(time.monotonic(), 0.5)))
                except TimeoutError:
                    continue
                self._drain_ready(conn)

    def _drain_ready(self, conn: Any) -> None:
        """What the broker has already sent joins the batch (no waiting); up to the
        prefetch, so the batch never outgrows what the broker may send ahead."""
        while len(self._batch) < self.prefetch:
            try:
                conn.drain_events(timeout=0)
            except TimeoutError:
                return

    def _on_message(self, message: Any) -> None:
        headers = message.headers or {}
        task_id, name = headers.get("id"), headers.get("task")
        if not task_id or not name:  # not Celery's task protocol 2: nothing to lease
            logger.error("pulse gateway: dropping a message on %s that is no Celery task "
                         "(protocol 2 headers missing)", self.queue)
            message.reject(requeue=False)
            return
        if self.covers is not None and not self.covers(name):
            self._elsewhere.hold(time.monotonic() + ELSEWHERE_AFTER, message)
            if name not in self._elsewhere.told:
                self._elsewhere.told.add(name)
                logger.warning("pulse gateway: %s on %s is not among %s's capabilities: left "
                               "to an instance that declared it", name, self.queue, self.holder)
            return
        task = self.app.tasks.get(name)
        request = ReserveRequest(
            task_id, name, capture(message), policy_for(task, self.on_lost),
            int(getattr(task, "pulse_max_attempts", None) or self.max_attempts),
            int(headers.get("retries") or 0), publication_of(headers))
        delay = eta_in(headers, self.app.timezone)
        if delay > 0:
            self._waiting.hold(time.monotonic() + delay, message, request)
        else:
            self._batch.append((message, request))

    def _flush(self, room: int) -> None:
        """Reserve as much of the batch as there is ``room`` for in one statement,
        acknowledge it, record its attempts in one more, then assign them."""
        batch, self._batch = self._batch[:room], self._batch[room:]
        sent = time.monotonic()
        try:
            # The store's exchange, not its reserve: on PostgreSQL its pipeline (one round
            # trip, prepared statements, no SQLAlchemy on the way), as a direct worker's.
            answers = self.store.exchange(self.holder, self.lease_ttl, [],
                                          [r for _, r in batch], []).reserved
        except PulseError as exc:
            # Not reserved: the broker keeps them (another worker, or this one later).
            logger.warning("pulse gateway: could not reserve %d task(s) on %s (%s); back to "
                           "the broker", len(batch), self.queue, exc)
            for message, _ in batch:
                message.requeue()
            if isinstance(exc, StoreUnavailable):
                self._stop.wait(1.0)
            return
        granted: list[Assignment] = []
        past: list[Attempt] = []  # expired: ended here, never assigned (.expiry)
        revoked: list[Attempt] = []  # likewise
        for (message, request), answer in zip(batch, answers, strict=True):
            if isinstance(answer, Refusal) and newer(request, answer):
                self._waiting.hold(time.monotonic() + TAKEN_AGAIN, message, request)
                continue
            message.ack()
            if isinstance(answer, PulseError):  # taken effect, its answer unread
                logger.warning("pulse gateway: reservation of %s[%s] not confirmed (%s): if "
                               "it took effect, its lease expires and Recover re-dispatches "
                               "it", request.task_name, request.task_id, answer)
                continue
            if not isinstance(answer, Grant):
                logger.warning("pulse gateway: duplicate delivery of %s[%s] dropped: %s "
                               "(holder %s, epoch %d)", request.task_name, request.task_id,
                               answer.reason, answer.holder, answer.epoch)
                continue
            attempt = Attempt(request.task_id, wire_task_id(request.task_id), new_id(),
                              answer.epoch, answer.token, request.task_name,
                              answer.lease_until, sent + self.lease_ttl)
            if expired(message.headers or {}, self.app.timezone):
                past.append(attempt)
            elif self.revoked is not None and self.revoked(request.task_id):
                revoked.append(attempt)
            else:
                granted.append(Assignment(attempt, request.message))
        if past:
            self._never_run.end(past)
        if revoked:
            self._never_run.end(revoked, REVOKED_REASON)
        if granted and self.record is not None:
            try:  # before they are sent: any gateway must know the attempts they name
                self.record([a.attempt for a in granted])
            except PulseError as exc:
                logger.warning("pulse gateway: could not record %d attempt(s) (%s); released "
                               "for Recover", len(granted), exc)
                self._release([a.attempt for a in granted])
                return
        for assignment in granted:
            self.on_assign(assignment)

    def _release(self, attempts: list[Attempt]) -> None:
        """Hand grants never sent back to Recover now, rather than at their expiry."""
        with contextlib.suppress(PulseError):  # else their leases expire, Recover takes them
            self.store.release(self.holder, [(a.task_id, a.epoch, a.token) for a in attempts],
                               never_ran=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One operation of a round (:mod:`.rounds`): a start, or (``build`` set) a finish,
    whose completion is built in the round's thread (the app's backend is asked there)."""

    attempt: Attempt
    build: Callable[[], tuple[Completion, bool]] | None = None
    #: A start's concurrency permits (:mod:`.permits`): it may be answered :data:`WAITING`.
    permits: tuple[Permit, ...] = ()


class Fenced:
    """The store's fenced operations for attempts of one holder (blocking: call them from
    a thread)."""

    def __init__(self, store: Store, holder: str, lease_ttl: float) -> None:
        self.store, self.holder, self.lease_ttl = store, holder, lease_ttl

    def round(self, steps: Sequence[Step]) -> list[Any]:
        """Starts and finishes in one exchange. Per step, in order: a start's new
        lease_until, :data:`WAITING` (no free permit: still reserved, lease unchanged), or
        None (the attempt may not start: lost, taken, ended); a finish's
        ``(answer, carried)``: ``applied``, ``duplicate`` or ``evidence`` (a stale attempt's
        outcome, kept, not applied), and whether its completion carried the result; or
        the error that is that step's answer."""
        answers: list[Any] = [None] * len(steps)
        completions: list[Completion] = []
        finishing: list[tuple[int, bool]] = []
        for i, step in enumerate(steps):
            if step.build is not None:
                try:
                    completion, carried = step.build()
                except Exception as exc:  # this finish's failure, not the round's
                    answers[i] = exc
                    continue
                completions.append(completion)
                finishing.append((i, carried))
        starts = [(s.attempt.task_id, s.attempt.epoch, s.attempt.token) for s in steps
                  if s.build is None]
        if not completions and not starts:
            return answers
        permits = {s.attempt.task_id: s.permits for s in steps
                   if s.build is None and s.permits}
        done = self.store.exchange(self.holder, self.lease_ttl, completions, [], starts,
                                   permits or None)
        for i, carried in finishing:
            answer = done.completed.get(steps[i].attempt.task_id, "evidence")
            answers[i] = answer if isinstance(answer, BaseException) else (answer, carried)
        for i, step in enumerate(steps):
            if step.build is None:
                task_id = step.attempt.task_id
                answers[i] = WAITING if task_id in done.waiting else done.started.get(task_id)
        return answers

    def renew(self, attempt: Attempt) -> bool | None:
        """True: renewed; None: still held but busy (a fenced block has the row); False:
        lost."""
        renewed, busy = self.store.renew(
            self.holder, [(attempt.task_id, attempt.epoch, attempt.token)], self.lease_ttl)
        if attempt.task_id in renewed:
            return True
        return None if attempt.task_id in busy else False

    def status(self, attempt: Attempt) -> tuple[str, float] | None:
        """``(state, lease_until)`` while the attempt holds its lease (nothing extended)."""
        return self.store.lease_of(self.holder, attempt.task_id, attempt.epoch, attempt.token)

    @staticmethod
    def completion(attempt: Attempt, outcome: str, error: str | None,
                   result: ResultRecord | None = None, *, returned: str | None = None,
                   stale: bool = False) -> Completion:
        """The store's completion of a finish. ``stale``: evidence whatever the claim
        says (an attempt never started has no authority to finish)."""
        return Completion(attempt.task_id, attempt.epoch,
                          LOST_TOKEN if stale else attempt.token,
                          claim_outcome(outcome, error), error, None if stale else result,
                          returned)
