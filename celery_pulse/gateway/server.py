"""``celery pulse gateway``: the pulse.worker.v1 WebSocket server (seed 003 §1-3, §6).

The rules, before any code:

* **One endpoint.** ``GET /v1/worker/connect``, subprotocol ``pulse.worker.v1`` (a
  client that doesn't offer it is refused by the handshake), no compression. The
  endpoint takes no query: a credential in the URL would end up in access logs, so any
  query string is refused before the credential is looked at.
* **Who may connect.** ``Authorization: Bearer <token>`` only, checked in the handshake
  against the store (hashed, :mod:`celery_pulse.store.credentials`;
  :mod:`~celery_pulse.gateway.handshake`): the credential must be active and grant
  ``workers:connect``. Every consuming operation checks that it is still active and
  grants ``workers:consume`` on the session's queue, as the gateway read it at its last
  check (once a ``session_check``; the store is asked if that read is stale), and that
  check itself ends every session of a revoked credential, unasked: within a second,
  on every gateway, whether the session is busy or idle.
* **Session.** The first frame must be ``worker.hello``, within ``hello_timeout`` of the
  accept; the instance must be the credential's and secret's in the store (the first
  hello's, on any gateway); then :mod:`celery_pulse.gateway.session` decides identity,
  generation and capacity. A session replaced by a newer generation is closed.
* **Bounds.** Connections counted from accept (:mod:`~celery_pulse.gateway.admission`:
  the limit, unauthenticated handshakes, one credential's; ``OVERLOADED``); per
  connection at most ``inbound_frames`` frames read ahead (the library's queue) and
  ``outbound_frames`` waiting to be written: a peer that doesn't read fills it and is
  disconnected (state committed in the store is not in the connection, so nothing is
  lost). A read idle for ``read_idle`` is probed with a ping (a pong is a read: an idle
  worker is never cut); a write taking longer than ``write_timeout`` ends the
  connection; a store operation taking longer than ``store_timeout`` is answered
  ``UNAVAILABLE``.
* **Errors.** A frame the gateway refuses is answered with an ``error`` frame: a stable
  code and a public message, never SQL, arguments or secrets. The connection stays up,
  except for frames that break the transport's rules (binary: close 1003; too large:
  1009) and for authority lost mid-session (close 1008).

The asyncio shell (websockets' ``serve``): each connection's hello and read loop live
here (its frames applied side by side, each attempt's in order: :mod:`.ordering`); the
handshake in :mod:`~celery_pulse.gateway.handshake`; what an accepted frame does, and
dispatch, in :mod:`celery_pulse.gateway.operations` and what every gateway process shares
through the store in :mod:`~celery_pulse.gateway.cluster`; a connection's writer and
bounds in :mod:`celery_pulse.gateway.link`; the protocol's rules, with no I/O, in
:mod:`celery_pulse.gateway.frames`, :mod:`~celery_pulse.gateway.session` and
:mod:`~celery_pulse.gateway.receipts`. An instance with a current session is a
registered worker (:mod:`celery_pulse.gateway.presence`), as a direct worker is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.typing import Subprotocol

from celery_pulse.gateway import frames
from celery_pulse.gateway.admission import Admission, counted
from celery_pulse.gateway.cluster import REPLACED, consuming
from celery_pulse.gateway.deadlines import within
from celery_pulse.gateway.events import GatewayEvents
from celery_pulse.gateway.frames import Code, Frame, ProtocolError
from celery_pulse.gateway.handshake import PATH, Handshake
from celery_pulse.gateway.link import Closing, Limits, Link, server_ssl_context, suppress_closing
from celery_pulse.gateway.operations import Operations
from celery_pulse.gateway.ordering import Ordered
from celery_pulse.gateway.outcomes import RemoteTaskError
from celery_pulse.gateway.permits import StartPermits
from celery_pulse.gateway.receipts import DISPOSITIONS, OUTCOME_STATES, attempt_ref, holder_name
from celery_pulse.gateway.redact import wire_logger
from celery_pulse.gateway.session import RUNNING, Instance, Session, Sessions
from celery_pulse.store.base import Store
from celery_pulse.store.credentials import (
    Credential,
    CredentialStore,
)
from celery_pulse.store.gateway_state import GatewayState

#: What ``celery pulse gateway`` and the tests import from here, wherever it lives now.
__all__ = ["DISPOSITIONS", "OUTCOME_STATES", "PATH", "Gateway", "Limits", "Link",
           "RemoteTaskError", "holder_name", "server_ssl_context"]

logger = logging.getLogger(__name__)



class Gateway(Handshake, Operations):
    """The server: handshake checks, then one :meth:`_serve_connection` per worker."""

    def __init__(self, credentials: CredentialStore, now: Callable[[], float], *,
                 limits: Limits | None = None, lease_ttl: float | None = None,
                 store: Store | None = None, app: Any = None, on_lost: str | None = None,
                 max_attempts: int = 3, name: str | None = None,
                 events: GatewayEvents | None = None, state: GatewayState | None = None,
                 allowed_origins: tuple[str, ...] = (),
                 concurrency_limits: Mapping[str, int] | None = None,
                 rate_limits: Mapping[str, tuple[int, float]] | None = None) -> None:
        limits = limits or Limits()
        if lease_ttl is not None:
            limits = dataclasses.replace(limits, lease_ttl=min(lease_ttl, limits.lease_ttl))
        super().__init__(now, limits, store=store, app=app, on_lost=on_lost,
                         max_attempts=max_attempts, name=name, events=events, state=state,
                         permits=StartPermits(concurrency_limits, app, rate_limits))
        self.credentials = credentials
        self.allowed_origins = frozenset(allowed_origins)
        self._credentials_now: dict[str, Credential] = {}
        self._credentials_read_at = float("-inf")
        self.sessions = Sessions(on_replaced=self._replaced)
        #: Credentials the handshake accepted, until their connection's handler takes
        #: them (or the handshake fails after the check: :meth:`_process_response`).
        self._accepted: dict[ServerConnection, Credential] = {}
        #: Who holds the connection places (counted from accept, before the credential).
        self.admission = Admission(self.limits)

    # -- one connection ---------------------------------------------------------------
    async def _serve_connection(self, conn: ServerConnection) -> None:
        credential = self._accepted.pop(conn, None)
        if credential is None:  # not through our handshake: can't happen, refuse anyway
            await conn.close(CloseCode.POLICY_VIOLATION, "unauthenticated")
            return
        link = Link(conn, self.limits)
        session: Session | None = None
        try:
            instance, session = await self._hello(conn, link, credential)
            await self._operate(conn, link, credential, instance, session)
        except Closing as closing:
            await self._closing(link, session, closing)
        except ConnectionClosed:
            pass
        finally:
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
        # Within hello_timeout of connecting (seed 003 §3), not of the upgrade's end.
        deadline = self.admission.accepted_at.get(conn, loop.time()) + self.limits.hello_timeout
        while True:
            left = deadline - loop.time()
            try:
                data = await asyncio.wait_for(conn.recv(), max(left, 0.0))
            except TimeoutError:
                raise Closing(CloseCode.POLICY_VIOLATION, "no worker.hello in time",
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
                # The instance is its first hello's credential and secret's, in the store
                # (any gateway, restarted or not): anyone else's hello touches nothing.
                if not await self._store(self.credentials.bind_instance, hello.instance_id,
                                         credential.credential_id, hello.instance_secret):
                    raise ProtocolError(Code.UNAUTHENTICATED,
                                        "this instance id belongs to another worker")
                session_id = frames.new_id()
                opened = await self._open(hello, session_id)
                instance, session = self.sessions.hello(credential.credential_id, hello,
                                                        session_id, opened)
            except ProtocolError as exc:
                exc.reply_to = frame.message_id
                fatal = exc.code in (Code.UNAUTHENTICATED, Code.FORBIDDEN)
                if fatal:
                    raise Closing(CloseCode.POLICY_VIOLATION, exc.code, exc) from None
                link.send(frames.error_frame(exc, None))
                continue
            self._links[session.session_id] = link
            self._holders[instance.instance_id] = holder_name(credential, instance.instance_id)
            try:
                await self._adopt_live(instance)
                body = await self._welcome(instance, session)
            except ProtocolError as exc:  # the store is out of reach: no session yet
                instance.close(session)
                self._links.pop(session.session_id, None)
                exc.reply_to = frame.message_id
                raise Closing(CloseCode.TRY_AGAIN_LATER, exc.code, exc) from None
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
        """Read frames and apply each as its own task (:mod:`.ordering`: side by side,
        each attempt's in order); the read loop itself only checks the session."""
        ordered = Ordered(self.limits.concurrent_operations)
        try:
            while True:
                try:
                    data = await within(conn.recv(), self.limits.read_idle)
                except TimeoutError:
                    if await link.answers_ping():
                        continue  # idle, not gone: an idle worker is never cut
                    raise Closing(CloseCode.POLICY_VIOLATION, "read idle") from None
                frame = self._decode(link, data, session.session_id)
                if frame is None:
                    continue
                if not instance.is_current(session):
                    raise Closing(CloseCode.POLICY_VIOLATION, "session replaced",
                                  ProtocolError(Code.SESSION_MISMATCH, REPLACED,
                                                reply_to=frame.message_id))
                await ordered.submit(_order_key(frame), functools.partial(
                    self._handle, link, credential, instance, session, frame))
        finally:
            await ordered.drain()

    async def _handle(self, link: Link, credential: Credential, instance: Instance,
                      session: Session, frame: Frame) -> None:
        """One frame of a current session: answered, or its connection closed."""
        try:
            try:
                await self._answer(link, credential, instance, session, frame)
            except ProtocolError as exc:
                exc.reply_to = frame.message_id
                if exc.code in (Code.UNAUTHENTICATED, Code.FORBIDDEN):
                    raise Closing(CloseCode.POLICY_VIOLATION, exc.code, exc) from None
                link.send(frames.error_frame(exc, session.session_id))
        except Closing as closing:
            await self._closing(link, session, closing)

    async def _answer(self, link: Link, credential: Credential, instance: Instance,
                      session: Session, frame: Frame) -> None:
        if frame.session_id != session.session_id:
            raise ProtocolError(Code.SESSION_MISMATCH,
                                "session_id is not this connection's session")
        if frame.type == frames.HELLO:
            raise ProtocolError(Code.STATE_CONFLICT, "this session said hello already")
        if self._credentials_fresh():
            self._authority(instance)
        else:  # the watch is behind: ask the store
            await self._authorised(credential, instance.identity.queue_id)
        digest = frames.canonical(frame)
        replayed = instance.replay(frame.message_id, digest)
        if replayed is not None:
            fresh = dict(replayed, deduplicated=True)
            if "lease" in fresh:  # the receipt is the original; the lease is now's
                fresh["lease"] = await self._lease_now(instance, frame)
            link.send(frames.ack(frame.message_id, session.session_id, fresh))
            return
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
                return
        with instance.applying(frame.message_id, digest) as done:
            reply = await self._apply(instance, session, frame)
            instance.remember(frame.message_id, digest, reply)
            done.set_result(reply)
        link.send(frames.ack(frame.message_id, session.session_id, reply))

    async def _closing(self, link: Link, session: Session | None, closing: Closing) -> None:
        logger.info("pulse gateway: closing the connection of %s: %s",
                    _sid(session) or "a worker before its hello", closing.reason)
        if closing.error is not None:
            with suppress_closing():
                link.send(frames.error_frame(closing.error, _sid(session)))
        await link.close(closing.code, closing.reason)

    # -- helpers ----------------------------------------------------------------------
    def _decode(self, link: Link, data: str | bytes, session_id: str | None) -> Frame | None:
        """The frame, or None after answering why it is refused (or raise to close)."""
        try:
            return frames.decode_client(data)
        except ProtocolError as exc:
            if isinstance(data, bytes):
                raise Closing(CloseCode.UNSUPPORTED_DATA, "binary frame", exc) from None
            if exc.code == Code.FRAME_TOO_LARGE:
                raise Closing(CloseCode.MESSAGE_TOO_BIG, "frame too large", exc) from None
            link.send(frames.error_frame(exc, session_id))
            return None

    async def _authorised(self, credential: Credential, queue: str) -> Credential:
        """The credential as the store has it now, if it still may consume ``queue``."""
        fresh = await self._store(self.credentials.get_credential, credential.credential_id)
        if fresh is not None:
            self._credentials_now[fresh.credential_id] = fresh
        return consuming(fresh, queue)
    def _replaced(self, previous: Session) -> None:
        self._end_session(previous, ProtocolError(Code.SESSION_MISMATCH, REPLACED))

    def _end_session(self, session: Session, error: ProtocolError) -> None:
        """Tell a session's connection why it ends (unsolicited), and close it."""
        link = self._links.pop(session.session_id, None)
        if link is not None:
            with suppress_closing():
                link.send(frames.error_frame(error, session.session_id))
            asyncio.get_running_loop().create_task(
                link.close(CloseCode.POLICY_VIOLATION, error.code))

    # -- running ----------------------------------------------------------------------
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
            # Each connection counted from its accept (admission), its TLS handshake
            # bounded by the hello's deadline.
            create_connection=counted(self.admission),
            ssl_handshake_timeout=self.limits.hello_timeout if ssl_context else None,
            # The upgrade, credential check included, within the hello's window of the
            # accept: a connection saying nothing gives its place back in time.
            open_timeout=self.limits.hello_timeout, logger=wire_logger("server"))

def _order_key(frame: Frame) -> str:
    """What a frame is applied in order with: its attempt's other frames, or its kind's."""
    ref = attempt_ref(frame.body)
    return "type:" + frame.type if ref is None else "attempt:" + ref.attempt_id


def _sid(session: Session | None) -> str | None:
    return session.session_id if session is not None else None
