"""Starts authorised ahead of the pool, so that a pool process never waits for one.

Under load Celery queues requests for the next free pool process (its semaphore) and
hands each one over the moment a process frees. A start authorised only then costs that
process a round trip to the store on every task. Instead:

* a delivery that a free process is waiting for is reserved as ``running`` at once (its
  start folded into the reservation);
* the next requests in line are started ahead, in the hot path's batches: when a
  process frees, its next job is already ``running``. A task under a concurrency limit
  or a rate goes with its permits (taken then), unless tasks of this worker wait for one
  of its keys (it would jump their line) or a start ahead of its keys found none free:
  it then asks when its process is free, as without starts ahead. Per key, one such
  start is in flight at first, twice as many after each one that got its permits, one
  again after one that found none: a limit that binds costs one refused start, not a
  batch of them. (Under a rate, a job started ahead begins its body about
  :data:`WINDOW` at most after its grant; under a rate that binds, starts are asked
  with a free process, and a body follows its grant at once.)

Only while this worker's jobs are short, and only as many as its processes get through
in :data:`WINDOW`: a job started ahead waits for a process, and a worker killed
meanwhile leaves it ``running`` in the store though it never ran (Recover then reviews
or re-dispatches it by the task's policy; it never runs twice). With longer jobs a start
waits for its process: its round trip is small next to the job.

Everything here runs on the consumer's event loop.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

from celery_pulse.leases import LOST, RESERVED, RUNNING, WAITING, LeaseKeeper, LocalClaim
from celery_pulse.store.base import Permit
from celery_pulse.worker.loop import LoopCaller

#: Seconds: how long a job started ahead may expect to wait for its process. Starts go
#: ahead of the pool only while jobs are shorter than this, and only as many as fit in
#: it (at least one per process: the store's round trip is then off the pool's path).
WINDOW = 0.02
#: Never more starts ahead than this, however short the jobs.
MAX_AHEAD = 64
#: Keys whose grown allowance of limited starts in flight is remembered (more: forgotten).
MAX_KEYS = 1024
#: Weight of the newest run time in the running mean.
ALPHA = 0.2


class StartAhead:
    """The requests waiting for a pool process, in Celery's order, and starts ahead."""

    def __init__(self, keeper: LeaseKeeper, loop: Callable[[], LoopCaller], concurrency: int,
                 hand_over: Callable[[LocalClaim, Any, Any], Any],
                 waited_for: Callable[[Sequence[Permit]], bool] = lambda _permits: False
                 ) -> None:
        self.keeper = keeper
        self._loop = loop
        self.concurrency = max(1, concurrency)
        #: ``hand_over(claim, job, result)``: the pool's answer to a start it waited for.
        self.hand_over = hand_over
        #: Reserved claims handed to Celery and not yet to the pool, in arrival order.
        self.queued: collections.deque[LocalClaim] = collections.deque()
        #: Claims started (or starting) ahead that are not in the pool yet.
        self.ahead: set[LocalClaim] = set()
        #: Reservations in flight that asked to be granted as running.
        self.folding = 0
        #: ``waited_for(permits)``: tasks of this worker wait for one of their keys.
        self.waited_for = waited_for
        #: Starts ahead of tasks under a limit that got their permits, and starts folded
        #: into their reservation with them (worker stats: :meth:`stats`).
        self.limited_starts = self.limited_folds = 0
        #: Permit keys a start ahead found no permit of -> that claim (until it leaves).
        self.blocked: dict[str, LocalClaim] = {}
        #: Limited starts ahead in flight per permit key, and how many may be (absent: 1).
        self.flying: collections.Counter[str] = collections.Counter()
        self.allowed: dict[str, int] = {}
        #: Running mean of job run times (seconds); None until one job has run.
        self.runtime: float | None = None

    def stats(self) -> dict[str, int]:
        return {"started_ahead": self.limited_starts, "folded": self.limited_folds}

    @property
    def short(self) -> bool:
        return self.runtime is not None and self.runtime < WINDOW

    def _budget(self) -> int:
        """How many more starts may go ahead of the pool now.

        As many as the processes get through in :data:`WINDOW` at the mean run time: a
        start takes a round trip to the store, and the processes must not run dry
        meanwhile.
        """
        if self.runtime is None or not self.short:
            return 0
        self.ahead = {c for c in self.ahead if c.state != LOST and not c.in_pool
                      and self.keeper.get(c.task_id) is c}
        fit = int(WINDOW / max(self.runtime, 1e-4)) * self.concurrency
        return min(max(fit, self.concurrency), MAX_AHEAD) - len(self.ahead) - self.folding

    def lingers(self) -> bool:
        """Whether even the first reservation of a burst may linger for company: the
        processes have their next jobs, started ahead, and each exchange costs the loop
        its own time (SQLite). Measured on SQLite: 10% more no-ops a second and 10% less
        CPU per task; on PostgreSQL, whose exchange in flight gathers the next batch by
        itself, no gain."""
        return bool(self.ahead) and self.keeper.store.exchange_in_process

    def fold(self, free_process: bool) -> bool:
        """Whether a new delivery is reserved as running (its start folded in): a free
        process waits for it, or it is next in line and within the budget."""
        start = free_process or (not self.queued and self._budget() > 0)
        self.folding += start
        return start

    def fold_limited(self, free_process: bool, permits: tuple[Permit, ...] | None
                     ) -> tuple[Permit, ...]:
        """:meth:`fold` for a delivery that needs ``permits`` (None: a key function makes
        them depend on its body, not read yet): the permits its reservation starts it
        with, or none (it asks for them later). Only if :meth:`may_take`, and without a
        free process as a start ahead of its keys would go (the same allowance)."""
        if not permits or not self.may_take(permits) or (not free_process and any(
                self.flying[p.key] >= self.allowed.get(p.key, 1) for p in permits)):
            return ()
        if not self.fold(free_process):
            return ()
        for permit in permits:
            self.flying[permit.key] += 1
        return permits

    def settled(self, claim: LocalClaim | None, folded: bool, may_wait: bool,
                permits: tuple[Permit, ...] = (), started: bool = False) -> None:
        """A reservation came back and Celery has the request (``claim`` None: refused).

        ``may_wait``: the request waits for a process in Celery's order (not an ETA, not
        rate limited), so it may be started ahead. ``permits``: it was folded with them
        (:meth:`fold_limited`), ``started`` if it got them.
        """
        self.folding -= folded
        if permits:
            self.limited_folds += started
            self._limited_answer(permits, started)
            if claim is not None:
                claim.permits = permits
                if not started:
                    self.refused(claim)
        if claim is None or claim.applied or not may_wait:
            return
        if claim.state == RUNNING:
            self.ahead.add(claim)  # folded, but every process was taken meanwhile
        elif claim.state == RESERVED and self.short:
            self.queued.append(claim)
            self.pump()

    def pump(self) -> None:
        """Start the next requests in line while the budget allows."""
        budget = self._budget() if self.queued else 0
        while budget > 0 and self.queued:
            claim = self.queued.popleft()
            if (claim.state != RESERVED or claim.applied or claim.starting
                    or self.keeper.get(claim.task_id) is not claim):
                continue  # gone to the pool, started, ended or lost meanwhile
            if claim.permits and (not self.may_take(claim.permits) or any(
                    self.flying[p.key] >= self.allowed.get(p.key, 1) for p in claim.permits)):
                continue  # it asks with its process (behind those waiting)
            for permit in claim.permits or ():
                self.flying[permit.key] += 1
            self.ahead.add(claim)
            claim.starting = True
            budget -= 1
            self.keeper.submit_start(claim, self._answer_to(claim), urgent=False)
        if len(self.queued) > 4 * self.concurrency and not self.short:
            self.queued.clear()  # jobs got long: they start when their process is free

    def may_take(self, permits: Sequence[Permit]) -> bool:
        """Whether a start may ask for ``permits`` before its process does: no task of
        this worker waits for one of their keys (it would jump their line), and no start
        ahead of (or folded with) one of them found it taken, its claim still here."""
        return not self.waited_for(permits) and not self._blocked(permits)

    def refused(self, claim: LocalClaim) -> None:
        """A start of ``claim`` ahead of its process found a permit taken."""
        self.blocked.update((p.key, claim) for p in claim.permits or ())

    def _blocked(self, permits: Sequence[Permit]) -> bool:
        for permit in permits:
            other = self.blocked.get(permit.key)
            if other is None:
                continue
            if other.state == RESERVED and self.keeper.get(other.task_id) is other:
                return True
            del self.blocked[permit.key]  # that one left without saying (lost, ended)
        return False

    def _answer_to(self, claim: LocalClaim) -> Callable[[Any], None]:
        def answer(result: Any) -> None:  # on the commit thread or the loop
            self._loop().call(self._answered, claim, result)
        return answer

    def _answered(self, claim: LocalClaim, result: Any) -> None:
        claim.starting = False
        if claim.permits:
            self.limited_starts += result is True
            self._limited_answer(claim.permits, result is True)
        job, claim.waiting_job = claim.waiting_job, None
        if job is not None:
            self.hand_over(claim, job, result)  # its process is waiting for it
        elif result is not True:
            self.ahead.discard(claim)  # not started: it starts when its process is free
            if result == WAITING:
                self.refused(claim)
        self.pump()

    def _limited_answer(self, permits: tuple[Permit, ...], started: bool) -> None:
        for permit in permits:
            key = permit.key
            self.flying[key] -= 1
            if self.flying[key] <= 0:
                del self.flying[key]
            if started:
                if len(self.allowed) >= MAX_KEYS and key not in self.allowed:
                    self.allowed.clear()
                self.allowed[key] = min(2 * self.allowed.get(key, 1), MAX_AHEAD)
            else:
                self.allowed.pop(key, None)

    def left(self, claim: LocalClaim) -> None:
        """The claim went to the pool or ended: room for the next start ahead."""
        self.ahead.discard(claim)
        if self.blocked:
            for key in [k for k, c in self.blocked.items() if c is claim]:
                del self.blocked[key]
        self.pump()

    def ran(self, seconds: float) -> None:
        self.runtime = seconds if self.runtime is None else (
            self.runtime + ALPHA * (seconds - self.runtime))
