"""The lease keeper: this worker's lease table and the threads that keep it true.

:class:`LeaseKeeper` is the :class:`~celery_pulse.leases.table.ClaimTable` plus what
talks to the store about it, each a service of its own: the commit thread
(:mod:`~celery_pulse.leases.commit`), the loop committer while an event loop serves the
hot path (:mod:`~celery_pulse.leases.loop`), the renewer
(:mod:`~celery_pulse.leases.renewal`) and the watchdog
(:mod:`~celery_pulse.leases.watchdog`). The worker adapter submits reservations, starts
and completions here; it hears back through their callbacks and its
:class:`~celery_pulse.leases.claims.LeaseListener`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from celery_pulse.errors import PulseError
from celery_pulse.leases.claims import (
    WAITING,
    CompleteCallback,
    LeaseListener,
    LocalClaim,
    ReserveCallback,
    StartCallback,
)
from celery_pulse.leases.commit import CommitThread
from celery_pulse.leases.exchange import Exchanger
from celery_pulse.leases.loop import LoopCommitter, Reactor
from celery_pulse.leases.ops import Op
from celery_pulse.leases.renewal import CheckpointCarrier, Renewer
from celery_pulse.leases.table import ClaimTable
from celery_pulse.leases.watchdog import Watchdog
from celery_pulse.store.base import ClaimStore, Completion, Grant, Refusal, ReserveRequest
from celery_pulse.store.records import LOST_TOKEN

#: The lease mechanism's log lines keep the logger they always had.
logger = logging.getLogger("celery_pulse.leases")


class LeaseKeeper(ClaimTable):
    """Holds this worker's leases and talks to the store on its own threads."""

    def __init__(self, store: ClaimStore, holder: str, *, ttl: float, interval: float,
                 margin: float, grace: float, listener: LeaseListener,
                 monotonic: Callable[[], float] = time.monotonic,
                 checkpoints: CheckpointCarrier | None = None) -> None:
        super().__init__(ttl=ttl, margin=margin, grace=grace, listener=listener,
                         monotonic=monotonic)
        self.store = store
        self.holder = holder
        self.interval = interval
        self.exchanger = Exchanger(store, holder, self)
        self.committer = CommitThread(self.exchanger)
        self.watchdog = Watchdog(self, interval=interval)
        self.renewer = Renewer(self, store, holder, interval=interval,
                               enforce_deadlines=self.watchdog.enforce_deadlines,
                               checkpoints=checkpoints)
        self._loop_committer: LoopCommitter | None = None

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        for service in (self.committer, self.renewer, self.watchdog):
            service.start()

    def stop(self, *, release: bool = True) -> None:
        """Flush queued completions, release reservations never started, stop threads."""
        self.detach_loop()
        self.committer.stop()
        self.renewer.signal_stop()
        self.watchdog.signal_stop()
        self.renewer.join()
        self.watchdog.join()
        # (the unsettled ones: granted, but the loop had stopped before it could take them)
        unstarted = [c.key for c in self.never_ran()] + self.unsettled()
        if unstarted and release:
            try:
                released = self.store.release(self.holder, unstarted, never_ran=True)
                logger.info("pulse: released %d reservation(s) never started", released)
            except PulseError as exc:
                logger.warning("pulse: could not release reservations (they expire in "
                               "at most %gs): %s", self.ttl, exc)

    def release_unstarted(self, why: str) -> int:
        """The pool forgot every job no process accepted yet (a broker reconnect).

        Reservations, and starts whose job never reached the pool, never ran: expired in
        the store now, for immediate re-dispatch. A job handed to the pool but not yet
        accepted by a process may or may not be running: its lease is given up (lost)
        without a release, so Recover decides by the task's policy once it expires.
        """
        unstarted = self.never_ran()
        for claim in self.in_pool_unaccepted():
            self.lose(claim, f"{why}: the pool dropped the job before a process accepted it")
        self.give_up(unstarted, why)
        if not unstarted:
            return 0
        try:
            return self.store.release(self.holder, [c.key for c in unstarted], never_ran=True)
        except PulseError as exc:
            logger.warning("pulse: could not release %d reservation(s) (they expire within "
                           "%gs): %s", len(unstarted), self.ttl, exc)
            return 0

    # -- the loop committer (see :mod:`celery_pulse.leases.loop`) ----------------------
    def attach_loop(self, reactor: Reactor) -> bool:
        """Serve the ops submitted on ``reactor``'s thread from that event loop itself,
        where the store sends exchanges without blocking. Called where the loop is about
        to run (again); True if it now does."""
        if not self.store.nonblocking_exchange:
            return False
        self.detach_loop()
        committer = LoopCommitter(self.exchanger, self.hand_to_thread, reactor)
        self._loop_committer = committer
        committer.attach()
        return True

    def detach_loop(self) -> None:
        """The event loop stops: the commit thread serves every op from now on."""
        committer = self._loop_committer
        if committer is not None:
            committer.detach(timeout=self.ttl)
            self._loop_committer = None

    def hand_to_thread(self, op: Op) -> None:
        self.committer.put(op)

    def _submit(self, op: Op) -> None:
        committer = self._loop_committer
        if committer is not None and committer.accepts():
            committer.submit(op)
        else:
            self.committer.put(op)

    # -- group commit -----------------------------------------------------------
    def submit_reserve(self, request: ReserveRequest, callback: ReserveCallback,
                       urgent: bool = True) -> None:
        """Queue a reservation; ``callback(result, sent_at)`` runs on the commit thread
        (or on the event loop, if the loop committer sent it).

        ``urgent``: a free pool process waits for it (else it may linger for company).
        A store whose reservations are local answers it at once, on the caller's thread.
        """
        op = Op("reserve", request, callback, urgent)
        if self.store.local_reservations:
            self.exchanger.reserve_locally(op)
        else:
            self._submit(op)

    def submit_start(self, claim: LocalClaim, callback: StartCallback | None,
                     urgent: bool = True) -> None:
        """Queue the start of a reserved claim.

        ``urgent``: its job is about to go to the pool and a process waits for it; a
        start ahead of the pool may linger for company. ``callback(result)`` runs on the
        commit thread: True (running: hand the job over), False (refused or lost
        meanwhile: never run it), :data:`WAITING` (no free concurrency permit for
        ``claim.permits``: still reserved) or the store error. Callbacks run on the commit
        thread, or on the event loop if the loop committer sent the exchange.
        """
        self._submit(Op("start", claim, callback, urgent))

    def start_in_background(self, claim: LocalClaim) -> bool:
        """Count the claim as running now and record its start in the store later.

        Only for claims whose lost attempts Recover re-dispatches whatever their state
        (``start_in_background``): for them "started" is information, not a fence.
        """
        if not self.run_unrecorded(claim):
            return False
        self._submit(Op("start", claim, None, False))
        return True

    def submit_complete(self, claim: LocalClaim, outcome: str, error: str | None,
                        callback: CompleteCallback | None = None) -> None:
        self.forget(claim)
        completion = Completion(claim.task_id, claim.epoch, claim.token, outcome, error,
                                claim.result, claim.returned, claim.published)
        self._submit(Op("complete", completion, callback, False))

    def submit_late(self, claim: LocalClaim, outcome: str, error: str | None) -> None:
        """Keep the outcome of an attempt that ran on after its lease was lost here, as
        evidence only: sent under :data:`LOST_TOKEN`, which no lease has, so the store
        never applies it, however the claim stands there (taken over, in review, or
        still ours until it expires)."""
        self.forget(claim)
        completion = Completion(claim.task_id, claim.epoch, LOST_TOKEN, outcome, error,
                                None, claim.returned)
        self._submit(Op("complete", completion, None, False))

    def start_now(self, claim: LocalClaim) -> bool | str | PulseError:
        """Synchronous start (for event loops without a hub): as ``submit_start``'s answer."""
        sent = self.monotonic()
        waiting: set[str] = set()
        try:
            started = self.store.start_many(self.holder, [claim.key], self.ttl,
                                            {claim.task_id: claim.permits or ()}, waiting)
        except PulseError as exc:
            return exc
        if claim.task_id in started:
            return self.mark_running(claim, sent)
        return WAITING if claim.task_id in waiting else False

    def reserve_now(self, requests: Sequence[ReserveRequest]) -> tuple[list[Grant | Refusal], float]:
        """Synchronous reservation (for event loops without a hub)."""
        sent = self.monotonic()
        return self.store.reserve(self.holder, requests, self.ttl), sent

    # -- renewal and deadlines (the renewer's and the watchdog's, run now) --------------
    def renew_once(self) -> float:
        """Renew every lease, mark losses, hard-stop the overdue. Returns the next delay."""
        return self.renewer.renew_once()

    def enforce_deadlines(self) -> None:
        """Lose every lease past its local deadline; hard-stop what ignored LeaseLost."""
        self.watchdog.enforce_deadlines()
