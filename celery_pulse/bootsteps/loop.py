"""Run callables on the consumer's event loop, in order, from any thread."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class LoopCaller:
    """FIFO hand-off to the hub (``hub.call_soon`` itself keeps no order).

    Broker channels are not thread-safe: acks, terminates and event sends happen on
    the loop thread. Without a hub (a broker that needs Celery's synchronous loop)
    callables run inline.
    """

    def __init__(self, hub: Any) -> None:
        self.hub = hub
        self._queue: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque())
        self._lock = threading.Lock()
        self._scheduled = False

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.hub is None:
            fn(*args)
            return
        with self._lock:
            self._queue.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        self.hub.call_soon(self._drain)

    def later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        if self.hub is None:
            threading.Timer(delay, fn, args).start()
        else:
            self.call(self.hub.call_later, delay, fn, *args)

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
