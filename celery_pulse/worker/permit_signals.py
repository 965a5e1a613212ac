"""Freed concurrency permits, told to and heard from the other workers.

A hint that wakes this worker's waiters (:mod:`celery_pulse.worker.permit_waits`) at
once instead of at their next retry, never a grant: PostgreSQL's NOTIFY; without it,
waiting tasks only poll.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from celery_pulse.errors import PulseError
from celery_pulse.store.base import ClaimStore, Permit

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.permits")

#: Seconds the signal thread waits for an announcement before sending its own.
SIGNAL_POLL = 0.05


class PermitSignals:
    """Tells the other workers when this one gives permits back, and hears when they do
    (PostgreSQL's NOTIFY; without it, waiting tasks only poll). A thread of its own: a
    hint that wakes waiters at once instead of at their next retry, never a grant."""

    def __init__(self, store: ClaimStore, on_freed: Callable[[set[str]], None]) -> None:
        self.store = store
        self.on_freed = on_freed
        self._out: queue.SimpleQueue[tuple[str, ...]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.store.permit_signals() is None:
            return
        self._thread = threading.Thread(target=self._run, name="pulse-permits", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def announce(self, permits: tuple[Permit, ...]) -> None:
        if self._thread is not None:
            self._out.put(tuple(p.key for p in permits))

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            channel = self.store.permit_signals()
            if channel is None:
                return
            try:
                with channel as signals:
                    backoff = 0.5
                    while not self._stop.is_set():
                        keys: set[str] = set()
                        while not self._out.empty():
                            keys.update(self._out.get_nowait())
                        if keys:
                            signals.send(sorted(keys))
                        heard = signals.receive(SIGNAL_POLL)
                        if heard:
                            self.on_freed(heard)
            except PulseError as exc:
                logger.warning("pulse: permit signals unavailable (%s): waiting tasks poll", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception:
                logger.exception("pulse: permit signals failed")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
