"""What a gateway session's operations do, and the dispatch that feeds its instance.

The server's glue between the session rules and the store, the feeder and the app's
result backend: :class:`~celery_pulse.gateway.server.Gateway` builds on it and keeps the
connections (handshake, hello, the read loop); here is what an accepted, authorised
frame changes (``worker.capacity``, ``worker.resume``, ``task.start``, ``task.renew``,
``task.finish``), and how deliveries reserved for an instance become ``task.assign``.

Store calls block, so they run in threads (``asyncio.to_thread``), each under
``store_timeout``; the event loop never waits on SQL. A store call that fails is
answered ``UNAVAILABLE`` or ``INTERNAL``, never with the driver's words.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from websockets.frames import CloseCode

from celery_pulse.errors import PulseError, StoreUnavailable
from celery_pulse.gateway import frames
from celery_pulse.gateway.clock import StoreClock
from celery_pulse.gateway.cluster import Cluster
from celery_pulse.gateway.deadlines import within
from celery_pulse.gateway.dispatch import WAITING, Assignment, Feeder, Fenced, Step
from celery_pulse.gateway.events import GatewayEvents
from celery_pulse.gateway.frames import Code, Frame, ProtocolError
from celery_pulse.gateway.link import Closing, Limits, Link
from celery_pulse.gateway.outbox import publish, published
from celery_pulse.gateway.outcomes import Results
from celery_pulse.gateway.permits import StartPermits
from celery_pulse.gateway.presence import Presence
from celery_pulse.gateway.protocol import is_retry, is_revoke
from celery_pulse.gateway.queries import Queries
from celery_pulse.gateway.receipts import (
    DISPOSITIONS,
    OUTCOME_STATES,
    assign_body,
    attempt_ref,
    command_result,
    lease_body,
    timestamp,
    welcome_body,
)
from celery_pulse.gateway.revoking import Revoking
from celery_pulse.gateway.rounds import Rounds
from celery_pulse.gateway.routing import Capabilities
from celery_pulse.gateway.session import (
    FINISHED,
    LEASED,
    RUNNING,
    Attempt,
    Instance,
    Session,
)
from celery_pulse.store.base import Store
from celery_pulse.store.credentials import Forbidden, Unauthenticated
from celery_pulse.store.gateway_state import GatewayState

# The server's log lines keep the server's logger name, wherever their code lives.
logger = logging.getLogger("celery_pulse.gateway.server")

T = TypeVar("T")

#: Threads for store calls: the gateway's store pool (store/sql/sizing.py's
#: GATEWAY_POOL_SIZE), so a call never waits for a thread while a connection is free.
STORE_THREADS = 16


class Operations(Cluster, Revoking, Queries):
    """A gateway's instances, operations and dispatch (no connection handling)."""

    def __init__(self, now: Callable[[], float], limits: Limits, *, store: Store | None,
                 app: Any, on_lost: str | None, max_attempts: int, name: str | None,
                 events: GatewayEvents | None, state: GatewayState | None = None,
                 permits: StartPermits | None = None) -> None:
        #: Sessions and attempts every gateway process shares (None: this one's only).
        self.state = state
        #: The store's clock (``server_time``, ``expires_at``): never this host's; read
        #: once a second by the watch and estimated in between (:mod:`.clock`).
        self.now = now
        self.clock = StoreClock(now)
        self.limits = limits
        #: Where claims live, and the Celery app whose broker and tasks are dispatched;
        #: without them the gateway only keeps sessions (no task is assigned).
        self.store, self.app = store, app
        self.on_lost, self.max_attempts = on_lost, max_attempts
        #: Which concurrency permits a start takes (:mod:`.permits`).
        self.permits = permits or StartPermits(app=app)
        self._links: dict[str, Link] = {}  # session_id -> its connection's writer
        self._feeders: dict[str, Feeder] = {}  # instance_id -> its queue's consumer
        self._holders: dict[str, str] = {}  # instance_id -> its holder name in the store
        #: Celery events on the instances' behalf (Flower), or None.
        self.events = events
        self._background: set[asyncio.Future[None]] = set()
        #: The threads store calls run in (as many as the gateway's store pool holds
        #: connections), and each holder's group commit of starts and finishes.
        self.threads = concurrent.futures.ThreadPoolExecutor(
            STORE_THREADS, thread_name_prefix="pulse-gateway-store")
        self._rounds: dict[str, Rounds[Step, Any]] = {}
        #: Finishes in the app's result backend.
        self.results = Results(app, store)
        #: This gateway in its instances' registry labels, and who asks for their drains.
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        #: The instances' rows in the worker registry (none without a store).
        self.presence = None if store is None else Presence(
            store, self._store, ttl=self.limits.session_ttl, gateway=self.name)

    # -- operations -------------------------------------------------------------------
    async def _apply(self, instance: Instance, session: Session, frame: Frame
                     ) -> dict[str, Any]:
        """One operation of a current, authorised session (not a repeat)."""
        if frame.type == "worker.capacity":
            update: frames.CapacityUpdate = frame.body
            before = instance.capacity.drain
            declared = instance.declare(update.sequence, update.capacity, update.drain)
            if self.state is not None and not await self._store(
                    self.state.declare, instance.instance_id, session.epoch,
                    declared.sequence, declared.capacity, declared.drain):
                raise ProtocolError(Code.SESSION_MISMATCH,
                                    "a newer session of this instance replaced this one")
            if declared.drain and not before and self.presence is not None:
                self.presence.drain(self._holders[instance.instance_id],
                                    self._drain_requester(instance))
            self._feed(instance)
            feeder = self._feeders.get(instance.instance_id)
            if feeder is not None:
                feeder.room()  # more room, maybe: look now
            return await self._welcome(instance, session)
        if frame.type == "task.query":
            return await self._query(instance, frame.body)
        fenced = self._fenced(instance)
        if frame.type == "task.finish":
            finish: frames.Finish = frame.body
            attempt = await self._find(instance, finish.ref)
            messages = published(finish, instance.identity.queue_id)
            if messages and attempt.state != LEASED and self.app is not None:
                await self._publish(instance, attempt, messages)
            answer, written = await self._guarded(self._round(instance, Step(
                attempt, functools.partial(self.results.completion, attempt, finish))))
            attempt.state = FINISHED
            feeder = self._feeders.get(instance.instance_id)
            if feeder is not None:
                feeder.room()
            if answer in ("applied", "duplicate") and not written:
                # A duplicate is this attempt's own finish sent again (same epoch, same
                # outcome): the gateway that applied it may have died before the result
                # reached the backend. Writing it again is idempotent.
                await self._write_result(attempt, finish)
            if answer == "applied" and self.events is not None:
                self._spawn(self.events.send(
                    _event_of(finish), self._holders[instance.instance_id],
                    uuid=attempt.task_id, exception=finish.error_code or "", result=""))
            now = await self._store_now()
            state = {"applied": OUTCOME_STATES[finish.outcome],
                     "duplicate": OUTCOME_STATES[finish.outcome]}.get(answer, "UNKNOWN")
            return command_result("finish", state, "FINISHED", attempt, None,
                                  DISPOSITIONS[answer],
                                  {"active": False, "state": state, "lease_until": None,
                                   "server_time": timestamp(now)})
        ref: frames.AttemptRef = frame.body
        attempt = await self._find(instance, ref)
        if attempt.state == FINISHED:
            raise ProtocolError(Code.LEASE_LOST, "this attempt has finished")
        if frame.type == "worker.resume":
            # Attempts belong to the instance, not to a connection: nothing moves but the
            # answer, which is the lease as the store has it now (not extended).
            lease = await self._lease_now(instance, frame)
            return {"lease": lease, "deduplicated": False}
        sent = time.monotonic()
        if frame.type == "task.start":
            lease_until = None
            if attempt.state == LEASED:
                permits = self.permits.decide(instance.identity.queue_id, attempt.task_name,
                                              getattr(frame.body, "permits", ()))
                lease_until = await self._guarded(self._round(instance, Step(
                    attempt, permits=permits)))
                if lease_until == WAITING:  # reserved still, its lease as it was
                    attempt.waiting = True
                    now = await self._store_now()
                    return command_result("start", WAITING, LEASED, attempt,
                                          attempt.lease_until, WAITING,
                                          lease_body(True, WAITING, attempt.lease_until, now))
            if lease_until is None:
                # Started already (the start's answer was lost, maybe with the gateway
                # that applied it): the same answer, its lease renewed from now. Never
                # the old lease as it stands: the worker counts its deadline from this
                # request, which may be long after the first start.
                now = await self._store_now(earliest=True)
                renewed = await self._store(fenced.renew, attempt)
                if renewed is None:  # held, but its row is locked: not extended
                    raise ProtocolError(Code.UNAVAILABLE,
                                        "the claim is busy: send the start again")
                if renewed:
                    lease_until = now + self.limits.lease_ttl
            if lease_until is None:
                attempt.state = FINISHED
                raise ProtocolError(Code.LEASE_LOST,
                                    "attempt no longer grants execution authority")
            attempt.state, attempt.lease_until = RUNNING, lease_until
            attempt.deadline, attempt.waiting = sent + self.limits.lease_ttl, False
            if self.events is not None:
                self._spawn(self.events.send("task-started", self._holders[instance.instance_id],
                                             uuid=attempt.task_id))
            # The start's own statement time: its lease_until is that plus the lease.
            now = lease_until - self.limits.lease_ttl
            return command_result("start", "RUNNING", "RUNNING", attempt, lease_until,
                                  "APPLIED", lease_body(True, "RUNNING", lease_until, now))
        # task.renew: only a running attempt is renewed (the seed's rule), and one whose
        # start waits for a permit (as a direct worker renews its waiting reservations).
        if attempt.state != RUNNING and not attempt.waiting:
            raise ProtocolError(Code.STATE_CONFLICT, "only a started attempt is renewed")
        now = await self._store_now(earliest=True)
        renewed = await self._store(fenced.renew, attempt)
        if renewed is False:
            attempt.state = FINISHED
            raise ProtocolError(Code.LEASE_LOST, "attempt no longer grants execution authority")
        if renewed:
            # At least this long: the store's now during the renewal was no earlier.
            attempt.lease_until = now + self.limits.lease_ttl
            attempt.deadline = sent + self.limits.lease_ttl
        state = RUNNING if attempt.state == RUNNING else WAITING
        return command_result("renew", state, attempt.state, attempt, attempt.lease_until,
                              "APPLIED" if renewed else "BUSY",
                              lease_body(True, state, attempt.lease_until, now))

    async def _lease_now(self, instance: Instance, frame: Frame) -> dict[str, Any]:
        """The attempt's lease as the store has it now (``active`` false when lost)."""
        ref = attempt_ref(frame.body)
        if ref is None:  # resume, start, renew, finish: each names its attempt
            raise ProtocolError(Code.INTERNAL, "this operation names no attempt")
        attempt = await self._find(instance, ref)
        now = await self._store_now()
        held = await self._store(self._fenced(instance).status, attempt)
        if held is None:
            return lease_body(False, attempt.state if attempt.state == FINISHED else "LOST",
                              None, now)
        state, lease_until = held
        wire = "RUNNING" if state == "running" else LEASED
        return lease_body(wire == "RUNNING", wire, lease_until, now)

    async def _publish(self, instance: Instance, attempt: Attempt,
                       messages: list[dict[str, Any]]) -> None:
        """What the attempt published, before its finish applies (:mod:`.outbox`)."""
        try:
            await self._store(publish, self.app, instance.identity.queue_id, messages)
        except Exception as exc:
            logger.warning("pulse gateway: %d message(s) published by %s[%s] not sent (%r); "
                           "its finish waits", len(messages), attempt.task_name,
                           attempt.task_id, exc)
            raise ProtocolError(Code.UNAVAILABLE, "the broker did not take the task's "
                                                  "publications: send the finish again"
                                ) from None

    async def _write_result(self, attempt: Attempt, finish: frames.Finish) -> None:
        """The outcome in the app's result backend, once the store applied it (a stale
        attempt's never is): for a backend the completion can't carry."""
        _, call = self.results.call(self.results.backend(), attempt, finish)
        if call is None:
            return
        try:
            await self._store(call)
        except ProtocolError as exc:  # the claim is settled; the result is lost, say so
            logger.warning("pulse gateway: result of %s[%s] not stored: %s",
                           attempt.task_name, attempt.task_id, exc.message)

    # -- dispatch ---------------------------------------------------------------------
    def _fenced(self, instance: Instance) -> Fenced:
        if self.store is None:
            raise ProtocolError(Code.NOT_FOUND, "no such attempt on this gateway")
        return Fenced(self.store, self._holders[instance.instance_id], self.limits.lease_ttl)

    def _feed(self, instance: Instance) -> None:
        """Start consuming the instance's queue once it declared room (idempotent)."""
        if self.store is None or self.app is None or instance.instance_id in self._feeders:
            return
        loop = asyncio.get_running_loop()

        def free() -> int:
            link = self._link_of(instance)
            if link is None:
                return 0
            # Half the outbound queue stays for replies: a batch of assignments never
            # fills it (a full queue is a slow consumer's, and closes its connection).
            outbound = self.limits.outbound_frames // 2 - link.pending()
            return max(0, min(outbound, instance.free(time.monotonic())))

        def on_assign(assignment: Assignment) -> None:
            # Counted at once, in the feeder's thread: its next look at free() must see it.
            instance.assign(assignment.attempt)
            loop.call_soon_threadsafe(self._assigned, instance, assignment)

        feeder = Feeder(self.app, self.store, self._holders[instance.instance_id],
                        instance.identity.queue_id, lease_ttl=self.limits.lease_ttl,
                        on_lost=self.on_lost, max_attempts=self.max_attempts, free=free,
                        on_assign=on_assign, record=self._recorder(instance),
                        prefetch=max(1, instance.capacity.capacity),
                        revoked=self._is_revoked, rate=self.limits.dispatch_rate,
                        covers=Capabilities(
                            c.handler for c in instance.identity.capabilities).cover)
        self._feeders[instance.instance_id] = feeder
        feeder.start()

    def _link_of(self, instance: Instance) -> Link | None:
        session = instance.current
        return None if session is None else self._links.get(session.session_id)

    def _assigned(self, instance: Instance, assignment: Assignment) -> None:
        attempt = assignment.attempt
        link = self._link_of(instance)
        if link is None or instance.current is None:
            # Gone meanwhile: never started, the lease expires and Recover re-dispatches.
            logger.info("pulse gateway: %s[%s] reserved for %s, which left; Recover will "
                        "re-dispatch it", attempt.task_name, attempt.task_id,
                        instance.instance_id)
            return
        body = assign_body(attempt, assignment.message, self.limits.lease_ttl)
        try:
            link.send(Frame("task.assign", frames.new_id(), body, instance.current.session_id))
        except Closing:
            asyncio.get_running_loop().create_task(
                link.close(CloseCode.POLICY_VIOLATION, "slow consumer"))

    def _stop_feeding(self, instance_id: str) -> None:
        feeder = self._feeders.pop(instance_id, None)
        if feeder is not None:
            feeder.stop()

    # -- helpers ----------------------------------------------------------------------
    async def _welcome(self, instance: Instance, session: Session) -> dict[str, Any]:
        now = await self._store(self.now)
        return welcome_body(instance, session, now, self.limits.session_ttl,
                            self.limits.lease_ttl)

    async def _store_now(self, *, earliest: bool = False) -> float:
        """The store's clock: estimated (:mod:`.clock`) while the watch keeps it fresh,
        else read. ``earliest``: no later than the store's."""
        if self.clock.fresh():
            return self.clock.earliest() if earliest else self.clock.estimate()
        return await self._store(self.now)

    def _round(self, instance: Instance, step: Step) -> asyncio.Future[Any]:
        """``step`` applied in its holder's next round (:mod:`.rounds`)."""
        holder = self._holders[instance.instance_id]
        rounds = self._rounds.get(holder)
        if rounds is None:
            rounds = self._rounds[holder] = Rounds(self._fenced(instance).round,
                                                   _task_of, self.threads)
        return rounds.submit(step)

    async def _store(self, call: Callable[..., T], *args: Any) -> T:
        """A blocking store call off the loop, under the store deadline."""
        return await self._guarded(asyncio.get_running_loop().run_in_executor(
            self.threads, functools.partial(call, *args)), getattr(call, "__name__", call))

    async def _guarded(self, work: Awaitable[T], what: object = "exchange") -> T:
        """A store call's answer, under the store deadline; its failure as the
        protocol's (``UNAVAILABLE`` or ``INTERNAL``, never the driver's words)."""
        try:
            return await within(work, self.limits.store_timeout)
        except TimeoutError:
            raise ProtocolError(Code.UNAVAILABLE, "the store did not answer in time") from None
        except StoreUnavailable:
            raise ProtocolError(Code.UNAVAILABLE, "the store is unavailable") from None
        except (Unauthenticated, Forbidden):
            raise
        except PulseError as exc:
            logger.warning("pulse gateway: store call %s failed: %s", what, exc)
            raise ProtocolError(Code.INTERNAL, "the gateway could not do this") from None

    def _drain_requester(self, instance: Instance) -> str:
        """Who asked for the drain, as the store's drain request records it."""
        return f"worker.capacity of {instance.instance_id} via gateway {self.name}"
    def _spawn(self, work: Awaitable[None]) -> None:
        """Fire and forget (an event): kept referenced until done."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _task_of(step: Step) -> str:
    return step.attempt.task_id


def _event_of(finish: frames.Finish) -> str:
    """The Celery event an applied finish is (Flower's view of it)."""
    if finish.outcome == "SUCCEEDED":
        return "task-succeeded"
    if is_retry(finish.outcome, finish.error_code):
        return "task-retried"
    return "task-revoked" if is_revoke(finish.outcome, finish.error_code) else "task-failed"
