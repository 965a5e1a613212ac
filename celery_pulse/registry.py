"""Worker membership: stay registered, self-fence when that can't be proven.

The mechanism only; it knows nothing of Celery. An adapter supplies a
:class:`MembershipListener` that stops and resumes consumption.

Rules:

* The heartbeat runs on its own thread (a broker outage must not stop it).
* The local deadline is ``sent_at(last successful heartbeat) + ttl - margin`` on the
  monotonic clock. Past it we are *fenced* — we behave as unregistered (no new work)
  even if the store cannot be reached to confirm it.
* ``NotRegistered(replaced)``: another process holds our name. Identity is lost for
  good: the listener stops the worker.
* ``NotRegistered(expired|missing)``: fence, then register afresh under a new token
  (only if nobody else took the name meanwhile) and resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from celery_pulse.errors import NotRegistered, PulseError, StoreUnavailable
from celery_pulse.service import Service
from celery_pulse.store.base import Registration, RegistryStore, mask_token

logger = logging.getLogger(__name__)


class MembershipListener(Protocol):
    """What the worker does when membership changes. Called from the heartbeat thread."""

    def on_fenced(self, reason: str) -> None: ...
    def on_resumed(self) -> None: ...
    def on_identity_lost(self, reason: str) -> None: ...
    def on_drain(self) -> None: ...


class Membership:
    """Keeps one worker registered in the store (heartbeat thread ``pulse-registry``)."""

    ACTIVE, FENCED, LOST, STOPPED = "active", "fenced", "lost", "stopped"

    def __init__(self, store: RegistryStore, worker_id: str, labels: Mapping[str, Any], *,
                 ttl: float, interval: float, margin: float,
                 listener: MembershipListener,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.worker_id = worker_id
        self.labels = dict(labels)
        self.ttl = ttl
        self.interval = interval
        self.margin = margin
        self.listener = listener
        self.monotonic = monotonic
        self.state = self.STOPPED
        self.registration: Registration | None = None
        self.deadline = 0.0
        self.failures = 0
        self.draining = False
        self._heartbeat = Service("pulse-registry", join_timeout=interval + 5,
                                  target=self._run)

    # -- lifecycle ----------------------------------------------------------
    def start(self, *, thread: bool = True) -> Registration:
        """Register now (errors propagate: startup must fail loudly), then heartbeat."""
        sent = self.monotonic()
        self.registration = self.store.register(self.worker_id, self.labels, self.ttl)
        self.deadline = sent + self.ttl - self.margin
        self.state = self.ACTIVE
        logger.info("pulse: registered %s (token %s, ttl %gs)", self.worker_id,
                    mask_token(self.registration.token), self.ttl)
        if self.registration.draining:
            self.draining = True
            self.listener.on_drain()
        if thread:
            self._heartbeat.start()
        return self.registration

    def stop(self, *, deregister: bool = True) -> None:
        """Stop heartbeating and, on a clean exit, remove our registration."""
        self._heartbeat.stop()
        if deregister and self.registration is not None and self.state != self.LOST:
            try:
                self.store.deregister(self.worker_id, self.registration.token)
                logger.info("pulse: deregistered %s", self.worker_id)
            except PulseError as exc:
                logger.warning("pulse: could not deregister %s: %s", self.worker_id, exc)
        if self.state != self.LOST:
            self.state = self.STOPPED

    @property
    def fenced(self) -> bool:
        """True when we must not take work: fenced, lost, or past the local deadline."""
        return self.state != self.ACTIVE or self.monotonic() >= self.deadline

    @property
    def expires_in(self) -> float:
        """Seconds to the local self-fence deadline (monotonic clock)."""
        return self.deadline - self.monotonic()

    # -- the loop -----------------------------------------------------------
    def _run(self) -> None:
        delay = self.interval
        while not self._heartbeat.sleep(delay):
            try:
                next_delay = self.tick()
            except Exception:  # never let the heartbeat thread die silently
                logger.exception("pulse: heartbeat failed unexpectedly")
                next_delay = self.interval
            if next_delay is None:
                return
            delay = next_delay

    def tick(self) -> float | None:
        """One heartbeat step. Returns the delay to the next one, None to stop."""
        if self.state in (self.LOST, self.STOPPED) or self.registration is None:
            return None
        sent = self.monotonic()
        try:
            beat = self.store.heartbeat(self.worker_id, self.registration.token, self.ttl)
        except NotRegistered as exc:
            if exc.reason == NotRegistered.REPLACED:
                return self._lose(str(exc))
            self._fence(f"registration {exc.reason}")
            return self._reregister()
        except StoreUnavailable as exc:
            return self._on_outage(exc)
        self.failures = 0
        self.deadline = sent + self.ttl - self.margin
        if self.state == self.FENCED:
            self._resume()
        if beat.draining and not self.draining:
            self.draining = True
            self.listener.on_drain()
        return self.interval

    def _on_outage(self, exc: StoreUnavailable) -> float:
        self.failures += 1
        if self.failures == 1:
            logger.warning("pulse: heartbeat failed, will retry: %s", exc)
        if self.monotonic() >= self.deadline:
            self._fence("store unreachable past the registration deadline")
        backoff: float = min(self.interval, 0.25 * 2 ** min(self.failures, 6))
        if self.state == self.ACTIVE:  # wake up in time to fence at the deadline
            backoff = min(backoff, self.deadline - self.monotonic())
        return max(0.05, backoff)

    def _reregister(self) -> float | None:
        sent = self.monotonic()
        old = self.registration
        try:
            reg = self.store.register(self.worker_id, self.labels, self.ttl,
                                      replace_live=False)
        except NotRegistered as exc:
            return self._lose(str(exc))
        except StoreUnavailable as exc:
            return self._on_outage(exc)
        self.registration = reg
        self.deadline = sent + self.ttl - self.margin
        self.failures = 0
        logger.warning("pulse: re-registered %s under a new token %s (was %s)", self.worker_id,
                       mask_token(reg.token), mask_token(old.token if old else ""))
        self._resume()
        return self.interval

    def _fence(self, reason: str) -> None:
        if self.state == self.ACTIVE:
            self.state = self.FENCED
            logger.warning("pulse: %s fenced (%s): not taking new work", self.worker_id, reason)
            self.listener.on_fenced(reason)

    def _resume(self) -> None:
        if self.state == self.FENCED:
            self.state = self.ACTIVE
            logger.warning("pulse: %s registered again: resuming", self.worker_id)
            self.listener.on_resumed()

    def _lose(self, reason: str) -> float | None:
        """Identity is gone for good: tell the listener; returns None (stop the loop)."""
        self.state = self.LOST
        logger.critical("pulse: worker %s lost its identity: %s; stopping (in-flight tasks "
                        "finish under their own leases)", self.worker_id, reason)
        self.listener.on_identity_lost(reason)
        return None
