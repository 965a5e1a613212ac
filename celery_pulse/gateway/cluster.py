"""What makes gateway processes interchangeable: the sessions and attempts every one of
them reads from the store (:mod:`celery_pulse.store.gateway_state`), so a worker's hello,
``worker.resume``, ``task.start``, ``task.renew`` and ``task.finish`` are answered by
whichever gateway the load balancer picks, and a restart loses nothing.

The rules, before any code:

* **The store opens every session.** A hello moves its instance to the next generation
  in the store (:meth:`Cluster._open`); a gateway holding an older one learns it within
  ``session_check`` (:meth:`Cluster.watch_sessions`: one statement for all its sessions)
  and closes it with ``SESSION_MISMATCH``, and stops feeding the instance.
* **Capacity is the instance's.** A new session counts the attempts its instance holds
  in the store wherever they were assigned (:meth:`Cluster._adopt_live`); only the
  gateway holding the current generation feeds it.
* **Attempts are looked up, never trusted.** An attempt a gateway never saw is read from
  its record (written before its ``task.assign`` was sent: :meth:`Cluster._recorder`),
  checked against the frame's secret (a digest) and the claim; its state is the
  claim's. A re-sent operation is answered from the store's truth: a start already
  applied is APPLIED again, a finish already applied is DUPLICATE (its result written
  again, idempotently).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from celery_pulse.gateway import frames
from celery_pulse.gateway.clock import StoreClock
from celery_pulse.gateway.frames import Code, ProtocolError
from celery_pulse.gateway.receipts import attempt_key
from celery_pulse.gateway.session import (
    ATTEMPTS_KEPT,
    FINISHED,
    LEASED,
    RUNNING,
    Attempt,
    Instance,
    Session,
    Sessions,
    matches,
)
from celery_pulse.store.credentials import (
    CONSUME,
    Credential,
    CredentialStore,
    Forbidden,
    Unauthenticated,
    digest,
)
from celery_pulse.store.gateway_state import (
    AttemptRecord,
    GatewayState,
    IdentityChanged,
    Opened,
    identity_digest,
)

if TYPE_CHECKING:
    from celery_pulse.gateway.dispatch import Fenced
    from celery_pulse.gateway.link import Limits
    from celery_pulse.store.base import Store

logger = logging.getLogger("celery_pulse.gateway.server")

T = TypeVar("T")

#: A session replaced by a newer generation, as its connection is told.
REPLACED = "a newer session of this instance replaced this one"
#: Credentials older than this (the watch stalled) are read from the store per frame.
CREDENTIALS_STALE = 5.0
#: How often a gateway purges attempt records, and how long it keeps one whose claim no
#: longer runs under it (a late frame naming it after that is NOT_FOUND).
ATTEMPT_PURGE_EVERY = 600.0
ATTEMPTS_RETAINED = 3600.0


class Cluster:
    """The shared-state half of a gateway (a mixin of its operations)."""

    state: GatewayState | None
    store: Store | None
    credentials: CredentialStore
    clock: StoreClock
    #: The credentials of this gateway's sessions as last read, and when (monotonic).
    _credentials_now: dict[str, Credential]
    _credentials_read_at: float
    limits: Limits
    name: str
    now: Callable[[], float]
    sessions: Sessions
    _holders: dict[str, str]

    if TYPE_CHECKING:
        async def _store(self, call: Callable[..., T], *args: Any) -> T: ...
        def _fenced(self, instance: Instance) -> Fenced: ...
        def _stop_feeding(self, instance_id: str) -> None: ...
        def _end_session(self, session: Session, error: ProtocolError) -> None: ...

    async def _open(self, hello: frames.Hello, session_id: str) -> Opened:
        """The instance's next generation: the store's (every gateway sees it), or this
        gateway's own without shared state."""
        if self.state is None:
            known = self.sessions.get(hello.instance_id)
            return Opened((known.epoch if known is not None else 0) + 1)
        try:
            return await self._store(self.state.open_session, hello.instance_id, session_id,
                                     self.name,
                                     identity_digest(hello.queue_id, hello.capabilities))
        except IdentityChanged:
            raise ProtocolError(
                Code.STATE_CONFLICT,
                "a reconnect must keep its credential, queue and capabilities") from None

    async def _find(self, instance: Instance, ref: frames.AttemptRef) -> Attempt:
        """The attempt ``ref`` names: this gateway's, or (assigned by another gateway, or
        by this one before a restart) the store's record, checked against the frame's
        secret and the claim; ``NOT_FOUND`` otherwise."""
        key = attempt_key(ref)
        try:
            return instance.attempt(*key)
        except ProtocolError:
            if self.state is None or self.store is None:
                raise
        wire_id, attempt_id, epoch, secret = key
        record = await self._store(self.state.find_attempt, attempt_id)
        if record is None or record.instance_id != instance.instance_id:
            raise ProtocolError(Code.NOT_FOUND, "no such attempt for this instance")
        found = _adopted(record, time.monotonic() + self.limits.lease_ttl)
        if not matches(found, wire_id, epoch, secret):
            raise ProtocolError(Code.NOT_FOUND, "no such attempt for this instance")
        found.token = secret
        held = await self._store(self._fenced(instance).status, found)
        # No lease held: ended, or lost (the store says which when asked).
        found.state = _state_of(held[0] if held is not None else None)
        if held is not None:
            found.lease_until = held[1]
        instance.adopt([found])
        return instance.attempt(*key)

    async def _adopt_live(self, instance: Instance) -> None:
        """A new session counts the attempts its instance holds in the store, wherever
        they were assigned: capacity is the instance's, not one gateway's."""
        if self.state is None:
            return
        live = await self._store(self.state.live_attempts, instance.instance_id,
                                 self._holders[instance.instance_id])
        deadline = time.monotonic() + self.limits.lease_ttl
        adopted = [_adopted(record, deadline, _state_of(state))
                   for record, state in live[:ATTEMPTS_KEPT]]
        instance.adopt(adopted, live={a.attempt_id for a in adopted})

    def _recorder(self, instance: Instance) -> Callable[[list[Attempt]], None] | None:
        """What the feeder calls (in its thread) before assignments are sent."""
        state = self.state
        if state is None:
            return None

        def record(attempts: list[Attempt]) -> None:
            state.record_attempts([AttemptRecord(
                a.attempt_id, instance.instance_id, a.task_id, a.wire_task_id, a.epoch,
                digest(a.token), a.task_name) for a in attempts])
        return record

    # -- the watch: one loop per gateway, once a ``session_check`` ---------------------
    def _authority(self, instance: Instance) -> None:
        """May this instance's credential still consume its queue? From the credentials
        the watch read last (at most ``CREDENTIALS_STALE`` old; else the store is asked):
        no store round trip per frame. ``UNAUTHENTICATED``/``FORBIDDEN`` if not."""
        consuming(self._credentials_now.get(instance.identity.credential_id),
                  instance.identity.queue_id)

    def _credentials_fresh(self) -> bool:
        return time.monotonic() - self._credentials_read_at < CREDENTIALS_STALE

    async def watch_sessions(self) -> None:
        """Once a ``session_check``: read the store's clock, the credentials of this
        gateway's sessions and (with shared state) their generations, in three
        statements for all of them; end every session whose credential was revoked or
        lost its queue (``UNAUTHENTICATED``/``FORBIDDEN``) or that a newer generation
        replaced on another gateway (``SESSION_MISMATCH``); purge old attempt records now
        and then. Run it beside :meth:`serve`."""
        purged_at = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.limits.session_check)
            current = {i: inst for i in list(self._holders)
                       if (inst := self.sessions.get(i)) is not None
                       and inst.current is not None}
            try:
                await self._store(self.clock.sample)
                ids = {inst.identity.credential_id for inst in current.values()}
                read_at = time.monotonic()
                found = await self._store(self.credentials.get_credentials, ids)
                for credential_id in ids:
                    self._credentials_now.pop(credential_id, None)
                self._credentials_now.update(found)
                self._credentials_read_at = read_at
                generations: dict[str, int] = {}
                if self.state is not None:
                    generations = await self._store(self.state.generations, list(current))
                    if loop.time() - purged_at > ATTEMPT_PURGE_EVERY:
                        purged_at = loop.time()
                        await self._store(self.state.purge_attempts,
                                          self.clock.estimate() - ATTEMPTS_RETAINED)
            except ProtocolError as exc:
                logger.warning("pulse gateway: could not check sessions: %s", exc.message)
                continue
            for instance_id, instance in current.items():
                session = instance.current
                if session is None:
                    continue
                error: ProtocolError | None = None
                if generations.get(instance_id, 0) > session.epoch:
                    logger.info("pulse gateway: session %s of %s replaced on another "
                                "gateway", session.session_id, instance_id)
                    error = ProtocolError(Code.SESSION_MISMATCH, REPLACED)
                else:
                    try:
                        self._authority(instance)
                    except ProtocolError as exc:
                        logger.info("pulse gateway: ending session %s of %s: %s",
                                    session.session_id, instance_id, exc.message)
                        error = exc
                if error is not None:
                    instance.close(session)
                    self._stop_feeding(instance_id)
                    self._end_session(session, error)

def consuming(credential: Credential | None, queue: str) -> Credential:
    """``credential`` (None: there is none), if it may still consume ``queue``; else the
    protocol's ``UNAUTHENTICATED`` (gone, revoked, expired) or ``FORBIDDEN``."""
    try:
        if credential is None:
            raise Unauthenticated()
        credential.require(CONSUME, queue)
        return credential
    except Unauthenticated as exc:
        raise ProtocolError(Code.UNAUTHENTICATED, exc.message) from None
    except Forbidden as exc:
        raise ProtocolError(Code.FORBIDDEN, exc.message) from None


def _state_of(claim_state: str | None) -> str:
    """An attempt's state from its claim's: running, reserved, or no lease held."""
    if claim_state is None:
        return FINISHED
    return RUNNING if claim_state == "running" else LEASED


def _adopted(record: AttemptRecord, deadline: float, state: str = LEASED) -> Attempt:
    """An attempt from its store record: its token unknown until a frame proves it."""
    return Attempt(record.task_id, record.wire_task_id, record.attempt_id, record.epoch, "",
                   record.task_name, 0.0, deadline, state,
                   token_digest=record.token_digest)
