"""Recover: take over claims whose lease expired by the store clock.

The mechanism only (no Celery, no SQL). Every ``interval`` a worker asks the store
for up to ``batch`` expired claims (the store hands each to exactly one scanner,
under a new epoch) and acts on the verdict:

* ``open``: the task never started, or its policy is ``redispatch``: re-publish the
  stored message (same task id, same routing), then mark it published. A scanner
  that dies in between leaves a short publish lease that the next scan takes over.
* ``needs_review``: a started attempt of a non-idempotent task was lost: its outcome
  is unknown; a human decides (``celery pulse review``).
* ``failed``: the attempt budget is spent.

The same thread purges finished claims past the retention window, in small batches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from celery_pulse.errors import PulseError
from celery_pulse.store.base import OPEN, Recovered, RecoverStore

logger = logging.getLogger(__name__)


class RecoverListener(Protocol):
    def on_recovered(self, item: Recovered) -> None: ...


class Recoverer:
    """Periodic scanner for expired claims."""

    def __init__(self, store: RecoverStore, scanner: str, *, interval: float, batch: int,
                 publish_ttl: float, retention: float, purge_every: float = 60.0,
                 publish: Callable[[Recovered], None], listener: RecoverListener,
                 purge: Callable[[float], int] | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.scanner = scanner
        self.interval = interval
        self.batch = batch
        self.publish_ttl = publish_ttl
        self.retention = retention
        self.purge_every = purge_every
        self.publish = publish
        self.listener = listener
        self.purge = purge
        self.monotonic = monotonic
        self.counts = {"recovered": 0, "redispatched": 0, "needs_review": 0, "failed": 0,
                       "purged": 0}
        self._next_purge = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pulse-recover", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            delay = self.interval
            try:
                taken = self.scan_once()
                if len(taken) >= self.batch:
                    delay = 0.0  # more are waiting
                self.maybe_purge()
            except PulseError as exc:
                logger.warning("pulse: recover scan failed: %s", exc)
            except Exception:
                logger.exception("pulse: recover scan failed unexpectedly")
            self._stop.wait(delay)

    def scan_once(self) -> list[Recovered]:
        taken = self.store.recover(self.scanner, self.batch, self.publish_ttl)
        published: list[tuple[str, int, str]] = []
        for item in taken:
            self.counts["recovered"] += 1
            if item.state == OPEN and item.token is not None:
                try:
                    self.publish(item)
                except Exception as exc:
                    # Not marked published: its publish lease expires and a later
                    # scan (ours or another worker's) tries again.
                    logger.error("pulse: re-publishing %s failed, will retry: %r",
                                 item.task_id, exc)
                    continue
                published.append((item.task_id, item.epoch, item.token))
                self.counts["redispatched"] += 1
                logger.warning("pulse: recovered %s[%s] (was %s): re-dispatched as epoch %d",
                               item.task_name, item.task_id, item.was, item.epoch)
            elif item.state == OPEN:
                continue
            else:
                self.counts[item.state] = self.counts.get(item.state, 0) + 1
                logger.warning("pulse: recovered %s[%s] (was %s): %s", item.task_name,
                               item.task_id, item.was, item.state.replace("_", " "))
            try:
                self.listener.on_recovered(item)
            except Exception:
                logger.exception("pulse: recover listener failed")
        if published:
            self.store.mark_published(published)
        return taken

    def maybe_purge(self) -> None:
        if self.purge is None:
            return
        now = self.monotonic()
        if now < self._next_purge:
            return
        self._next_purge = now + self.purge_every
        purged = self.purge(self.retention)
        self.counts["purged"] += purged
        if purged:
            logger.info("pulse: purged %d finished claim(s) older than %gs", purged,
                        self.retention)
