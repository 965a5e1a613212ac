"""Finishing chords in a ``-P pulse`` worker's parent, with the ``pulse://`` backend.

A chord part's completion counts it in the store, in the completion's transaction
(fenced: a stale attempt never counts). The completion whose count makes the chord whole
hands it here: one thread joins the parts' results and publishes the callback (Celery's
own ``on_chord_part_return`` does both), off the consumer loop and the commit thread,
which must never wait for the broker. The leader finishes chords whose counting worker
died before it could (:meth:`ChordFinisher.recover`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.chords")

#: How long a whole count may wait for its callback before the leader publishes it: far
#: more than the counting worker takes (it publishes right after the commit).
RECOVER_AFTER = 60.0


class ChordFinisher:
    """A thread that finishes the chords this worker's completions made whole."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._queue: queue.Queue[tuple[dict[str, Any], int, str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    @staticmethod
    def wanted(backend: Any) -> bool:
        return callable(getattr(backend, "finish_chord", None))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pulse-chords", daemon=True)
        self._thread.start()

    def counted(self, part: dict[str, Any], count: int, nonce: str) -> None:
        """A part's completion counted it (from the commit thread or the loop)."""
        self._queue.put((part, count, nonce))

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what was counted (completions are flushed before this), then stop."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            part, count, nonce = item
            try:
                if self.backend.finish_chord(part, count, nonce):
                    logger.info("pulse: chord %s complete (%d parts): callback published",
                                part.get("group"), count)
            except Exception:
                # Left for the leader's recovery (the counter stays whole).
                logger.exception("pulse: finishing chord %s failed", part.get("group"))

    def recover(self) -> int:
        """The leader's sweep: chords whole for :data:`RECOVER_AFTER` s, not finished."""
        finished: int = self.backend.recover_chords(RECOVER_AFTER)
        if finished:
            logger.warning("pulse: published the callback of %d chord(s) whose last part's "
                           "worker did not", finished)
        return finished
