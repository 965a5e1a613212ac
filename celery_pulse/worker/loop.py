"""Run callables on the consumer's event loop, in order, from any thread."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.loop")

#: A drain scheduled this long ago that has not run is presumed lost and scheduled again.
#: kombu's hub runs the callbacks it popped in one go: one that raises (an ack on a
#: connection the broker just closed) throws away the rest, ours included.
STALE = 0.5


class _Kept:
    """A timer of :meth:`LoopCaller.later_kept` (hashed by identity)."""

    __slots__ = ("args", "due", "fn")

    def __init__(self, due: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.due, self.fn, self.args = due, fn, args


class LoopCaller:
    """FIFO hand-off to the hub (``hub.call_soon`` itself keeps no order).

    Broker channels are not thread-safe: acks, terminates and event sends happen on
    the loop thread. Without a hub (a broker that needs Celery's synchronous loop)
    callables run inline.
    """

    def __init__(self, hub: Any, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.hub = hub
        self._queue: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque())
        self._lock = threading.Lock()
        self._scheduled = False
        self._scheduled_at = 0.0
        self._monotonic = monotonic
        self._kept: set[_Kept] = set()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.hub is None:
            fn(*args)
            return
        with self._lock:
            self._queue.append((fn, args))
            now = self._monotonic()
            if self._scheduled and now - self._scheduled_at < STALE:
                return
            self._scheduled, self._scheduled_at = True, now
        self.hub.call_soon(self._drain)

    def rearm(self) -> None:
        """Schedule a drain whatever became of the last one (after a broker reconnect,
        the hub may have dropped it); a spare drain finds nothing and returns. Timers of
        :meth:`later_kept` not run yet are scheduled again (each still runs once)."""
        if self.hub is None:
            return
        now = self._monotonic()
        with self._lock:
            self._scheduled, self._scheduled_at = True, now
            kept = list(self._kept)
        self.hub.call_soon(self._drain)
        for entry in kept:
            self.call(self.hub.call_later, max(0.0, entry.due - now), self._fire_kept, entry)

    def later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        if self.hub is None:
            timer = threading.Timer(delay, fn, args)
            timer.daemon = True  # a retry due after exit is moot
            timer.start()
        else:
            self.call(self.hub.call_later, delay, fn, *args)

    def later_kept(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """:meth:`later`, for what must run even across a broker reconnect: Celery before
        5.6 clears the hub's timers on a reconnect (a permit waiter's retry lost there
        kept its keys' turn for good). :meth:`rearm` schedules it again."""
        if self.hub is None:
            self.later(delay, fn, *args)
            return
        entry = _Kept(self._monotonic() + delay, fn, args)
        with self._lock:
            self._kept.add(entry)
        self.call(self.hub.call_later, delay, self._fire_kept, entry)

    def _fire_kept(self, entry: _Kept) -> None:
        with self._lock:
            if entry not in self._kept:
                return  # ran already (its timer survived the reconnect too)
            self._kept.discard(entry)
        entry.fn(*entry.args)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._scheduled = False
                    return
                fn, args = self._queue.popleft()
            try:
                fn(*args)
            except Exception:
                logger.exception("pulse: loop callback %r failed", fn)
