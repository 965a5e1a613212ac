"""Leader election over the store (seed 001 ``LeaderElector``).

Rules:

* ``try_acquire`` is one atomic conditional upsert judged by the store clock; a
  renewal carries our token, so a stale leader can never extend a newer term.
* ``is_leader`` is true only before the local monotonic deadline
  ``sent_at(last successful acquire) + ttl - margin``: leadership ends here before
  the store could hand it to someone else.
* ``on_gained``/``on_lost`` fire on role changes (from the elector thread). A
  planned :meth:`stop` releases the lease and does not fire ``on_lost``.
* The first attempt is immediate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from celery_pulse.errors import PulseError
from celery_pulse.service import Service
from celery_pulse.store.base import LeaderGrant, LeaderStore

logger = logging.getLogger(__name__)


class LeaderElector(Service):
    """Campaigns for ``key`` every ``interval``; holds it for ``ttl`` (thread
    ``pulse-leader-<key>``)."""

    def __init__(self, store: LeaderStore, key: str, holder: str, *, ttl: float,
                 interval: float, margin: float,
                 on_gained: Callable[[LeaderGrant], None] | None = None,
                 on_lost: Callable[[LeaderGrant], None] | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if interval >= ttl:
            raise ValueError("leader interval must be shorter than its ttl")
        super().__init__(f"pulse-leader-{key}", join_timeout=interval + 10)
        self.store = store
        self.key = key
        self.holder = holder
        self.ttl = ttl
        self.interval = interval
        self.margin = margin
        self.on_gained = on_gained
        self.on_lost = on_lost
        self.monotonic = monotonic
        self.grant: LeaderGrant | None = None
        self.deadline = 0.0
        self.since: float | None = None
        self._lock = threading.Lock()

    @property
    def is_leader(self) -> bool:
        return self.grant is not None and self.monotonic() < self.deadline

    @property
    def epoch(self) -> int | None:
        grant = self.grant
        return grant.epoch if grant is not None and self.is_leader else None

    def stop(self) -> None:
        """Planned stop: release the lease (the next leader starts within one interval)."""
        super().stop()
        with self._lock:
            grant, self.grant = self.grant, None
        if grant is not None:
            try:
                self.store.release_leader(self.key, grant.token)
                logger.info("pulse: released leadership of %s (epoch %d)", self.key, grant.epoch)
            except PulseError as exc:
                logger.warning("pulse: could not release leadership of %s: %s", self.key, exc)

    def run(self) -> None:
        while not self.stopping:
            try:
                self.tick()
            except Exception:
                logger.exception("pulse: leader election failed unexpectedly")
            delay = self.interval
            if self.grant is not None:  # wake in time to notice our own deadline
                delay = max(0.01, min(delay, self.deadline - self.monotonic()))
            self.sleep(delay)

    def tick(self) -> None:
        with self._lock:
            if self.stopping:
                return
            current = self.grant
            sent = self.monotonic()
            try:
                grant = self.store.try_acquire(self.key, self.holder, self.ttl,
                                               token=current.token if current else None)
            except PulseError as exc:
                logger.warning("pulse: leader election for %s failed: %s", self.key, exc)
                if current is not None and self.monotonic() >= self.deadline:
                    self._lose(current, "no successful renewal before the local deadline")
                return
            if grant is None:
                if current is not None:
                    self._lose(current, "another holder has the lease")
                return
            if current is not None and grant.token != current.token:
                self._lose(current, "our term ended")
            self.grant = grant
            self.deadline = sent + self.ttl - self.margin
            if current is None or grant.token != current.token:
                self.since = time.time()
                # A role change is normal operation (start, failover, handover): INFO.
                logger.info("pulse: %s is now the leader of %s (epoch %d)", self.holder,
                            self.key, grant.epoch)
                if self.on_gained is not None:
                    self.on_gained(grant)

    def _lose(self, grant: LeaderGrant, reason: str) -> None:
        self.grant = None
        self.since = None
        logger.info("pulse: %s lost leadership of %s (epoch %d): %s", self.holder, self.key,
                    grant.epoch, reason)
        if self.on_lost is not None:
            self.on_lost(grant)
