"""The tasks of this worker waiting for a concurrency permit, until one frees.

A task whose start finds no free permit (:mod:`celery_pulse.worker.permits`) gives its
pool process back and waits here, still reserved and renewed, until a permit of its keys
frees: a task of this worker holding one ends (at once), or the next retry (backoff from
:data:`FIRST_RETRY` to :data:`MAX_RETRY`: the permit may be freed by another worker). A
task waiting on a rate limit asks again when the store said the rate has room.
Tasks waiting for the same keys start in arrival order, one start in flight per keys at
a time. Everything here runs on the consumer's event loop.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery_pulse.leases import LocalClaim
from celery_pulse.store.base import Permit
from celery_pulse.worker.loop import LoopCaller

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.permits")

#: Seconds before a task that found no permit asks again, doubling up to MAX_RETRY.
FIRST_RETRY = 0.05
MAX_RETRY = 1.0
#: Added to the time a rate says it has room (this loop's timer and the next statement
#: must land past the window's edge by the store's clock).
RATE_MARGIN = 0.002


class _Keys:
    """The tasks waiting for one set of permit keys, in arrival order."""

    __slots__ = ("delay", "entries", "freed", "in_flight", "timer")

    def __init__(self) -> None:
        self.entries: collections.deque[tuple[LocalClaim, Any]] = collections.deque()
        self.delay = FIRST_RETRY
        #: A start of one of them is in flight (or waits for a pool process).
        self.in_flight: LocalClaim | None = None
        #: A permit of these keys was given back while that start was in flight: if it
        #: answers "waiting", it may have looked before the permit came back.
        self.freed = False
        self.timer = False


class PermitWaits:
    """Tasks whose start found no free permit, until one frees. On the consumer loop."""

    def __init__(self, loop: Callable[[], LoopCaller], resume: Callable[[LocalClaim, Any], Any],
                 emit: Callable[..., None], wait_event: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._loop = loop
        #: ``resume(claim, job)``: ask for the start again (the pool's).
        self.resume = resume
        self.emit = emit
        self.wait_event = wait_event
        self.monotonic = monotonic
        self.groups: dict[tuple[str, ...], _Keys] = {}
        self.count = 0
        self._warned: set[int] = set()
        self._asks: collections.deque[tuple[str, ...]] = collections.deque()
        self._asking = False

    @staticmethod
    def _group(claim: LocalClaim) -> tuple[str, ...]:
        return tuple(sorted(p.key for p in claim.permits or ()))

    def waiting_for(self, permits: Sequence[Permit]) -> bool:
        """Whether tasks of this worker wait for one of these permits' keys (a start
        needing them ahead of those tasks would jump their line)."""
        keys = {p.key for p in permits}
        return any(keys.intersection(group_keys) for group_keys in self.groups)

    def by_key(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for keys, group in self.groups.items():
            for key in keys:
                out[key] = out.get(key, 0) + len(group.entries) + (group.in_flight is not None)
        return out

    def settled(self, claim: LocalClaim, job: Any, outcome: str) -> None:
        """The answer to a start of a task that needs permits: ``started``, ``waiting``
        (no free permit: it waits here) or ``gone`` (lost, refused, revoked)."""
        keys = self._group(claim)
        group = self.groups.get(keys)
        resumed = group is not None and group.in_flight is claim
        if outcome == "waiting":
            if group is None:
                group = self.groups[keys] = _Keys()
            if resumed:
                group.in_flight = None
                group.entries.appendleft((claim, job))  # still first in line
                if group.freed:  # ask again now: no wake-up lost to the race
                    group.freed = False
                    self._next(keys)
                    return
                if claim.retry_in is None:
                    group.delay = min(group.delay * 2, MAX_RETRY)
            else:
                group.entries.append((claim, job))
                self.count += 1
                claim.parked_at = self.monotonic()
            # A rate says when it has room (the store's clock): ask then, not by backoff.
            self._schedule(keys, group, group.delay if claim.retry_in is None
                           else claim.retry_in + RATE_MARGIN)
            return
        if not resumed or group is None:
            return
        group.in_flight = None
        group.freed = False
        self.count -= 1
        self._warned.discard(id(claim))
        if claim.parked_at is not None and outcome == "started":
            logger.info("pulse: task %s got its concurrency permit after %.3fs", claim.task_id,
                        self.monotonic() - claim.parked_at)
        claim.parked_at = None
        group.delay = FIRST_RETRY
        self._next(keys)  # a permit was free: maybe another one too

    def freed(self, freed: set[str]) -> None:
        """Permits of these keys were given back (by a task of this worker that ended, or
        announced by another worker): their waiters ask again now."""
        for keys, group in list(self.groups.items()):
            if freed.intersection(keys):
                group.delay = FIRST_RETRY
                if group.in_flight is not None:
                    group.freed = True  # answered when that start comes back
                self._next(keys)

    def _schedule(self, keys: tuple[str, ...], group: _Keys, delay: float) -> None:
        if not group.timer:
            group.timer = True
            self._loop().later_kept(delay, self._tick, keys)

    def _tick(self, keys: tuple[str, ...]) -> None:
        group = self.groups.get(keys)
        if group is None:
            return
        group.timer = False
        self._warn_long_waits(group)
        self._next(keys)

    def _next(self, keys: tuple[str, ...]) -> None:
        """Let the first waiter of ``keys`` ask. A resume may answer at once (a lost claim
        is ``gone``, a loop without a hub starts inline) and ask for the next: those asks
        are queued and run here, one after another, never nested (a reconnect that drops
        hundreds of waiters must not recurse once per waiter)."""
        self._asks.append(keys)
        if self._asking:
            return
        self._asking = True
        try:
            while self._asks:
                self._ask(self._asks.popleft())
        finally:
            self._asking = False

    def _ask(self, keys: tuple[str, ...]) -> None:
        group = self.groups.get(keys)
        if group is None or group.in_flight is not None:
            return
        if group.entries:
            # A lost one too: the pool drops it when it asks again (and says ``gone``).
            claim, job = group.entries.popleft()
            group.in_flight = claim
            self.resume(claim, job)
        elif not group.timer:
            del self.groups[keys]

    def _warn_long_waits(self, group: _Keys) -> None:
        now = self.monotonic()
        for claim, _job in group.entries:
            if (claim.parked_at is not None and now - claim.parked_at >= self.wait_event
                    and id(claim) not in self._warned):
                self._warned.add(id(claim))
                waited = round(now - claim.parked_at, 3)
                logger.warning("pulse: task %s has waited %.0fs for a concurrency permit (%s)",
                               claim.task_id, waited, ", ".join(p.key for p in claim.permits or ()))
                self.emit("pulse-permit-wait", uuid=claim.task_id, waited=waited,
                          permits=[p.key for p in claim.permits or ()])
