"""Deliveries of a new publication of a task this worker still holds, until it ends.

A retry, a ``Task.replace`` or an id sent again may arrive while the previous attempt of
its task id is live here: it runs once that attempt has ended (one holder never asks
twice for one task). Its end wakes the waiters at once (:meth:`EndWaiters.ended`); each
also looks again every :data:`WAIT_POLL` seconds, in case no end is reported. On the
consumer's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_pulse.worker.loop import LoopCaller

#: A delivery waiting for an attempt of its task id to end looks again this often
#: (seconds), in case no end is reported (the end normally wakes it at once).
WAIT_POLL = 1.0


class Waiting:
    """A delivery parked until an attempt of its task id ends (fired once)."""

    __slots__ = ("args", "fired", "handler")

    def __init__(self, handler: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.handler = handler
        self.args = args
        self.fired = False


class EndWaiters:
    """Task ids held locally -> deliveries of a new publication waiting for the end."""

    def __init__(self, loop: LoopCaller) -> None:
        self.loop = loop
        self.entries: dict[str, list[Waiting]] = {}

    def park(self, task_id: str, handler: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """``handler(*args)`` runs again once an attempt of ``task_id`` ends."""
        entry = Waiting(handler, args)
        self.entries.setdefault(task_id, []).append(entry)
        self.loop.later(WAIT_POLL, self._fire, task_id, entry)

    def ended(self, task_id: str) -> None:
        """On the loop: an attempt of ``task_id`` held here ended; look at its waiters.

        Without a hub (Celery's synchronous loop) this may be called from a pool or store
        thread: the waiters' own poll (``WAIT_POLL``) picks them up instead.
        """
        if self.loop.hub is None:
            return
        for entry in self.entries.pop(task_id, []):
            self._fire(task_id, entry)

    def forget(self) -> int:
        """After a broker reconnect (their delivery tags are dead): how many were dropped."""
        dropped = 0
        for entries in self.entries.values():
            for entry in entries:
                entry.fired = True
                dropped += 1
        self.entries.clear()
        return dropped

    def _fire(self, task_id: str, entry: Waiting) -> None:
        if entry.fired:
            return
        entry.fired = True
        waiters = self.entries.get(task_id)
        if waiters is not None:
            waiters[:] = [w for w in waiters if w is not entry]
            if not waiters:
                del self.entries[task_id]
        entry.handler(*entry.args)
