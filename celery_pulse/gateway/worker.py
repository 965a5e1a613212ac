"""A ``celery worker -P pulse`` that talks only to a lease gateway (``pulse_gateway_url``).

The worker's lease machinery stays what it is (the keeper, its deadlines, ``LeaseLost``,
the hard stop); only its store and its broker are the gateway:

* :class:`GatewayStore` is the store the keeper and the registry talk to. A reservation
  is the grant the gateway made when it assigned the task (it reserved the delivery
  before the broker was acknowledged); a start, a renewal and a completion are
  ``task.start``, ``task.renew`` and ``task.finish``. A reservation not started yet is
  reported *busy* on renewal: still valid, not extended (the gateway renews only started
  attempts), so its local deadline is the reservation's and it is dropped, never run,
  once that passes.
* The broker is :mod:`celery_pulse.gateway.transport` (``pulsegw://``): deliveries are
  the ``task.assign`` frames; acknowledging is a no-op (the gateway did it); nothing can
  be published.
* What needs the database or the broker is off: Recover, the beat, retention, remote
  control, events (docs/gateway.md lists it). Concurrency permits travel with the start
  (the gateway takes them in the store; a start without room is answered ``WAITING``).

The keeper's lease TTL is the gateway's lease duration (``lease_duration_ms``), never
longer: a local deadline must end before the store could give the task to anyone else.
"""

from __future__ import annotations

import hmac
import json
import logging
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from celery_pulse.errors import InvalidConfig, NotRegistered, StoreUnavailable
from celery_pulse.gateway.client import Answer, Assigned, GatewayClient, Pending
from celery_pulse.gateway.frames import Code, ProtocolError
from celery_pulse.gateway.protocol import MAX_CAPABILITIES, MAX_LABEL, RETRY_CODE, REVOKED_CODE
from celery_pulse.gateway.replies import UNANSWERED
from celery_pulse.gateway.routing import declared
from celery_pulse.settings import Settings
from celery_pulse.store.base import (
    FAILED,
    NEEDS_REVIEW,
    RETRY,
    REVOKED,
    SUCCEEDED,
    ClaimStore,
    Completion,
    Exchanged,
    Grant,
    Heartbeat,
    LeaseKey,
    Permit,
    PermitSignals,
    Refusal,
    Registration,
    RegistryStore,
    ReserveRequest,
)
from celery_pulse.store_urls import mask_url

logger = logging.getLogger(__name__)

#: One operation sent about a lease: its task id, its assignment, the answer to come.
_Asked = tuple[str, Assigned, Pending]

#: Claim outcomes as the protocol's, with the error code a failure carries.
OUTCOMES = {SUCCEEDED: ("SUCCEEDED", None), FAILED: ("FAILED", "celery.failure"),
            REVOKED: ("FAILED", REVOKED_CODE), NEEDS_REVIEW: ("UNKNOWN", "celery.unknown"),
            RETRY: ("FAILED", RETRY_CODE)}
#: The gateway's dispositions as the store's completion answers.
ANSWERS = {"APPLIED": "applied", "DUPLICATE": "duplicate", "EVIDENCE_ONLY": "evidence"}

#: A start's disposition when a permit it needs is not free (held, renewed, not run).
WAITING = "WAITING"

#: The header the transport puts the assignment's epoch in: which grant a delivery is.
EPOCH_HEADER = "pulse_gateway_epoch"

_clients: dict[str, GatewayClient] = {}
_clients_lock = threading.Lock()


def credentials_token(path: str) -> str:
    """The token in a credentials file (``celery pulse credentials create --output``)."""
    try:
        with open(path) as fh:
            token = json.load(fh)["token"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidConfig(f"pulse_gateway_credentials: cannot read a token from {path!r} "
                            f"({exc})", setting="pulse_gateway_credentials") from None
    if not isinstance(token, str):
        raise InvalidConfig(f"pulse_gateway_credentials: {path!r} holds no token",
                            setting="pulse_gateway_credentials")
    return token


def connect_worker(settings: Settings, queue: str, capacity: int, handlers: Sequence[str]
                   ) -> GatewayClient:
    """This process's gateway client (one per URL, shared with the transport), started."""
    assert settings.gateway_url is not None and settings.gateway_credentials is not None
    with _clients_lock:
        client = _clients.get(settings.gateway_url)
        if client is not None:
            return client
        context = ssl.create_default_context(cafile=settings.gateway_ca)
        client = GatewayClient(
            settings.gateway_url, credentials_token(settings.gateway_credentials),
            queue_id=queue, capacity=capacity,
            capabilities=[{"handler": name, "handler_version": "1", "payload_version": "1"}
                          for name in declared(handlers, MAX_CAPABILITIES, MAX_LABEL)],
            ssl_context=context if settings.gateway_url.startswith("wss:") else None)
        try:
            client.start()
        except ProtocolError as exc:
            client.close()
            if exc.code in (Code.UNAUTHENTICATED, Code.FORBIDDEN):
                raise InvalidConfig(f"pulse_gateway_credentials: the gateway refused them "
                                    f"for queue {queue!r}: {exc.code}: {exc.message}",
                                    setting="pulse_gateway_credentials") from None
            raise StoreUnavailable(f"pulse_gateway_url: the gateway at "
                                   f"{mask_url(settings.gateway_url)} answered {exc.code}"
                                   ) from None
        except Exception as exc:  # TLS, DNS, refused connection, handshake
            client.close()
            raise StoreUnavailable(f"pulse_gateway_url: cannot reach the gateway at "
                                   f"{mask_url(settings.gateway_url)}: {exc}") from None
        _clients[settings.gateway_url] = client
        return client


def client_for(url: str) -> GatewayClient | None:
    with _clients_lock:
        return _clients.get(url)


class GatewayStore(RegistryStore, ClaimStore):
    """The store a gateway worker's keeper and registry use (see the module's rules)."""

    #: A reservation is the gateway's assignment, looked up here: no round trip.
    local_reservations = True

    def __init__(self, client: GatewayClient, url: str) -> None:
        self.client = client
        self.url = mask_url(url)  # shown (inspect stats), never used to connect

    def _find(self, task_id: str, epoch: int, token: str) -> Assigned | None:
        found = self.client.assigned_for(task_id, epoch)
        if found is None or not hmac.compare_digest(found.ref["lease_secret"], token):
            return None
        return found

    def _submit_each(self, leases: Sequence[LeaseKey], kind: str,
                     permits: Mapping[str, Sequence[Permit]] | None = None) -> list[_Asked]:
        """Send ``kind`` for each lease the gateway assigned us (the others are skipped:
        not ours, lost), without waiting for any answer; a start with the permits it needs
        (:mod:`celery_pulse.gateway.permits`)."""
        asked = []
        for task_id, epoch, token in leases:
            assigned = self._find(task_id, epoch, token)
            if assigned is not None:
                body: Mapping[str, Any] = assigned.ref
                needs = permits.get(task_id) if permits else None
                if needs:
                    body = {**body, "permits": [
                        {"key": p.key, "limit": p.limit} | (
                            {} if p.window is None else {"window_ms": round(p.window * 1000)})
                        for p in needs]}
                asked.append((task_id, assigned, self.client.submit(kind, body)))
        return asked

    def _collect(self, asked: list[_Asked]
                 ) -> tuple[list[tuple[str, Answer | ProtocolError]], ProtocolError | None]:
        """Each task's answer, or the refusal it met; and the refusal saying the gateway
        could not answer, if one did (the caller raises it, once every answer is in)."""
        answers: list[tuple[str, Answer | ProtocolError]] = []
        unavailable: ProtocolError | None = None
        for task_id, assigned, pending in asked:
            try:
                answer: Answer | ProtocolError = self.client.attempt_answer(assigned, pending)
            except ProtocolError as exc:
                if exc.code in UNANSWERED:
                    unavailable = exc
                answer = exc
            answers.append((task_id, answer))
        return answers, unavailable

    def _submit_finishes(self, completions: Sequence[Completion]
                         ) -> tuple[dict[str, str], list[tuple[Completion, _Asked]]]:
        out: dict[str, str] = {}
        sent = []
        for c in completions:
            assigned = self._find(c.task_id, c.epoch, c.token)
            if assigned is None:
                out[c.task_id] = "evidence"
                continue
            outcome, code = OUTCOMES.get(c.outcome, ("FAILED", "celery.failure"))
            result: dict[str, Any] = {"error": (c.error or "")[:2000]}
            if c.result is not None and c.result.value is not None:
                result = {"celery_meta": json.loads(c.result.value)}
            if c.published:  # published by the gateway before it applies the finish
                result["publish"] = list(c.published)
            pending = self.client.submit_finish(assigned, outcome, result, code)
            sent.append((c, (c.task_id, assigned, pending)))
        return out, sent

    def _collect_finishes(self, out: dict[str, str], sent: list[tuple[Completion, _Asked]]
                          ) -> ProtocolError | None:
        unavailable: ProtocolError | None = None
        for c, (_, assigned, pending) in sent:
            try:
                answer = self.client.finish_answer(assigned, pending)
            except ProtocolError as exc:
                if exc.code in UNANSWERED:
                    unavailable = exc  # kept: the finish is sent again when retried
                    continue
                out[c.task_id] = "evidence"
            else:
                out[c.task_id] = ANSWERS.get(answer.disposition or "", "evidence")
            self._forget(c.task_id, c.epoch)
        return unavailable

    @staticmethod
    def _started(answers: list[tuple[str, Answer | ProtocolError]],
                 waiting: set[str] | None = None) -> dict[str, float]:
        # (refused: lost; its finish, if any, is evidence. WAITING: held, no permit yet)
        started: dict[str, float] = {}
        for task_id, answer in answers:
            if isinstance(answer, ProtocolError) or not answer.active:
                continue
            if answer.disposition == WAITING:
                if waiting is not None:
                    waiting.add(task_id)
            else:
                started[task_id] = 0.0
        return started

    def _forget(self, task_id: str, epoch: int) -> None:
        found = self.client.assigned_for(task_id, epoch)
        if found is not None:
            self.client.forget(found.ref)

    # -- the registry: the session stands for it ---------------------------------------
    def now(self) -> float:
        raise NotImplementedError("a gateway worker has no store clock")

    def check_schema(self) -> None:
        return None

    def close(self) -> None:
        return None  # the transport's connection closes the client

    def register(self, worker_id: str, labels: Mapping[str, Any], ttl: float, *,
                 replace_live: bool = True) -> Registration:
        return Registration(worker_id, "gateway-session", time.time() + ttl)

    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        if self.client.fatal is not None:
            raise NotRegistered(f"{worker_id}: the gateway ended this worker "
                                f"({self.client.fatal})", reason=NotRegistered.REPLACED)
        return Heartbeat(time.time() + ttl, self.client.draining)

    def deregister(self, worker_id: str, token: str) -> bool:
        return True

    def list_workers(self) -> list[Any]:
        return []

    def set_drain(self, worker_id: str, draining: bool, who: str) -> None:
        raise NotImplementedError

    # -- claims ------------------------------------------------------------------------
    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]:
        out: list[Grant | Refusal] = []
        for request in requests:
            epoch = int((request.message.headers or {}).get(EPOCH_HEADER) or 0)
            a = self.client.assigned_for(request.task_id, epoch)
            if a is None:
                out.append(Refusal(request.task_id, "taken", "unknown", None, 0, 0))
                continue
            # The gateway reserved it for this instance; the lease it reports is the
            # store's (the keeper's deadline counts from this call, on its own clock,
            # and a start refused later costs nothing: never run).
            out.append(Grant(a.task_id, int(a.ref["epoch"]), a.ref["lease_secret"],
                             0.0, 1))
        return out

    def start_many(self, holder: str, leases: Sequence[LeaseKey], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]:
        answers, unavailable = self._collect(self._submit_each(leases, "task.start", permits))
        self._raise_if_unavailable(unavailable)
        return self._started(answers, waiting)

    def renew(self, holder: str, leases: Sequence[LeaseKey], ttl: float
              ) -> tuple[set[str], set[str]]:
        renewed: set[str] = set()
        busy: set[str] = set()
        answers, unavailable = self._collect(self._submit_each(leases, "task.renew"))
        self._raise_if_unavailable(unavailable)
        for task_id, answer in answers:
            if isinstance(answer, ProtocolError):
                if answer.code == Code.STATE_CONFLICT:  # not started: valid, not extended
                    busy.add(task_id)
                # else lost
            elif answer.active and answer.disposition == "BUSY":
                busy.add(task_id)  # still held, not extended: the deadline stays
            elif answer.active:
                renewed.add(task_id)
        return renewed, busy

    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        out, sent = self._submit_finishes(completions)  # all sent, then all awaited
        self._raise_if_unavailable(self._collect_finishes(out, sent))
        return out

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged:
        """The worker's hot path: its finishes and starts all sent before the first
        answer is awaited (the gateway applies them side by side, each attempt's in
        order), so an exchange costs one round trip to the gateway, not one per task.
        If it raises, a start that did apply is answered ``APPLIED`` again when sent
        again, and a finish ``DUPLICATE``."""
        out, sent = self._submit_finishes(completions)
        starting = self._submit_each(starts, "task.start", permits)
        unavailable = self._collect_finishes(out, sent)
        answers, refused = self._collect(starting)
        self._raise_if_unavailable(unavailable or refused)
        waiting: set[str] = set()
        started = self._started(answers, waiting)
        return Exchanged(out, self.reserve(holder, reserves, ttl) if reserves else [],
                         started, {}, frozenset(waiting))

    def release(self, holder: str, leases: Sequence[LeaseKey], *,
                never_ran: bool = False) -> int:
        # No protocol operation gives a lease back: it expires at the gateway, and
        # Recover (there, or in any direct worker) re-dispatches it.
        for task_id, epoch, _ in leases:
            self._forget(task_id, epoch)
        return 0

    def permit_signals(self) -> AbstractContextManager[PermitSignals] | None:
        return None

    def purge_finished(self, older_than: float, limit: int = 500,
                       budget: float | None = None) -> int:
        return 0

    def list_claims(self, states: Sequence[str] | None = None, limit: int = 1000
                    ) -> list[Any]:
        return []

    def claim_counts(self) -> dict[str, int]:
        return {}

    @staticmethod
    def _raise_if_unavailable(exc: ProtocolError | None) -> None:
        if exc is not None and exc.code in UNANSWERED:
            raise StoreUnavailable(f"the gateway could not answer: {exc.message}") from exc
