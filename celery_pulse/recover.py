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

The same thread purges what is past the retention window every ``purge_every`` seconds,
a pass of small batches until nothing is left (:mod:`celery_pulse.store.retention`),
within :data:`PURGE_BUDGET` so its scans wait little (a pass cut short goes on at the
thread's next turn). And it gives claims back for another delivery when their holder
asks (:meth:`requeue`: Celery's ``Reject(requeue=True)`` and the other requeue paths),
publishing them the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from celery_pulse.errors import PulseError
from celery_pulse.service import Service
from celery_pulse.store.base import OPEN, LeaseKey, Recovered, RecoverStore

logger = logging.getLogger(__name__)

#: Longest one purge pass keeps Recover's thread (seconds).
PURGE_BUDGET = 1.0
#: The purge rate in the stats is the rows purged over the last this many seconds.
RATE_WINDOW = 60.0


class RecoverListener(Protocol):
    def on_redispatching(self, item: Recovered) -> None:
        """Recover took ``item`` back (not a requeue) and is about to re-publish it."""

    def on_recovered(self, item: Recovered) -> None:
        """Recover took ``item`` back (and re-published it, if ``open``)."""


class Recoverer(Service):
    """Periodic scanner for expired claims (thread ``pulse-recover``)."""

    def __init__(self, store: RecoverStore, scanner: str, *, interval: float, batch: int,
                 publish_ttl: float, retention: float, purge_every: float = 60.0,
                 publish: Callable[[Recovered], None], listener: RecoverListener,
                 purge: Callable[[float, float], int | None] | None = None,
                 lag: Callable[[float], float] | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        super().__init__("pulse-recover", join_timeout=10)
        self.store = store
        self.scanner = scanner
        self.interval = interval
        self.batch = batch
        self.publish_ttl = publish_ttl
        self.retention = retention
        self.purge_every = purge_every
        self.publish = publish
        self.listener = listener
        #: One purge pass (retention, budget): the claims purged, None when it is not this
        #: worker's job; ``lag`` reads how far behind retention is (the store's
        #: ``retention_lag``).
        self.purge = purge
        self.lag = lag
        self.monotonic = monotonic
        self.counts = {"recovered": 0, "redispatched": 0, "needs_review": 0, "failed": 0,
                       "purged": 0, "requeued": 0}
        self._next_purge = 0.0
        self._started = monotonic()
        self._lag: float | None = None
        self._purges: deque[tuple[float, int]] = deque()
        self._requeues: list[LeaseKey] = []
        self._lock = threading.Lock()

    def stop(self) -> None:
        super().stop()
        if self._requeues:  # still held by this worker: publish them before it goes
            try:
                self.requeue_pending()
            except PulseError as exc:
                logger.warning("pulse: could not requeue %d task(s) before exit (their "
                               "leases expire and Recover takes them): %s",
                               len(self._requeues), exc)

    def requeue(self, lease: LeaseKey) -> None:
        """Queue ``lease`` (held by this worker) to go back to the broker, soon."""
        with self._lock:
            self._requeues.append(lease)
        self.wake()

    def requeue_pending(self) -> list[Recovered]:
        with self._lock:
            leases, self._requeues = self._requeues, []
        if not leases:
            return []
        try:
            items = self.store.requeue(self.scanner, leases, self.publish_ttl)
        except PulseError:
            with self._lock:  # the leases are still ours until they expire: try again
                self._requeues[:0] = leases
            raise
        self._publish_all(items, requeued=True)
        return items

    def run(self) -> None:
        next_scan = 0.0
        while not self.stopping:
            delay = self.interval
            self.rearm()  # before the work: a requeue asked meanwhile wakes the next wait
            try:
                self.requeue_pending()
                if self.monotonic() >= next_scan:
                    next_scan = self.monotonic() + self.interval
                    taken = self.scan_once()
                    if len(taken) >= self.batch:
                        next_scan = 0.0  # more are waiting
                self.maybe_purge()
                due = next_scan if self.purge is None else min(next_scan, self._next_purge)
                delay = max(0.0, due - self.monotonic())
            except PulseError as exc:
                logger.warning("pulse: recover scan failed: %s", exc)
            except Exception:
                logger.exception("pulse: recover scan failed unexpectedly")
            self.sleep(delay)

    def scan_once(self) -> list[Recovered]:
        taken = self.store.recover(self.scanner, self.batch, self.publish_ttl)
        self._publish_all(taken)
        return taken

    def _publish_all(self, taken: list[Recovered], requeued: bool = False) -> None:
        """Re-publish the ``open`` ones, then mark them published in one statement.

        One not marked published keeps its publish lease: once that expires, a later
        scan (ours or another worker's) tries again.
        """
        published: list[LeaseKey] = []
        for item in taken:
            if item.state == OPEN and item.token is not None:
                if not requeued:
                    try:
                        self.listener.on_redispatching(item)
                    except Exception:
                        logger.exception("pulse: recover listener failed")
                try:
                    self.publish(item)
                except Exception as exc:
                    logger.error("pulse: publishing %s failed, Recover retries: %r",
                                 item.task_id, exc)
                    continue
                published.append((item.task_id, item.epoch, item.token))
                if requeued:
                    self.counts["requeued"] += 1
                    logger.info("pulse: %s[%s] requeued as epoch %d", item.task_name,
                                item.task_id, item.epoch)
                    continue
                self.counts["recovered"] += 1
                self.counts["redispatched"] += 1
                logger.warning("pulse: recovered %s[%s] (was %s): re-dispatched as epoch %d",
                               item.task_name, item.task_id, item.was, item.epoch)
            elif item.state == OPEN:
                continue
            else:
                self.counts["recovered"] += 1
                self.counts[item.state] = self.counts.get(item.state, 0) + 1
                logger.warning("pulse: recovered %s[%s] (was %s): %s", item.task_name,
                               item.task_id, item.was, item.state.replace("_", " "))
            try:
                self.listener.on_recovered(item)
            except Exception:
                logger.exception("pulse: recover listener failed")
        if published:
            self.store.mark_published(published)

    def maybe_purge(self) -> None:
        if self.purge is None:
            return
        began = self.monotonic()
        if began < self._next_purge:
            return
        self._next_purge = began + self.purge_every
        purged = self.purge(self.retention, PURGE_BUDGET)
        if purged is None:  # another worker's job (the leader's)
            with self._lock:
                self._lag = None
                self._purges.clear()
            return
        done = self.monotonic()
        if done - began >= PURGE_BUDGET:  # cut short: more may wait, go on at the next turn
            self._next_purge = done
        lag = self.lag(self.retention) if self.lag is not None else None
        with self._lock:
            self.counts["purged"] += purged
            self._lag = lag
            self._purges.append((done, purged))
        if purged:
            logger.info("pulse: purged %d finished claim(s) older than %gs", purged,
                        self.retention)

    def retention_stats(self) -> dict[str, Any]:
        """Retention's pace on this worker: ``lag`` (seconds the oldest finished claim is
        past retention, None: this worker does not purge) and ``purged_per_second``
        (finished claims over the last :data:`RATE_WINDOW` seconds)."""
        now = self.monotonic()
        with self._lock:
            while self._purges and self._purges[0][0] < now - RATE_WINDOW:
                self._purges.popleft()
            purged = sum(n for _, n in self._purges)
            lag = self._lag
        span = min(RATE_WINDOW, now - self._started)
        return {"lag": None if lag is None else round(lag, 3),
                "purged_per_second": round(purged / span, 3) if span > 0 else 0.0}
