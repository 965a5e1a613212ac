"""Celery's ``revoke`` broadcast, heard by a gateway for the remote workers it serves.

A Celery worker hears ``revoke`` (``AsyncResult.revoke()``, ``celery control revoke``)
on its broker's remote-control broadcast; a remote worker has no broker. So every gateway
process consumes that broadcast (a queue of its own, as one more worker would) and, for
``revoke`` only (the other commands are about direct workers and stay theirs):

* keeps the ids as a Celery worker keeps them (Celery's ``LimitedSet``: the latest 50,000
  for 3 hours, in memory, so a restart forgets them, as a worker without ``--statedb``),
  so a delivery of a revoked task is never assigned: its claim ends revoked;
* hands the ids to the gateway, which ends its instances' attempts of them not started
  yet and sends ``task.cancel`` to the instance holding each (:mod:`.cancels`).

``destination``, when the revoke names one, is honoured: this gateway's node name
(``pulse-gateway@<host>:<pid>``: everything it serves, the kept ids included) or the
holder name of an instance (``gw:<credential>:<instance id>``: what that instance holds).
No reply is sent (a ``revoke(..., reply=True)`` hears from the direct workers only).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from celery_pulse.gateway.dispatch import consume_until_stopped

logger = logging.getLogger("celery_pulse.gateway.server")

#: Celery's own bounds for a worker's revoked ids (celery.worker.state).
REVOKES_MAX, REVOKE_EXPIRES = 50_000, 10_800.0

#: ``(task ids, terminate, signal, destination)``, called in the listener's thread.
OnRevoke = Callable[[list[str], bool, "str | None", "list[str] | None"], None]


class Revokes(threading.Thread):
    """The broadcast consumer (one thread; see the module's rules)."""

    def __init__(self, app: Any, name: str, on_revoke: OnRevoke) -> None:
        super().__init__(name="pulse-gateway-revokes", daemon=True)
        from celery.utils.collections import LimitedSet

        self.app, self.on_revoke = app, on_revoke
        #: This gateway as a remote-control node (its queue, and a ``destination``).
        self.node = f"pulse-gateway@{name}"
        self.revoked = LimitedSet(maxlen=REVOKES_MAX, expires=REVOKE_EXPIRES)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: Set once the broadcast is consumed (a revoke sent before is not heard).
        self.listening = threading.Event()

    def is_revoked(self, task_id: str) -> bool:
        with self._lock:
            return task_id in self.revoked

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        consume_until_stopped(self._stop, self._consume, "hearing the revoke broadcast")

    def _consume(self) -> None:
        mailbox = self.app.control.mailbox
        with self.app.connection_for_read() as conn:
            queue = mailbox.get_queue(self.node)
            with conn.Consumer([queue], callbacks=[self._on_message], no_ack=True,
                               accept=mailbox.accept):
                try:
                    while not self._stop.is_set():
                        with contextlib.suppress(TimeoutError):
                            conn.drain_events(timeout=0.5)
                        # Said after the first turn: on Redis the subscription is sent
                        # by the first drain, not by the consumer's creation.
                        if not self.listening.is_set():
                            self.listening.set()
                            logger.info("pulse gateway: hearing Celery's revoke broadcast "
                                        "(%s)", queue.name)
                finally:
                    self.listening.clear()

    def _on_message(self, body: Any, message: Any) -> None:
        if not isinstance(body, dict) or body.get("method") != "revoke":
            return
        arguments = body.get("arguments") or {}
        ids = arguments.get("task_id")
        task_ids = [ids] if isinstance(ids, str) else [str(i) for i in ids or ()]
        if not task_ids:
            return
        destination = body.get("destination")
        if destination is None or self.node in destination:  # ours to keep
            with self._lock:
                for task_id in task_ids:
                    self.revoked.add(task_id)
        signal = arguments.get("signal")
        try:
            self.on_revoke(task_ids, bool(arguments.get("terminate")),
                           signal if isinstance(signal, str) else None,
                           None if destination is None else list(destination))
        except Exception:
            logger.exception("pulse gateway: handling a revoke failed")
