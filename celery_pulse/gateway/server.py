"""``celery pulse gateway``: the pulse.worker.v1 WebSocket server (seed 003 §1-3, §6).

The rules, before any code:

* **One endpoint.** ``GET /v1/worker/connect``, subprotocol ``pulse.worker.v1`` (a
  client that doesn't offer it is refused by the handshake), no compression. The
  endpoint takes no query: a credential in the URL would end up in access logs, so any
  query string is refused before the credential is looked at.
* **Who may connect.** ``Authorization: Bearer <token>`` only, checked in the handshake
  against the store (hashed, :mod:`celery_pulse.store.credentials`): the credential
  must be active and grant ``workers:connect``. Every consuming operation checks again,
  in the store, that it is still active and grants ``workers:consume`` on the session's
  queue: a revoked credential's sessions end at their next operation.
* **Session.** The first frame must be ``worker.hello``, within ``hello_timeout``; then
  :mod:`celery_pulse.gateway.session` decides identity, generation and capacity. A
  session replaced by a newer generation of its instance is closed.
* **Bounds.** At most ``max_connections`` connections; per connection at most
  ``inbound_frames`` frames read ahead (the WebSocket library's queue) and
  ``outbound_frames`` waiting to be written: a peer that doesn't read fills it and is
  disconnected (state committed in the store is not in the connection, so nothing is
  lost). A read idle for ``read_idle``, a write taking longer than ``write_timeout``,
  end the connection; a store operation taking longer than ``store_timeout`` is
  answered ``UNAVAILABLE``.
* **Errors.** A frame the gateway refuses is answered with an ``error`` frame: a stable
  code and a public message, never SQL, arguments or secrets. The connection stays up,
  except for frames that break the transport's rules (binary: close 1003; too large:
  1009) and for authority lost mid-session (close 1008).

Store calls block, so they run in threads (``asyncio.to_thread``), each under
``store_timeout``; the event loop never waits on SQL. An instance with a current session
is a registered worker (:mod:`celery_pulse.gateway.presence`), as a direct worker is.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import json
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from http import HTTPStatus
from typing import Any, TypeVar
from urllib.parse import urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from celery_pulse.deferral import DEFERRED_STATES, carried_by_completions, deferred_result
from celery_pulse.errors import PulseError, StoreUnavailable
from celery_pulse.gateway import frames
from celery_pulse.gateway.dispatch import Assignment, Feeder, Fenced
from celery_pulse.gateway.events import GatewayEvents
from celery_pulse.gateway.frames import Code, Frame, ProtocolError
from celery_pulse.gateway.presence import Presence
from celery_pulse.gateway.session import (
    FINISHED,
    LEASED,
    RUNNING,
    Attempt,
    Instance,
    Session,
    Sessions,
)
from celery_pulse.store.base import Store
from celery_pulse.store.credentials import (
    CONNECT,
    CONSUME,
    Credential,
    CredentialStore,
    Forbidden,
    Unauthenticated,
)

logger = logging.getLogger(__name__)

PATH = "/v1/worker/connect"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """The seed's bounds (§6): a development baseline, not load-tested figures."""

    max_connections: int = 128
    inbound_frames: int = 4
    outbound_frames: int = 8
    hello_timeout: float = 5.0
    read_idle: float = 60.0
    write_timeout: float = 5.0
    store_timeout: float = 8.0
    #: How long a session lives without an operation (the seed's 45 s window).
    session_ttl: float = 45.0
    #: The longest execution lease the gateway grants (the seed's 30 s).
    lease_ttl: float = 30.0


class _Closing(Exception):
    """End this connection with ``code`` after sending ``error`` (if any)."""

    def __init__(self, code: int, reason: str, error: ProtocolError | None = None) -> None:
        super().__init__(reason)
        self.code, self.reason, self.error = code, reason, error


class Link:
    """One connection's writer: a bounded queue of frames and one task writing them,
    each write under the write deadline."""

    def __init__(self, conn: ServerConnection, limits: Limits) -> None:
        self.conn = conn
        self.limits = limits
        self._queue: asyncio.Queue[str | None] = asyncio.Queue(limits.outbound_frames)
        self._task = asyncio.create_task(self._write())

    def pending(self) -> int:
        """Frames queued and not yet written."""
        return self._queue.qsize()

    def send(self, frame: Frame) -> None:
        try:
            self._queue.put_nowait(frames.encode(frame))
        except asyncio.QueueFull:
            raise _Closing(CloseCode.POLICY_VIOLATION, "slow consumer: outbound queue full"
                           ) from None

    async def _write(self) -> None:
        while True:
            text = await self._queue.get()
            if text is None:
                return
            try:
                await asyncio.wait_for(self.conn.send(text), self.limits.write_timeout)
            except (TimeoutError, ConnectionClosed):
                logger.info("pulse gateway: dropping %s: write did not complete",
                            self.conn.remote_address)
                self.conn.transport.abort()
                return

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        """Write what is queued (within the write deadline), then close."""
        try:
            self._queue.put_nowait(None)
            await asyncio.wait_for(asyncio.shield(self._task), self.limits.write_timeout)
        except (asyncio.QueueFull, TimeoutError):
            self._task.cancel()
        await self.conn.close(code, reason)


class Gateway:
    """The server: handshake checks, then one :meth:`_serve_connection` per worker."""

    def __init__(self, credentials: CredentialStore, now: Callable[[], float], *,
                 limits: Limits | None = None, lease_ttl: float | None = None,
                 store: Store | None = None, app: Any = None, on_lost: str | None = None,
                 max_attempts: int = 3, name: str | None = None,
                 events: GatewayEvents | None = None) -> None:
        self.credentials = credentials
        #: The store's clock (``server_time``, ``expires_at``): never this host's.
        self.now = now
        limits = limits or Limits()
        if lease_ttl is not None:
            limits = dataclasses.replace(limits, lease_ttl=min(lease_ttl, limits.lease_ttl))
        self.limits = limits
        #: Where claims live, and the Celery app whose broker and tasks are dispatched;
        #: without them the gateway only keeps sessions (no task is assigned).
        self.store, self.app = store, app
        self.on_lost, self.max_attempts = on_lost, max_attempts
        self.sessions = Sessions(on_replaced=self._replaced)
        #: Credentials the handshake accepted, until their connection's handler takes
        #: them (or the handshake fails after the check: :meth:`_process_response`).
        self._accepted: dict[ServerConnection, Credential] = {}
        #: Connections being served (what the connection limit counts).
        self._live: set[ServerConnection] = set()
        self._links: dict[str, Link] = {}  # session_id -> its connection's writer
        self._feeders: dict[str, Feeder] = {}  # instance_id -> its queue's consumer
        self._holders: dict[str, str] = {}  # instance_id -> its holder name in the store
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Celery events on the instances' behalf (Flower), or None.
        self.events = events
        self._background: set[asyncio.Future[None]] = set()
        #: Whether finishes carry their results (:meth:`_carried`; None: not asked yet).
        self._carries: bool | None = None
        #: This gateway in its instances' registry labels, and who asks for their drains.
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        #: The instances' rows in the worker registry (none without a store).
        self.presence = None if store is None else Presence(
            store, self._store, ttl=self.limits.session_ttl, gateway=self.name)

    # -- the handshake ----------------------------------------------------------------
    async def _process_request(self, conn: ServerConnection, request: Request
                               ) -> Response | None:
        parts = urlsplit(request.path)
        if parts.path != PATH:
            return _refuse(conn, HTTPStatus.NOT_FOUND, f"no such endpoint; use {PATH}")
        if parts.query:
            return _refuse(conn, HTTPStatus.BAD_REQUEST,
                           "this endpoint takes no query (credentials in the URL are "
                           "refused): send Authorization: Bearer <token>")
        if len(self._live) + len(self._accepted) >= self.limits.max_connections:
            return _refuse(conn, HTTPStatus.SERVICE_UNAVAILABLE,
                           "too many worker connections on this gateway")
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            response = _refuse(conn, HTTPStatus.UNAUTHORIZED,
                               "send Authorization: Bearer <token>")
            response.headers["WWW-Authenticate"] = 'Bearer realm="pulse.worker.v1"'
            return response
        try:
            credential = await self._store(self.credentials.authenticate, token.strip())
            credential.require(CONNECT)
        except Unauthenticated as exc:
            return _refuse(conn, HTTPStatus.UNAUTHORIZED, exc.message)
        except Forbidden as exc:
            return _refuse(conn, HTTPStatus.FORBIDDEN, exc.message)
        except ProtocolError:
            return _refuse(conn, HTTPStatus.SERVICE_UNAVAILABLE, "the store is unavailable")
        self._accepted[conn] = credential
        return None

    def _process_response(self, conn: ServerConnection, request: Request, response: Response
                          ) -> None:
        """A handshake refused after the credential check (no common subprotocol, say)
        leaves no place taken."""
        if response.status_code != HTTPStatus.SWITCHING_PROTOCOLS:
            self._accepted.pop(conn, None)

    # -- one connection ---------------------------------------------------------------
    async def _serve_connection(self, conn: ServerConnection) -> None:
        credential = self._accepted.pop(conn, None)
        if credential is None:  # not through our handshake: can't happen, refuse anyway
            await conn.close(CloseCode.POLICY_VIOLATION, "unauthenticated")
            return
        self._live.add(conn)
        link = Link(conn, self.limits)
        session: Session | None = None
        try:
            instance, session = await self._hello(conn, link, credential)
            await self._operate(conn, link, credential, instance, session)
        except _Closing as closing:
            if closing.error is not None:
                with _suppress_closing():
                    link.send(frames.error_frame(closing.error, _sid(session)))
            await link.close(closing.code, closing.reason)
        except ConnectionClosed:
            pass
        finally:
            self._live.discard(conn)
            if session is not None:
                self._links.pop(session.session_id, None)
                known = self.sessions.get(session.instance_id)
                if known is not None:
                    known.close(session)
                    if known.current is None:
                        self._stop_feeding(session.instance_id)
                        if self.presence is not None:
                            await self.presence.leave(self._holders[session.instance_id])
                        if self.events is not None:
                            await self.events.worker(
                                "offline", self._holders[session.instance_id])

    async def _hello(self, conn: ServerConnection, link: Link, credential: Credential
                     ) -> tuple[Instance, Session]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.hello_timeout
        while True:
            left = deadline - loop.time()
            try:
                data = await asyncio.wait_for(conn.recv(), max(left, 0.0))
            except TimeoutError:
                raise _Closing(CloseCode.POLICY_VIOLATION, "no worker.hello in time",
                               ProtocolError(Code.HELLO_TIMEOUT,
                                             f"send worker.hello within "
                                             f"{self.limits.hello_timeout:g} s")) from None
            frame = self._decode(link, data, None)
            if frame is None:
                continue
            if frame.type != frames.HELLO:
                link.send(frames.error_frame(ProtocolError(
                    Code.HELLO_REQUIRED, "the first operation must be worker.hello",
                    reply_to=frame.message_id), None))
                continue
            hello: frames.Hello = frame.body
            try:
                credential = await self._authorised(credential, hello.queue_id)
                instance, session = self.sessions.hello(credential.credential_id, hello)
            except ProtocolError as exc:
                exc.reply_to = frame.message_id
                fatal = exc.code in (Code.UNAUTHENTICATED, Code.FORBIDDEN)
                if fatal:
                    raise _Closing(CloseCode.POLICY_VIOLATION, exc.code, exc) from None
                link.send(frames.error_frame(exc, None))
                continue
            self._links[session.session_id] = link
            self._holders[instance.instance_id] = holder_name(credential, instance.instance_id)
            try:
                body = await self._welcome(instance, session)
            except ProtocolError as exc:  # the store is out of reach: no session yet
                instance.close(session)
                self._links.pop(session.session_id, None)
                exc.reply_to = frame.message_id
                raise _Closing(CloseCode.TRY_AGAIN_LATER, exc.code, exc) from None
            link.send(Frame("worker.welcome", frames.new_id(), body, session.session_id,
                            frame.message_id))
            if self.presence is not None:
                worker_id = self._holders[instance.instance_id]
                if self.events is not None:
                    self._spawn(self.events.worker("online", worker_id))
                self.presence.arrive(worker_id, self.presence.labels(
                    credential.name, hello.queue_id, hello.capacity))
                if instance.capacity.drain:  # kept across reconnects, in the registry too
                    self.presence.drain(worker_id, self._drain_requester(instance))
            logger.info("pulse gateway: instance %s (credential %s, queue %s) session %s "
                        "epoch %d", instance.instance_id, credential.name, hello.queue_id,
                        session.session_id, session.epoch)
            return instance, session

    async def _operate(self, conn: ServerConnection, link: Link, credential: Credential,
                       instance: Instance, session: Session) -> None:
        while True:
            try:
                data = await asyncio.wait_for(conn.recv(), self.limits.read_idle)
            except TimeoutError:
                raise _Closing(CloseCode.POLICY_VIOLATION, "read idle") from None
            frame = self._decode(link, data, session.session_id)
            if frame is None:
                continue
            if not instance.is_current(session):
                raise _Closing(CloseCode.POLICY_VIOLATION, "session replaced", ProtocolError(
                    Code.SESSION_MISMATCH, "a newer session of this instance replaced this one",
                    reply_to=frame.message_id))
            try:
                if frame.session_id != session.session_id:
                    raise ProtocolError(Code.SESSION_MISMATCH,
                                        "session_id is not this connection's session")
                if frame.type == frames.HELLO:
                    raise ProtocolError(Code.STATE_CONFLICT, "this session said hello already")
                credential = await self._authorised(credential, instance.identity.queue_id)
                digest = frames.canonical(frame)
                replayed = instance.replay(frame.message_id, digest)
                if replayed is not None:
                    fresh = dict(replayed, deduplicated=True)
                    if "lease" in fresh:  # the receipt is the original; the lease is now's
                        fresh["lease"] = await self._lease_now(instance, frame)
                    link.send(frames.ack(frame.message_id, session.session_id, fresh))
                    continue
                earlier = instance.in_flight(frame.message_id, digest)
                if earlier is not None:
                    # The same operation is still being applied (sent again over a new
                    # connection before the first one's answer): its answer is this one's.
                    try:
                        first = await asyncio.shield(earlier)
                    except ProtocolError:
                        first = None  # it failed: this one is tried on its own
                    if first is not None:
                        link.send(frames.ack(frame.message_id, session.session_id,
                                             {**first, "deduplicated": True}))
                        continue
                with instance.applying(frame.message_id, digest) as done:
                    reply = await self._apply(instance, session, frame)
                    instance.remember(frame.message_id, digest, reply)
                    done.set_result(reply)
                link.send(frames.ack(frame.message_id, session.session_id, reply))
            except ProtocolError as exc:
                exc.reply_to = frame.message_id
                if exc.code in (Code.UNAUTHENTICATED, Code.FORBIDDEN):
                    raise _Closing(CloseCode.POLICY_VIOLATION, exc.code, exc) from None
                link.send(frames.error_frame(exc, session.session_id))

    async def _apply(self, instance: Instance, session: Session, frame: Frame
                     ) -> dict[str, Any]:
        """One operation of a current, authorised session (not a repeat)."""
        if frame.type == "worker.capacity":
            update: frames.CapacityUpdate = frame.body
            before = instance.capacity.drain
            declared = instance.declare(update.sequence, update.capacity, update.drain)
            if declared.drain and not before and self.presence is not None:
                self.presence.drain(self._holders[instance.instance_id],
                                    self._drain_requester(instance))
            self._feed(instance)
            return await self._welcome(instance, session)
        fenced = self._fenced(instance)
        if frame.type == "task.finish":
            finish: frames.Finish = frame.body
            attempt = instance.attempt(*_ref(finish.ref))
            answer, written = await self._store(self._settle, fenced, attempt, finish)
            attempt.state = FINISHED
            feeder = self._feeders.get(instance.instance_id)
            if feeder is not None:
                feeder.room()
            if answer == "applied":
                if not written:
                    await self._write_result(attempt, finish)
                if self.events is not None:
                    self._spawn(self.events.send(
                        "task-succeeded" if finish.outcome == "SUCCEEDED" else "task-failed",
                        self._holders[instance.instance_id], uuid=attempt.task_id,
                        exception=finish.error_code or "", result=""))
            now = await self._store(self.now)
            state = {"applied": OUTCOME_STATES[finish.outcome],
                     "duplicate": OUTCOME_STATES[finish.outcome]}.get(answer, "UNKNOWN")
            return _command("finish", state, "FINISHED", attempt, None, DISPOSITIONS[answer],
                            {"active": False, "state": state, "lease_until": None,
                             "server_time": _timestamp(now)})
        ref: frames.AttemptRef = frame.body
        attempt = instance.attempt(*_ref(ref))
        if attempt.state == FINISHED:
            raise ProtocolError(Code.LEASE_LOST, "this attempt has finished")
        if frame.type == "worker.resume":
            # Attempts belong to the instance, not to a connection: nothing moves but the
            # answer, which is the lease as the store has it now (not extended).
            lease = await self._lease_now(instance, frame)
            return {"lease": lease, "deduplicated": False}
        sent = time.monotonic()
        if frame.type == "task.start":
            lease_until = await self._store(fenced.start, attempt)
            if lease_until is None:
                attempt.state = FINISHED
                raise ProtocolError(Code.LEASE_LOST,
                                    "attempt no longer grants execution authority")
            attempt.state, attempt.lease_until = RUNNING, lease_until
            attempt.deadline = sent + self.limits.lease_ttl
            if self.events is not None:
                self._spawn(self.events.send("task-started", self._holders[instance.instance_id],
                                             uuid=attempt.task_id))
            # The start's own statement time: its lease_until is that plus the lease.
            now = lease_until - self.limits.lease_ttl
            return _command("start", "RUNNING", "RUNNING", attempt, lease_until, "APPLIED",
                            _lease(True, "RUNNING", lease_until, now))
        # task.renew: only a running attempt is renewed (the seed's rule).
        if attempt.state != RUNNING:
            raise ProtocolError(Code.STATE_CONFLICT, "only a started attempt is renewed")
        now = await self._store(self.now)
        renewed = await self._store(fenced.renew, attempt)
        if renewed is False:
            attempt.state = FINISHED
            raise ProtocolError(Code.LEASE_LOST, "attempt no longer grants execution authority")
        if renewed:
            # At least this long: the store's now during the renewal was no earlier.
            attempt.lease_until = now + self.limits.lease_ttl
            attempt.deadline = sent + self.limits.lease_ttl
        return _command("renew", "RUNNING", "RUNNING", attempt, attempt.lease_until,
                        "APPLIED" if renewed else "BUSY",
                        _lease(True, "RUNNING", attempt.lease_until, now))

    async def _lease_now(self, instance: Instance, frame: Frame) -> dict[str, Any]:
        """The attempt's lease as the store has it now (``active`` false when lost)."""
        body = frame.body
        ref = body.ref if isinstance(body, frames.Finish) else body
        attempt = instance.attempt(*_ref(ref))
        now = await self._store(self.now)
        held = await self._store(self._fenced(instance).status, attempt)
        if held is None:
            return _lease(False, attempt.state if attempt.state == FINISHED else "LOST", None,
                          now)
        state, lease_until = held
        wire = "RUNNING" if state == "running" else LEASED
        return _lease(wire == "RUNNING", wire, lease_until, now)

    def _settle(self, fenced: Fenced, attempt: Attempt, finish: frames.Finish
                ) -> tuple[str, bool]:
        """The finish in the store (blocking: a thread's), and whether it wrote the result
        too: with the ``pulse://`` backend on this store the result goes in the
        completion's transaction, as a direct worker's does (one round trip, and never a
        settled claim without its result)."""
        backend = self._backend()
        state, call = self._result_call(backend, attempt, finish)
        record = None
        if call is not None and state in DEFERRED_STATES and self._carried(backend):
            with deferred_result(attempt.task_id) as deferral:
                call()  # kept in deferral.record, not written
            record = deferral.record
        answer = fenced.finish(attempt, finish.outcome, finish.error_code, record)
        return answer, record is not None

    def _carried(self, backend: Any) -> bool:
        """Whether this store's completions can carry ``backend``'s results: asked once
        (neither the store nor the app's backend URL changes), not on every finish."""
        if self._carries is None:
            url = getattr(self.store, "url", None)
            self._carries = url is not None and carried_by_completions(backend, url)
        return self._carries

    def _backend(self) -> Any:
        """The app's result backend (Celery's is per thread: ask in the thread using it)."""
        return getattr(self.app, "backend", None) if self.app is not None else None

    @staticmethod
    def _result_call(backend: Any, attempt: Attempt, finish: frames.Finish
                     ) -> tuple[str | None, Callable[[], Any] | None]:
        """The Celery state of a finish and the backend call that stores it (None for
        UNKNOWN, whose outcome a human decides, or with no backend)."""
        if backend is None or finish.outcome == "UNKNOWN":
            return None, None
        from celery import states

        meta = finish.result.get("celery_meta") if isinstance(finish.result, dict) else None
        if isinstance(meta, dict) and isinstance(meta.get("status"), str):
            # A Celery worker's own meta (celery_pulse.gateway.worker): its state, result
            # (an exception already in Celery's JSON form) and traceback, as it wrote them.
            return meta["status"], functools.partial(
                backend.store_result, attempt.task_id, meta.get("result"), meta["status"],
                traceback=meta.get("traceback"))
        if finish.outcome == "SUCCEEDED":
            return states.SUCCESS, functools.partial(
                backend.store_result, attempt.task_id, finish.result, states.SUCCESS)
        error = RemoteTaskError(f"{finish.error_code}: {json.dumps(finish.result)[:1000]}")
        return states.FAILURE, functools.partial(
            backend.store_result, attempt.task_id, error, states.FAILURE)

    async def _write_result(self, attempt: Attempt, finish: frames.Finish) -> None:
        """The outcome in the app's result backend, once the store applied it (a stale
        attempt's never is): for a backend the completion can't carry."""
        _, call = self._result_call(self._backend(), attempt, finish)
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
            if link is None or link.pending() * 2 >= self.limits.outbound_frames:
                return 0  # half the outbound queue stays for replies
            return instance.free(time.monotonic())

        def on_assign(assignment: Assignment) -> None:
            # Counted at once, in the feeder's thread: its next look at free() must see it.
            instance.assign(assignment.attempt)
            loop.call_soon_threadsafe(self._assigned, instance, assignment)

        feeder = Feeder(self.app, self.store, self._holders[instance.instance_id],
                        instance.identity.queue_id, lease_ttl=self.limits.lease_ttl,
                        on_lost=self.on_lost, max_attempts=self.max_attempts, free=free,
                        on_assign=on_assign)
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
        message = assignment.message
        body = {"task": {"id": attempt.task_id, "name": attempt.task_name,
                         "body": base64.b64encode(message.body).decode(),
                         "content_type": message.content_type,
                         "content_encoding": message.content_encoding,
                         "headers": dict(message.headers),
                         "properties": dict(message.properties),
                         "delivery_info": dict(message.delivery_info)},
                "task_id": attempt.wire_task_id, "attempt_id": attempt.attempt_id,
                "epoch": str(attempt.epoch), "lease_secret": attempt.token,
                "lease_until": _timestamp(attempt.lease_until),
                "server_time": _timestamp(attempt.lease_until - self.limits.lease_ttl)}
        try:
            link.send(Frame("task.assign", frames.new_id(), body, instance.current.session_id))
        except _Closing:
            asyncio.get_running_loop().create_task(
                link.close(CloseCode.POLICY_VIOLATION, "slow consumer"))

    def _stop_feeding(self, instance_id: str) -> None:
        feeder = self._feeders.pop(instance_id, None)
        if feeder is not None:
            feeder.stop()

    # -- helpers ----------------------------------------------------------------------
    def _decode(self, link: Link, data: str | bytes, session_id: str | None) -> Frame | None:
        """The frame, or None after answering why it is refused (or raise to close)."""
        try:
            return frames.decode_client(data)
        except ProtocolError as exc:
            if isinstance(data, bytes):
                raise _Closing(CloseCode.UNSUPPORTED_DATA, "binary frame", exc) from None
            if exc.code == Code.FRAME_TOO_LARGE:
                raise _Closing(CloseCode.MESSAGE_TOO_BIG, "frame too large", exc) from None
            link.send(frames.error_frame(exc, session_id))
            return None

    async def _authorised(self, credential: Credential, queue: str) -> Credential:
        """The credential as the store has it now, if it still may consume ``queue``."""
        try:
            fresh = await self._store(self.credentials.get_credential, credential.credential_id)
            if fresh is None:
                raise Unauthenticated()
            fresh.require(CONSUME, queue)
        except Unauthenticated as exc:
            raise ProtocolError(Code.UNAUTHENTICATED, exc.message) from None
        except Forbidden as exc:
            raise ProtocolError(Code.FORBIDDEN, exc.message) from None
        return fresh

    async def _welcome(self, instance: Instance, session: Session) -> dict[str, Any]:
        now = await self._store(self.now)
        return {"session_id": session.session_id, "epoch": str(session.epoch),
                "server_time": _timestamp(now),
                "expires_at": _timestamp(now + self.limits.session_ttl),
                "lease_duration_ms": round(self.limits.lease_ttl * 1000),
                "draining": instance.capacity.drain}

    async def _store(self, call: Callable[..., T], *args: Any) -> T:
        """A blocking store call off the loop, under the store deadline."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(call, *args),
                                          self.limits.store_timeout)
        except TimeoutError:
            raise ProtocolError(Code.UNAVAILABLE, "the store did not answer in time") from None
        except StoreUnavailable:
            raise ProtocolError(Code.UNAVAILABLE, "the store is unavailable") from None
        except (Unauthenticated, Forbidden):
            raise
        except PulseError as exc:
            logger.warning("pulse gateway: store call %s failed: %s",
                           getattr(call, "__name__", call), exc)
            raise ProtocolError(Code.INTERNAL, "the gateway could not do this") from None

    def _drain_requester(self, instance: Instance) -> str:
        """Who asked for the drain, as the store's drain request records it."""
        return f"worker.capacity of {instance.instance_id} via gateway {self.name}"

    def _replaced(self, previous: Session) -> None:
        link = self._links.pop(previous.session_id, None)
        if link is not None:
            error = ProtocolError(Code.SESSION_MISMATCH,
                                  "a newer session of this instance replaced this one")
            with _suppress_closing():
                link.send(frames.error_frame(error, previous.session_id))
            asyncio.get_running_loop().create_task(
                link.close(CloseCode.POLICY_VIOLATION, "session replaced"))

    # -- running ----------------------------------------------------------------------
    def _spawn(self, work: Awaitable[None]) -> None:
        """Fire and forget (an event): kept referenced until done."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def heartbeats(self) -> None:
        """``worker-heartbeat`` events for every instance with a current session, at the
        registry's beat (run it beside :meth:`serve` when events are on)."""
        if self.events is None:
            return
        while True:
            await asyncio.sleep(self.limits.session_ttl / 3)
            for instance_id, holder in list(self._holders.items()):
                known = self.sessions.get(instance_id)
                if known is not None and known.current is not None:
                    active = sum(a.state == RUNNING for a in list(known.attempts.values()))
                    self._spawn(self.events.worker("heartbeat", holder, active))

    def serve(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None
              ) -> Awaitable[Server]:
        """Start listening (await it: the server; ``async with`` it to stop)."""
        return serve(
            self._serve_connection, host, port, ssl=ssl_context,
            subprotocols=[Subprotocol(frames.SUBPROTOCOL)], compression=None,
            process_request=self._process_request, process_response=self._process_response,
            # Frames up to twice the limit are read, to be answered FRAME_TOO_LARGE; the
            # library closes anything bigger itself (1009).
            max_size=2 * frames.MAX_FRAME_BYTES, max_queue=self.limits.inbound_frames,
            # The handshake includes the credential check: a store call under its deadline.
            open_timeout=self.limits.store_timeout + 2.0, logger=logger)


def _refuse(conn: ServerConnection, status: HTTPStatus, text: str) -> Response:
    response = conn.respond(status, text + "\n")
    response.headers = Headers(response.headers)
    return response


class RemoteTaskError(Exception):
    """A task a gateway worker reported FAILED (its error code and result)."""


#: ``task.finish`` outcomes as the task's state in a receipt.
OUTCOME_STATES = {"SUCCEEDED": "SUCCEEDED", "FAILED": "FAILED", "UNKNOWN": "NEEDS_REVIEW"}
#: The store's answer to a completion, as the receipt's disposition.
DISPOSITIONS = {"applied": "APPLIED", "duplicate": "DUPLICATE", "evidence": "EVIDENCE_ONLY"}


def holder_name(credential: Credential, instance_id: str) -> str:
    """The claims' holder for an instance: who holds a task, read in ``pulse claims``."""
    return f"gw:{credential.name}:{instance_id}"


def _ref(ref: frames.AttemptRef) -> tuple[str, str, int, str]:
    return ref.task_id, ref.attempt_id, ref.epoch, ref.lease_secret


def _lease(active: bool, state: str, lease_until: float | None, now: float
           ) -> dict[str, Any]:
    return {"active": active, "state": state,
            "lease_until": None if lease_until is None else _timestamp(lease_until),
            "server_time": _timestamp(now)}


def _command(operation: str, task_state: str, attempt_state: str, attempt: Attempt,
             lease_until: float | None, disposition: str, lease: dict[str, Any]
             ) -> dict[str, Any]:
    """The seed's CommandResult: the operation's receipt (immutable) and the lease as
    checked now (a receipt never stands in for it)."""
    return {"receipt": {"operation": operation, "task_state": task_state,
                        "attempt_state": attempt_state, "task_revision": str(attempt.epoch),
                        "lease_until": None if lease_until is None else _timestamp(lease_until),
                        "disposition": disposition},
            "lease": lease, "deduplicated": False}


def _timestamp(seconds: float) -> str:
    """RFC 3339 UTC with milliseconds, as the seed writes times (``...T08:00:30.000Z``)."""
    moment = datetime.fromtimestamp(seconds, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _sid(session: Session | None) -> str | None:
    return session.session_id if session is not None else None


class _suppress_closing:
    """A frame that can't be queued any more (the link is closing anyway) is dropped."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, _Closing)


def server_ssl_context(certfile: str, keyfile: str | None) -> ssl.SSLContext:
    """TLS for the gateway (``ssl`` module defaults: TLS 1.2+, no compression), issuing
    no TLS 1.3 session tickets.

    A TLS 1.3 server sends its tickets just after the handshake, while the worker is
    sending its upgrade request. A threaded client (websockets' sync client, which
    :class:`~celery_pulse.gateway.client.GatewayClient` is) reads them in one thread
    while it writes in another, and an OpenSSL connection is not safe for both at once:
    now and then the request is lost and the handshake times out (reproduced here about
    once in a few hundred connections). Workers reconnect rarely, so resumption buys
    nothing worth that.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    context.num_tickets = 0
    return context
