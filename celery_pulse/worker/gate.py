"""Pause and resume task consumption from any thread, for any number of reasons."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.gate")


class ConsumeGate:
    """Consumption is on only while no reason to pause is held.

    ``close``/``open`` may be called from any thread; the actual
    ``task_consumer.cancel()/consume()`` runs on the consumer's event loop
    (py-amqp channels are not thread-safe, and calling them inside a delivery
    callback breaks amqp), and reads the current state, so the order in which
    deferred calls run does not matter.
    """

    def __init__(self, consumer: Any, on_pause: Callable[[], Any] | None = None,
                 on_resume: Callable[[], Any] | None = None) -> None:
        self.consumer = consumer
        #: Called on the loop right after consumption stops / starts again.
        self.on_pause = on_pause
        self.on_resume = on_resume
        self._reasons: set[str] = set()
        self._lock = threading.Lock()
        self._paused = False

    @property
    def reasons(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._reasons)

    @property
    def is_open(self) -> bool:
        with self._lock:
            return not self._reasons

    def close(self, reason: str) -> None:
        with self._lock:
            changed = reason not in self._reasons
            self._reasons.add(reason)
        if changed:
            self._schedule()

    def open(self, reason: str) -> None:
        with self._lock:
            changed = reason in self._reasons
            self._reasons.discard(reason)
        if changed:
            self._schedule()

    def reapply(self) -> None:
        """After a broker reconnect the new task consumer consumes: pause it again."""
        self._paused = False
        self._schedule()

    def _schedule(self) -> None:
        hub = getattr(self.consumer, "hub", None)
        if hub is not None:
            hub.call_soon(self.apply)
        else:  # no event loop (never the case with the pulse pool): best effort
            self.apply()

    def apply(self) -> None:
        """Make consumption match the gate. Runs on the event loop."""
        task_consumer = getattr(self.consumer, "task_consumer", None)
        if task_consumer is None:
            return
        with self._lock:
            want_paused = bool(self._reasons)
            reasons = sorted(self._reasons)
        if want_paused and not self._paused:
            task_consumer.cancel()
            self._paused = True
            logger.warning("pulse: stopped consuming (%s)", ", ".join(reasons))
            if self.on_pause is not None:
                self.on_pause()
        elif not want_paused and self._paused:
            task_consumer.consume()
            self._paused = False
            logger.warning("pulse: consuming again")
            if self.on_resume is not None:
                self.on_resume()
