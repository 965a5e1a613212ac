"""A pulse.worker.v1 client that survives its connection: the seed's WorkerConnection.

The rules, before any code:

* **One instance, many connections.** A client is one worker *instance*: its id and
  secret are made once and kept across reconnects, so each reconnect is the next session
  generation of the same instance, never a new worker.
* **Reconnect, resume, then declare.** When the connection drops (the network, the
  gateway restarting a listener, a proxy), the reader thread reconnects with backoff,
  says hello again, resumes every attempt it still holds (``worker.resume``), and only
  then declares its capacity again: dispatch on the new session starts after the old
  attempts are accounted for (seed 003 §3).
* **An operation is sent until it is answered.** Each operation has a ``message_id``
  made once; an operation whose answer did not arrive is sent again, with the same id,
  on the next connection. The gateway answers a repeat with the original receipt
  (``deduplicated``), so a finish whose ACK was lost settles the task once.
* **Authority is local and monotonic.** A ``CommandResult`` whose lease is active gives
  the caller a deadline on this host's monotonic clock: the time the request was *sent*
  plus the lease's duration, minus a safety margin. Nothing here compares a wall clock
  with ``lease_until``.
* **Fatal is fatal.** ``UNAUTHENTICATED`` and ``FORBIDDEN`` (a revoked credential, a
  queue no longer granted) end the client: waiting calls raise, nothing reconnects.
* **A cancel is Celery's revoke.** A ``task.cancel`` of an attempt held here becomes a
  ``revoke`` control message for the worker's own remote control (:mod:`.cancels`).

Threads: callers block in :meth:`GatewayClient.call`; one reader owns the connection.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import queue
import secrets
import ssl
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from celery_pulse.errors import PulseError
from celery_pulse.gateway import frames
from celery_pulse.gateway.cancels import revoke_control
from celery_pulse.gateway.frames import Code, ProtocolError
from celery_pulse.gateway.held import Held, assigned_of
from celery_pulse.gateway.redact import wire_logger
from celery_pulse.gateway.replies import (
    FATAL,
    KEPT,
    SAFETY_MARGIN,
    UNANSWERED,
    Answer,
    Assigned,
    GatewayClosed,
    Pending,
)

#: The records, re-exported: :mod:`celery_pulse.gateway.worker` and tests import them here.
__all__ = ["FATAL", "KEPT", "SAFETY_MARGIN", "Answer", "Assigned", "GatewayClient",
           "GatewayClosed", "Pending"]

logger = logging.getLogger(__name__)


class GatewayClient:
    """One worker instance's connection to a gateway (see the module's rules)."""

    def __init__(self, url: str, token: str, *, queue_id: str,
                 capabilities: Iterable[Mapping[str, str]], capacity: int,
                 ssl_context: ssl.SSLContext | None = None, open_timeout: float = 10.0,
                 reconnect_max: float = 5.0) -> None:
        self.url, self._token = url, token
        self.queue_id, self.capabilities = queue_id, [dict(c) for c in capabilities]
        self.capacity = capacity
        self.ssl_context, self.open_timeout, self.reconnect_max = ssl_context, open_timeout, reconnect_max
        self.instance_id = frames.new_id()
        self._secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
        self.assignments: queue.Queue[Assigned] = queue.Queue()
        #: Celery ``revoke`` control messages from ``task.cancel`` frames (.cancels).
        self.controls: queue.Queue[dict[str, Any]] = queue.Queue()
        self.session_id: str | None = None
        self.epoch, self.lease_duration = 0, 0.0
        self._drain, self._sequence = False, 0
        self._conn: ClientConnection | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, Pending] = {}
        self._attempts = Held()
        self._closed = threading.Event()
        self._fatal: PulseError | None = None
        self._reader: threading.Thread | None = None
        self.reconnects = 0
        #: Written once per assignment: an event loop's reader wakes on it.
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)

    # -- life -----------------------------------------------------------------------
    def start(self) -> None:
        """Connect, say hello and declare the capacity (raises if the first try fails;
        a gateway answering ``OVERLOADED`` is tried again for ``open_timeout``)."""
        deadline, backoff = time.monotonic() + self.open_timeout, 0.1
        while True:
            try:
                self._connect()
                break
            except InvalidStatus as exc:
                if exc.response.status_code != 503 or time.monotonic() + backoff > deadline:
                    raise
            self._closed.wait(backoff * (0.5 + secrets.randbelow(1000) / 1000))
            backoff = min(backoff * 2, self.reconnect_max)
        self._reader = threading.Thread(target=self._read, name="pulse-gateway-client", daemon=True)
        self._reader.start()
        self.declare(self.capacity)

    def close(self) -> None:
        self._closed.set()
        conn = self._conn
        if conn is not None:
            conn.close()
        if self._reader is not None:
            self._reader.join(10)
        self._fail_all(GatewayClosed("the gateway client is closed"))

    def wakeup_fd(self) -> int:
        """A file descriptor that becomes readable when an assignment arrives (read it
        empty, then take the assignments)."""
        return self._wake_r

    @property
    def fatal(self) -> PulseError | None:
        """Why the client ended for good (None while it may still work)."""
        return self._fatal

    @property
    def draining(self) -> bool:
        return self._drain

    def assigned_for(self, task_id: str, epoch: int) -> Assigned | None:
        """The assignment of ``task_id`` under ``epoch`` this instance holds, if any."""
        return self._attempts.get(task_id, epoch)

    def forget(self, ref: Mapping[str, str], *, lost_only: bool = False) -> None:
        """Stop resuming this attempt; unless ``lost_only``, forget it altogether (it
        finished, or was given up). A lost attempt is still found by :meth:`assigned_for`:
        its late finish must still reach the gateway, to be kept as evidence."""
        self._attempts.forget(ref, lost_only=lost_only)

    # -- operations (blocking, any thread) --------------------------------------------
    def declare(self, capacity: int, drain: bool | None = None) -> Answer:
        with self._lock:
            self.capacity = capacity
            self._drain = self._drain if drain is None else drain
            self._sequence += 1
            body = {"sequence": str(self._sequence), "capacity": capacity,
                    "drain": self._drain}
        return self.call("worker.capacity", body)

    def start_task(self, assigned: Assigned) -> Answer:
        return self.attempt_answer(assigned, self.submit("task.start", assigned.ref))

    def renew(self, assigned: Assigned) -> Answer:
        return self.attempt_answer(assigned, self.submit("task.renew", assigned.ref))

    def finish(self, assigned: Assigned, outcome: str, result: Any,
               error_code: str | None = None) -> Answer:
        return self.finish_answer(assigned, self.submit_finish(assigned, outcome, result,
                                                               error_code))

    def submit_finish(self, assigned: Assigned, outcome: str, result: Any,
                      error_code: str | None = None) -> Pending:
        body: dict[str, Any] = {"ref": dict(assigned.ref), "outcome": outcome,
                                "result": result}
        if error_code is not None:
            body["error_code"] = error_code
        return self.submit("task.finish", body)

    def finish_answer(self, assigned: Assigned, pending: Pending) -> Answer:
        """A finish's answer; the attempt is over whatever it says, unless the gateway
        could not answer (``UNAVAILABLE``, ``INTERNAL``): then it is kept, for the
        finish to be sent again."""
        try:
            answer = self.answer(pending)
        except ProtocolError as exc:
            if exc.code not in UNANSWERED:
                self.forget(assigned.ref)
            raise
        self.forget(assigned.ref)
        return answer

    def attempt_answer(self, assigned: Assigned, pending: Pending) -> Answer:
        """A start's or renewal's answer; a lost attempt is forgotten."""
        try:
            return self.answer(pending)
        except ProtocolError as exc:
            if exc.code in (Code.LEASE_LOST, Code.NOT_FOUND):
                self.forget(assigned.ref, lost_only=True)
            raise

    def call(self, kind: str, body: Mapping[str, Any], timeout: float = 60.0) -> Answer:
        """Send one operation until it is answered (across reconnects); its answer, or
        the gateway's error as :class:`ProtocolError`."""
        return self.answer(self.submit(kind, body), timeout)

    def submit(self, kind: str, body: Mapping[str, Any]) -> Pending:
        """Send one operation without waiting: several are under way at once (the
        gateway applies them side by side), each answered by :meth:`answer`."""
        message_id = frames.new_id()
        pending = Pending({"protocol_version": frames.PROTOCOL_VERSION, "type": kind,
                            "message_id": message_id, "body": dict(body)})
        with self._lock:
            if self._fatal is not None:
                raise self._fatal
            self._pending[message_id] = pending
        self._send(pending)
        return pending

    def answer(self, pending: Pending, timeout: float = 60.0) -> Answer:
        """The answer to a :meth:`submit`, once it comes (sent again on reconnects)."""
        kind, message_id = pending.frame["type"], pending.frame["message_id"]
        try:
            if not pending.done.wait(timeout):
                raise ProtocolError(Code.UNAVAILABLE, f"no answer to {kind} in {timeout:g} s")
        finally:
            with self._lock:
                self._pending.pop(message_id, None)
        if pending.error is not None:
            raise pending.error
        answer = pending.answer or {}
        reply = dict(answer.get("body") or {})
        deadline = None
        lease = reply.get("lease")
        if isinstance(lease, Mapping) and lease.get("active"):
            # Counted from a time the lease was granted no earlier than: this send, or
            # for the original receipt of a repeat, the first one.
            since = pending.first_sent if reply.get("deduplicated") else pending.sent
            deadline = since + self.lease_duration - SAFETY_MARGIN
        return Answer(reply, deadline)

    # -- the connection (reader thread, and the first connect) --------------------------
    def _connect(self) -> None:
        headers = {"Authorization": f"Bearer {self._token}"}
        try:
            conn = connect(self.url, ssl=self.ssl_context, additional_headers=headers,
                           subprotocols=[Subprotocol(frames.SUBPROTOCOL)], compression=None,
                           open_timeout=self.open_timeout, max_size=2 * frames.MAX_FRAME_BYTES,
                           legacy=True, logger=wire_logger("client"))
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (401, 403):
                self._give_up(ProtocolError(Code.UNAUTHENTICATED if status == 401
                                            else Code.FORBIDDEN, f"gateway refused: {status}"))
            raise
        hello = {"protocol_version": frames.PROTOCOL_VERSION, "type": frames.HELLO,
                 "message_id": frames.new_id(),
                 "body": {"instance_id": self.instance_id, "instance_secret": self._secret,
                          "queue_id": self.queue_id, "capabilities": self.capabilities,
                          "capacity": max(1, self.capacity)}}
        conn.send(json.dumps(hello))
        welcome = frames.decode_server(conn.recv(self.open_timeout))
        if welcome.type == "error" and welcome.error is not None:
            conn.close()
            error = ProtocolError(welcome.error.code, welcome.error.message)
            if error.code in FATAL:
                self._give_up(error)
            raise error
        body = welcome.body
        with self._lock:
            self._conn, self.session_id = conn, body["session_id"]
            self.epoch, self.lease_duration = int(body["epoch"]), body["lease_duration_ms"] / 1000

    def _read(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            conn = self._conn
            try:
                if conn is None:
                    raise ConnectionError("not connected")
                frame = frames.decode_server(conn.recv())
            except ProtocolError as exc:
                logger.warning("pulse gateway client: bad frame from the gateway: %s", exc)
                continue
            except (ConnectionClosed, ConnectionError, OSError, TimeoutError):
                if self._closed.is_set() or self._fatal is not None:
                    return
                self._reconnect(backoff)
                backoff = min(backoff * 2, self.reconnect_max)
                continue
            backoff = 0.1
            self._route(frame)

    def _reconnect(self, delay: float) -> None:
        """Hello again, resume what is held, declare again, re-send what is unanswered."""
        self._conn = None
        self._closed.wait(delay)
        if self._closed.is_set():
            return
        try:
            self._connect()
        except (OSError, TimeoutError, WebSocketException, ProtocolError) as exc:
            logger.info("pulse gateway client: reconnect failed (%s); trying again", exc)
            return
        self.reconnects += 1
        with self._lock:
            held = self._attempts.to_resume()
            pending = list(self._pending.values())
            self._sequence += 1
            capacity = {"sequence": str(self._sequence), "capacity": self.capacity,
                        "drain": self._drain}
        conn = self._conn
        assert conn is not None
        # Resumes first, then the capacity (dispatch starts after it), then the rest. Their
        # answers come to the reader loop like any other.
        for ref in held:
            self._raw(conn, "worker.resume", dict(ref))
        self._raw(conn, "worker.capacity", capacity)
        for item in pending:
            self._send(item)

    def _raw(self, conn: ClientConnection, kind: str, body: dict[str, Any]) -> None:
        with self._lock:
            session_id = self.session_id
        frame = {"protocol_version": frames.PROTOCOL_VERSION, "type": kind,
                 "message_id": frames.new_id(), "session_id": session_id, "body": body}
        with contextlib.suppress(ConnectionClosed, OSError):  # the reader starts over
            conn.send(json.dumps(frame))

    def _send(self, pending: Pending) -> None:
        with self._lock:
            conn, session_id = self._conn, self.session_id
        if conn is None:
            return  # sent once the reader has reconnected
        frame = dict(pending.frame, session_id=session_id)
        pending.sent = time.monotonic()
        pending.first_sent = pending.first_sent or pending.sent
        with contextlib.suppress(ConnectionClosed, OSError):  # sent again on reconnect
            conn.send(json.dumps(frame))

    def _route(self, frame: frames.Frame) -> None:
        if frame.type == "task.assign":
            assigned = assigned_of(frame.body)
            self._attempts.add(assigned)
            self.assignments.put(assigned)
        elif frame.type == "task.cancel":
            held = self._attempts.of_attempt(str(frame.body.get("attempt_id")))
            if held is None:
                return
            self.controls.put(revoke_control(held.task_id, frame.body))
        if frame.type in ("task.assign", "task.cancel"):
            with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
                os.write(self._wake_w, b"!")
            return
        with self._lock:
            pending = self._pending.get(frame.reply_to or "")
        if frame.type == "error" and frame.error is not None:
            error = ProtocolError(frame.error.code, frame.error.message)
            if error.code in FATAL:
                self._give_up(error)
                return
            if pending is not None:
                pending.error = error
                pending.done.set()
            elif error.code == Code.SESSION_MISMATCH and frame.reply_to is None:
                conn = self._conn  # replaced: this connection is over, the reader reconnects
                if conn is not None:
                    conn.close()
            return
        if pending is not None:
            pending.answer = {"type": frame.type, "body": frame.body}
            pending.done.set()

    def _give_up(self, error: PulseError) -> None:
        with self._lock:
            self._fatal = error
        self._closed.set()
        self._fail_all(error)
        conn = self._conn
        if conn is not None:
            conn.close()

    def _fail_all(self, error: PulseError) -> None:
        with self._lock:
            pending = list(self._pending.values())
        for item in pending:
            if not item.done.is_set():
                item.error = error
                item.done.set()
