"""What a gateway does with a ``revoke`` it heard (:mod:`.revokes`), for its instances.

* An attempt not started yet ends now: its claim revoked by the store's completion with
  the attempt's token (fenced: if the instance started it meanwhile, the start won and
  it is cancelled as a running one below), its result ``REVOKED``. The instance is told
  (``task.cancel``), so its Celery drops the request it holds.
* A started one is the instance's to stop: ``task.cancel`` carries ``terminate`` and the
  signal, and the worker's Celery does what a direct worker's does with them (a plain
  revoke doesn't stop a running task: it only keeps the id).
* Only instances whose current session is on this gateway are told: every gateway hears
  the broadcast and tells its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from websockets.frames import CloseCode

from celery_pulse.gateway import frames
from celery_pulse.gateway.cancels import cancel_body
from celery_pulse.gateway.expiry import REVOKED_REASON, NeverRun
from celery_pulse.gateway.frames import Frame, ProtocolError
from celery_pulse.gateway.link import Closing, Link
from celery_pulse.gateway.revokes import Revokes
from celery_pulse.gateway.session import FINISHED, LEASED, Instance, Sessions

logger = logging.getLogger("celery_pulse.gateway.server")

T = TypeVar("T")


class Revoking:
    """Celery's revoke for the gateway's instances (a part of the gateway's operations)."""

    app: Any
    store: Any
    name: str
    sessions: Sessions
    _holders: dict[str, str]
    #: The broadcast consumer once :meth:`listen_revokes` runs (None before, or without
    #: an app and a store).
    revokes: Revokes | None = None

    if TYPE_CHECKING:
        async def _store(self, call: Callable[..., T], *args: Any) -> T: ...
        def _link_of(self, instance: Instance) -> Link | None: ...
        def _spawn(self, work: Awaitable[None]) -> None: ...

    async def listen_revokes(self) -> None:
        """Hear Celery's revoke broadcast until cancelled (``celery pulse gateway`` runs
        it beside the server)."""
        if self.app is None or self.store is None:
            return
        loop = asyncio.get_running_loop()

        def heard(task_ids: list[str], terminate: bool, signal: str | None,
                  destination: list[str] | None) -> None:
            loop.call_soon_threadsafe(
                self._spawn, self._revoke(task_ids, terminate, signal, destination))

        self.revokes = Revokes(self.app, self.name, heard)
        self.revokes.start()
        try:
            await asyncio.Event().wait()
        finally:
            self.revokes.stop()

    def _is_revoked(self, task_id: str) -> bool:
        """For the feeders: a delivery of a revoked task is never assigned."""
        return self.revokes is not None and self.revokes.is_revoked(task_id)

    async def _revoke(self, task_ids: list[str], terminate: bool, signal: str | None,
                      destination: list[str] | None) -> None:
        wanted = set(task_ids)
        everything = destination is None or (self.revokes is not None
                                             and self.revokes.node in destination)
        for instance in self.sessions.instances():
            holder = self._holders.get(instance.instance_id)
            if holder is None or not (everything or holder in (destination or ())):
                continue
            with instance.lock:
                held = [a for a in instance.attempts.values()
                        if a.task_id in wanted and a.state != FINISHED]
            unstarted = [a for a in held if a.state == LEASED and a.token]
            if unstarted:
                try:
                    ended = await self._store(NeverRun(self.app, self.store, holder).end,
                                              unstarted, REVOKED_REASON)
                except ProtocolError as exc:  # their leases expire; the feeder ends them then
                    logger.warning("pulse gateway: revoking %d task(s) of %s failed: %s",
                                   len(unstarted), holder, exc.message)
                    ended = []
                for attempt in ended:
                    attempt.state = FINISHED
            link, session = self._link_of(instance), instance.current
            if not held or link is None or session is None:
                continue
            for attempt in held:
                body = cancel_body(attempt.wire_task_id, attempt.attempt_id, attempt.epoch,
                                   terminate, signal)
                try:
                    link.send(Frame("task.cancel", frames.new_id(), body, session.session_id))
                except Closing:
                    asyncio.get_running_loop().create_task(
                        link.close(CloseCode.POLICY_VIOLATION, "slow consumer"))
                    break
                logger.info("pulse gateway: revoke of %s[%s] sent to %s%s",
                            attempt.task_name, attempt.task_id, holder,
                            " (terminate)" if terminate else "")
