"""Per-task leases held by one worker: group commit, batched renewal, self-fencing.

The mechanism only (no Celery, no SQL). The worker adapter feeds it reservations and
completions and hears back through a :class:`LeaseListener`.

Rules:

* Every store call happens on threads owned here: the *committer* (completions,
  reservations and starts, batched: whatever queued up while the previous exchange
  was in flight goes in the next one, all kinds in one round trip where the store
  pipelines them) and the *renewer* (one statement per interval for every lease
  held). None depends on the broker. The one exception: where the store sends
  exchanges without blocking, the committer's work for ops submitted on the worker's
  event loop is done on that loop (:mod:`celery_pulse.loop_commit`), and the thread
  takes only what would block it.
* A lease's local deadline is ``sent_at(last successful grant or renewal) + ttl -
  margin`` on the monotonic clock. Past it the lease is lost even if the store
  cannot be reached: it ends here before the store could grant it to anyone else.
* A lease not returned by a renewal is lost. Lost running tasks get the listener's
  ``on_lost`` (cooperative cancel), then ``on_hard_stop`` after ``grace`` seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from celery_pulse.errors import Contended, PulseError, StoreUnavailable, Unstorable
from celery_pulse.store.base import (
    RETRY,
    ClaimStore,
    Completion,
    Exchanged,
    Grant,
    Permit,
    Refusal,
    ReserveRequest,
    ResultRecord,
    mask_token,
)

if TYPE_CHECKING:
    from celery_pulse.loop_commit import LoopCommitter

logger = logging.getLogger(__name__)

RESERVED, RUNNING, LOST = "reserved", "running", "lost"
#: A start's answer when the store found no free concurrency permit for it: the claim is
#: still reserved and its lease unchanged (neither True, started, nor False, refused).
WAITING = "waiting"
#: How long a lost, never-started claim stays in the table (for the intake's duplicate
#: check only: the adapter binds each claim to its request, so a late request still
#: finds its lost claim and is dropped however long it waited).
LOST_MEMORY = 300.0
#: What nothing waits for (completions, starts ahead of the pool, reservations of jobs
#: that will wait for a process) lingers up to this long (seconds) for company, or until
#: this many ops share an exchange.
LINGER = 0.002
BATCH = 64
#: ... but no longer than this after the last op arrived: a burst (the deliveries of one
#: socket read, the results of one loop turn) has come in whole by then. Lingering the
#: full :data:`LINGER` after a burst kept the broker's prefetch window (no more
#: reservations in flight than it holds) idle for most of it: 2,000 no-op tasks ran at
#: 1,281 tasks/s that way, 1,544 with this (RabbitMQ, ``-c 2``, medians of 3).
QUIET = 0.0002
#: Seconds before completions the store could not take are sent again (doubling up to
#: MAX_BACKOFF).
FIRST_BACKOFF = 0.2
MAX_BACKOFF = 2.0
#: Op kinds the loop committer hands the commit thread (:meth:`LeaseKeeper._from_loop`).
_FROM_LOOP = frozenset({"batch", "finish", "barrier"})


def waited_for(op: tuple[str, Any, Any, bool]) -> bool:
    """Whether something waits for ``op`` (it goes out at once, not lingering): its
    submitter said so, or it is a retry's completion, which re-opens the claim its next
    delivery needs."""
    return op[3] or (op[0] == "complete" and op[1].outcome == RETRY)


def _notify(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:
            logger.exception("pulse: loop committer callback failed")
    callbacks.clear()


@dataclasses.dataclass(slots=True, eq=False)
class LocalClaim:
    """This worker's view of one lease it holds."""

    task_id: str
    epoch: int
    token: str
    deadline: float
    retries: int = 0
    state: str = RESERVED
    #: Held in memory until an ETA/countdown: does not count against prefetch.
    scheduled: bool = False
    pid: int | None = None
    slot: int | None = None
    lost_at: float | None = None
    lost_reason: str = ""
    hard_stopped: bool = False
    #: Counted in ``LeaseKeeper.unstarted()`` (waiting for a pool process: reserved, or
    #: started ahead of the pool).
    counted: bool = False
    #: The job went to the pool (it may run; before that, a started claim never ran).
    in_pool: bool = False
    #: Recover re-dispatches this task whether it started or not (acks_late, idempotent):
    #: its start is recorded in the background instead of before the body.
    start_in_background: bool = False
    #: The publication this grant belongs to (None: the message carried none).
    publication: str | None = None
    #: The adapter asked for the job to be run (it may be waiting for its start).
    applied: bool = False
    #: The adapter's check, once the job went to the pool, that the pool dropped it
    #: before writing it to any process (Celery flushes such jobs on a broker reconnect
    #: and at shutdown): then it never ran.
    dropped_by_pool: Callable[[], bool] | None = None
    #: A start ahead of the pool is in flight; the job waiting for its answer, if any.
    starting: bool = False
    waiting_job: Any = None
    #: When the job went to the pool (monotonic), for the mean run time.
    handed_at: float = 0.0
    #: The attempt's result for the store's result backend, sent with its completion.
    result: ResultRecord | None = None
    #: Opaque adapter data of a chord part (its request), for when its count comes back.
    chord_part: Any = None
    #: The cluster-wide concurrency permits its start needs (None: not decided yet).
    permits: tuple[Permit, ...] | None = None
    #: When its start first found no free permit (monotonic), while it waits for one.
    parked_at: float | None = None
    #: Starts of it the store failed in a row (the retry backs off on them).
    start_failures: int = 0
    #: Opaque adapter data (the Celery request, the captured message, its verdict).
    request: Any = None
    message: Any = None
    verdict: str | None = None

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.task_id, self.epoch, self.token)

    def __repr__(self) -> str:
        return (f"LocalClaim({self.task_id!r}, epoch={self.epoch}, "
                f"token={mask_token(self.token)!r}, state={self.state})")


def _dropped(claim: LocalClaim) -> bool:
    """The job went to the pool, no process accepted it, and the pool dropped it unwritten."""
    return claim.pid is None and claim.dropped_by_pool is not None and claim.dropped_by_pool()


class LeaseListener(Protocol):
    """Called from the renewer thread."""

    def on_lost(self, claim: LocalClaim) -> None: ...
    def on_hard_stop(self, claim: LocalClaim) -> None: ...
    def on_renewed(self, claims: Sequence[LocalClaim]) -> None: ...


@dataclasses.dataclass
class Counters:
    """What an operator wants counted (exported in worker stats)."""

    reserved: int = 0
    duplicates: int = 0
    lost: int = 0
    hard_stopped: int = 0
    completed: int = 0
    stale_completions: int = 0
    renewals: int = 0
    renew_failures: int = 0
    store_errors: int = 0
    #: Reservations the store refused to decide for contention (rows locked by other
    #: workers through all of its retries): tried again, not counted as store errors.
    contended: int = 0
    #: Hot-path exchanges with the store (one round trip each on PostgreSQL) and the
    #: operations they carried: what the group commit saves is ops / exchanges.
    exchanges: int = 0
    exchanged_ops: int = 0
    #: Deliveries settled without running: malformed, or refused by the store alone.
    rejected: int = 0
    renew_latency: list[float] = dataclasses.field(default_factory=list)

    def record_latency(self, seconds: float) -> None:
        self.renew_latency.append(seconds)
        del self.renew_latency[:-256]

    def latency_percentiles(self) -> dict[str, float | None]:
        data = sorted(self.renew_latency)
        if not data:
            return {"p50": None, "p99": None}
        return {"p50": round(data[len(data) // 2], 6),
                "p99": round(data[min(len(data) - 1, int(len(data) * 0.99))], 6)}


ReserveCallback = Callable[[Grant | Refusal | PulseError, float], None]
#: ``callback(answer, counted)``: ``counted`` is the completion's count, for one that
#: added to a counter (:attr:`Exchanged.counted`), else None.
CompleteCallback = Callable[[str | PulseError, tuple[int, str] | None], None]
StartCallback = Callable[[bool | str | PulseError], None]


class LeaseKeeper:
    """Holds this worker's leases and talks to the store on its own threads."""

    def __init__(self, store: ClaimStore, holder: str, *, ttl: float, interval: float,
                 margin: float, grace: float, listener: LeaseListener,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.holder = holder
        self.ttl = ttl
        self.interval = interval
        self.margin = margin
        self.grace = grace
        self.listener = listener
        self.monotonic = monotonic
        self.claims: dict[str, LocalClaim] = {}
        #: Lost claims still running in a pool process whose table entry a newer grant of
        #: the same task took: still hard-stopped when they ignore LeaseLost.
        self._displaced: dict[tuple[str, int, str], LocalClaim] = {}
        self._unstarted = 0
        #: Grants answered to the adapter and not added yet: at shutdown, those the event
        #: loop never took are released (they never ran, even those granted as running).
        self._unsettled: dict[str, Grant] = {}
        self.counters = Counters()
        self._lock = threading.RLock()
        #: (kind, item, callback, urgent): ``urgent`` when something waits for it.
        self._ops: queue.Queue[tuple[str, Any, Any, bool] | None] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop_committer: LoopCommitter | None = None

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        for name, target in (("pulse-commit", self._commit_loop),
                             ("pulse-renew", self._renew_loop),
                             ("pulse-watchdog", self._watchdog_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, *, release: bool = True) -> None:
        """Flush queued completions, release reservations never started, stop threads."""
        self.detach_loop()
        self._ops.put(None)
        for thread in self._threads[:1]:
            thread.join(timeout=self.ttl + 30)
        self._stop.set()
        for thread in self._threads[1:]:
            thread.join(timeout=self.interval + 5)
        unstarted = [c.key for c in self._never_ran()]
        with self._lock:  # granted, but the loop had stopped before it could take them
            unstarted += [(g.task_id, g.epoch, g.token) for g in self._unsettled.values()]
        if unstarted and release:
            try:
                released = self.store.release(self.holder, unstarted, never_ran=True)
                logger.info("pulse: released %d reservation(s) never started", released)
            except PulseError as exc:
                logger.warning("pulse: could not release reservations (they expire in "
                               "at most %gs): %s", self.ttl, exc)

    def _never_ran(self) -> list[LocalClaim]:
        """Reservations, and starts whose job never reached the pool: none of them ran.

        A job handed to the pool is not among them, even one no process was seen to
        accept: at a warm shutdown the loop that reads the children's acknowledgements
        and results has stopped, so "not seen" is not "not run" (a CI run caught a job
        released as never run that had run, and then ran again). Its lease expires and
        Recover decides by the task's policy. The exception is a job the pool dropped
        before writing it to any process (``dropped_by_pool``): Celery flushes those at
        shutdown and on a reconnect, expecting the broker to deliver them again (a CI
        run caught one such job left to expire into review, never having run).
        """
        with self._lock:
            return [c for c in self.claims.values() if c.state == RESERVED
                    or (c.state == RUNNING and (not c.in_pool or _dropped(c)))]

    def release_unstarted(self, why: str) -> int:
        """The pool forgot every job no process accepted yet (a broker reconnect).

        Reservations, and starts whose job never reached the pool, never ran: expired in
        the store now, for immediate re-dispatch. A job handed to the pool but not yet
        accepted by a process may or may not be running: its lease is given up (lost)
        without a release, so Recover decides by the task's policy once it expires.
        """
        unstarted = self._never_ran()
        with self._lock:
            unknown = [c for c in self.claims.values()
                       if c.state == RUNNING and c.in_pool and c.pid is None
                       and not _dropped(c)]
        for claim in unknown:
            self._lose(claim, f"{why}: the pool dropped the job before a process accepted it")
        now = self.monotonic()
        for claim in unstarted:
            with self._lock:
                self._uncount(claim)
                claim.state = LOST
            claim.lost_at = now
            claim.lost_reason = why
        if not unstarted:
            return 0
        try:
            return self.store.release(self.holder, [c.key for c in unstarted], never_ran=True)
        except PulseError as exc:
            logger.warning("pulse: could not release %d reservation(s) (they expire within "
                           "%gs): %s", len(unstarted), self.ttl, exc)
            return 0

    # -- the local table ------------------------------------------------------
    def add(self, grant: Grant, sent_at: float, retries: int, scheduled: bool,
            start_in_background: bool = False, publication: str | None = None,
            message: Any = None) -> LocalClaim:
        claim = LocalClaim(grant.task_id, grant.epoch, grant.token,
                           sent_at + self.ttl - self.margin, retries,
                           state=RUNNING if grant.started else RESERVED, scheduled=scheduled,
                           counted=not scheduled,
                           start_in_background=start_in_background,
                           publication=publication, message=message)
        with self._lock:
            if self._unsettled.get(grant.task_id) == grant:
                del self._unsettled[grant.task_id]
            old = self.claims.get(claim.task_id)
            if old is not None:
                self._uncount(old)
                if old.state == LOST and old.pid is not None:
                    self._displaced[old.key] = old  # still due its hard stop
            self.claims[claim.task_id] = claim
            if claim.counted:
                self._unstarted += 1
        return claim

    def get(self, task_id: str) -> LocalClaim | None:
        with self._lock:
            return self.claims.get(task_id)

    def attempts(self, task_id: str) -> list[LocalClaim]:
        """Every attempt of ``task_id`` this worker still holds or runs (lost ones too)."""
        with self._lock:
            return [c for c in (*self.claims.values(), *self._displaced.values())
                    if c.task_id == task_id]

    def forget(self, claim: LocalClaim) -> None:
        with self._lock:
            self._uncount(claim)
            if self.claims.get(claim.task_id) is claim:
                del self.claims[claim.task_id]
            self._displaced.pop(claim.key, None)

    def mark_running(self, claim: LocalClaim, sent_at: float | None = None) -> bool:
        """The store moved the claim to ``running``; False if it was lost meanwhile.

        ``sent_at``: when the start was sent (its grant extends the local deadline).
        """
        with self._lock:
            if claim.state != RESERVED:
                return False
            claim.state = RUNNING
            if sent_at is not None:
                claim.deadline = max(claim.deadline, sent_at + self.ttl - self.margin)
            return True

    def handed(self, claim: LocalClaim) -> None:
        """The claim's job went to the pool: it no longer waits for a process."""
        with self._lock:
            self._uncount(claim)
            claim.in_pool = True

    def _uncount(self, claim: LocalClaim) -> None:
        if claim.counted:
            claim.counted = False
            self._unstarted -= 1

    def unstarted(self) -> int:
        """Claims waiting for a pool process (prefetch accounting; ETA ones excluded):
        reservations, and starts folded into them or made ahead of the pool.

        A counter kept on every transition: this runs several times per task.
        """
        return self._unstarted

    # -- the loop committer (see :mod:`celery_pulse.loop_commit`) ----------------------
    def attach_loop(self, reactor: Any) -> bool:
        """Serve the ops submitted on ``reactor``'s thread from that event loop itself,
        where the store sends exchanges without blocking. Called where the loop is about
        to run (again); True if it now does."""
        if not self.store.nonblocking_exchange:
            return False
        from celery_pulse.loop_commit import LoopCommitter

        self.detach_loop()
        committer = LoopCommitter(self, reactor)
        self._loop_committer = committer
        committer.attach()
        return True

    def detach_loop(self) -> None:
        """The event loop stops: the committer thread serves every op from now on."""
        committer = self._loop_committer
        if committer is not None:
            committer.detach(timeout=self.ttl)
            self._loop_committer = None

    def hand_to_thread(self, op: tuple[str, Any, Any, bool]) -> None:
        self._ops.put(op)

    def _submit(self, op: tuple[str, Any, Any, bool]) -> None:
        committer = self._loop_committer
        if committer is not None and committer.accepts():
            committer.submit(op)
        else:
            self._ops.put(op)

    def is_live(self, claim: LocalClaim) -> bool:
        return claim.state != LOST and self.monotonic() < claim.deadline

    # -- group commit -----------------------------------------------------------
    def submit_reserve(self, request: ReserveRequest, callback: ReserveCallback,
                       urgent: bool = True) -> None:
        """Queue a reservation; ``callback(result, sent_at)`` runs on the commit thread
        (or on the event loop, if the loop committer sent it).

        ``urgent``: a free pool process waits for it (else it may linger for company).
        """
        self._submit(("reserve", request, callback, urgent))

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
        self._submit(("start", claim, callback, urgent))

    def start_in_background(self, claim: LocalClaim) -> bool:
        """Count the claim as running now and record its start in the store later.

        Only for claims whose lost attempts Recover re-dispatches whatever their state
        (``start_in_background``): for them "started" is information, not a fence.
        """
        with self._lock:
            if claim.state != RESERVED:
                return False
            claim.state = RUNNING
        self._submit(("start", claim, None, False))
        return True

    def submit_complete(self, claim: LocalClaim, outcome: str, error: str | None,
                        callback: CompleteCallback | None = None) -> None:
        self.forget(claim)
        completion = Completion(claim.task_id, claim.epoch, claim.token, outcome, error,
                                claim.result)
        self._submit(("complete", completion, callback, False))

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

    def _commit_loop(self) -> None:
        """The hot path, on one thread: completions, reservations and starts go to the
        store together, in one exchange (one round trip where the store pipelines them).

        An op something waits for (a free pool process: a reservation granted as
        running, a start asked by the pool) goes out at once, with whatever else queued
        up. The others (completions, starts ahead of the pool, reservations of jobs that
        will wait for a process anyway) linger up to :data:`LINGER` for company, or until
        :data:`BATCH` of them: under load, statements carry many rows, which is what
        keeps the cost per task low. A completion the store could not take is kept and
        sent again (with backoff) for as long as it takes while running, for at most one
        lease TTL at shutdown: without it Recover would re-run or review a task that did
        finish.
        """
        closing = False
        give_up = 0.0
        pending: dict[str, list[tuple[str, Any, Any, bool]]] = {
            "complete": [], "reserve": [], "start": []}
        due_at: float | None = None  # when what lingers goes out
        quiet_at: float | None = None  # ... or sooner, once no op came for QUIET
        delay = FIRST_BACKOFF  # of failed completions (reset by an exchange that worked)
        notify: list[Callable[[], None]] = []  # the loop committer's, after the next exchange
        while True:
            wake = due_at if quiet_at is None or due_at is None else min(due_at, quiet_at)
            timeout = None if wake is None else max(0.0, wake - time.monotonic())
            batch = self._take(timeout)
            if None in batch and not closing:
                closing = True
                give_up = self.monotonic() + self.ttl
            now = time.monotonic()
            urgent = closing
            for op in batch:
                if op is None:
                    continue
                if op[0] in _FROM_LOOP:
                    urgent = True
                    self._from_loop(op, pending, notify)
                    continue
                pending[op[0]].append(op)
                # A retry's completion re-opens the claim its next delivery needs.
                urgent = urgent or waited_for(op)
            count = sum(len(ops) for ops in pending.values())
            if not count:
                _notify(notify)
                if closing:
                    return
                due_at = None
                continue
            if due_at is None:
                due_at = now + LINGER
            if batch and delay == FIRST_BACKOFF:  # not while failed completions back off
                quiet_at = now + QUIET
            if not (urgent or count >= BATCH or now >= due_at
                    or (quiet_at is not None and now >= quiet_at)):
                continue
            quiet_at = None
            completes = pending["complete"]
            failed = self._exchange(completes, pending["reserve"], pending["start"])
            pending["reserve"], pending["start"] = [], []
            _notify(notify)
            if failed is None:
                pending["complete"], delay, due_at = [], FIRST_BACKOFF, None
            elif closing and self.monotonic() > give_up:
                logger.error("pulse: could not record %d completion(s) before exit: %s",
                             len(completes), failed)
                self._answer_completions(completes, dict.fromkeys(
                    (op[1].task_id for op in completes), failed))
                return
            elif completes:
                logger.warning("pulse: recording %d completion(s) failed, retrying: %s",
                               len(completes), failed)
                due_at = time.monotonic() + delay
                delay = min(delay * 2, MAX_BACKOFF)
            else:
                due_at = None
            if closing and not pending["complete"]:
                return

    def _from_loop(self, op: tuple[str, Any, Any, bool],
                   pending: dict[str, list[tuple[str, Any, Any, bool]]],
                   notify: list[Callable[[], None]]) -> None:
        """What the loop committer hands this thread (see :mod:`celery_pulse.loop_commit`):
        an exchange it cannot send without blocking (``batch``: sent with the next one
        here), one it sent whose end may block (``finish``, done now: the follow-up
        reads of a refusal or a stale completion), or a ``barrier``
        (nothing: its callback runs once what queued up before it has gone out)."""
        kind, item, callback = op[0], op[1], op[2]
        if kind == "finish":
            pending_exchange, completes, reserves, starts, sent = item
            try:
                done = pending_exchange.finish(blocking=True)
                assert done is not None
            except Exception as exc:
                failure = self.answer_failure(exc, reserves, starts, sent)
                pending["complete"].extend(completes)  # sent again with the next exchange
                logger.warning("pulse: recording %d completion(s) failed, retrying: %s",
                               len(completes), failure)
            else:
                self.answer_exchange(done, completes, reserves, starts, sent)
            _notify([callback])
            return
        if kind == "batch":
            for ops in item:
                for each in ops:
                    pending[each[0]].append(each)
        notify.append(callback)

    def _take(self, timeout: float | None) -> list[tuple[str, Any, Any, bool] | None]:
        """The next op (waiting up to ``timeout``) and every op queued behind it."""
        try:
            batch = [self._ops.get(timeout=timeout)]
        except queue.Empty:
            return []
        while len(batch) < 500:
            try:
                batch.append(self._ops.get_nowait())
            except queue.Empty:
                break
        return batch

    def _exchange(self, completes: list[tuple[str, Any, Any, bool]],
                  reserves: list[tuple[str, Any, Any, bool]],
                  starts: list[tuple[str, Any, Any, bool]]) -> PulseError | None:
        """One exchange with the store; answers every reservation and start, and the
        completions if it worked. Returns the failure (completions then still pending)."""
        limited = [op for op in starts if op[1].permits]
        if limited and len(limited) < len(starts) + len(completes) + len(reserves):
            # Starts that need permits lock their keys in a transaction of their own:
            # one failing there (a contended key) must not fail the others' exchange.
            failure = self._exchange(completes, reserves,
                                     [op for op in starts if not op[1].permits])
            self._exchange([], [], limited)
            return failure
        sent = self.monotonic()
        self.count_exchange(completes, reserves, starts)
        claims = [op[1] for op in starts]
        try:
            permits = {c.task_id: c.permits for c in claims if c.permits}
            done = self.store.exchange(self.holder, self.ttl, [op[1] for op in completes],
                                       [op[1] for op in reserves], [c.key for c in claims],
                                       permits or None)
        except Exception as exc:
            if reserves and isinstance(exc, Unstorable):
                return self._isolate(exc, completes, reserves, starts, sent)
            return self.answer_failure(exc, reserves, starts, sent)
        self.answer_exchange(done, completes, reserves, starts, sent)
        return None

    def _isolate(self, exc: Unstorable, completes: list[tuple[str, Any, Any, bool]],
                 reserves: list[tuple[str, Any, Any, bool]],
                 starts: list[tuple[str, Any, Any, bool]], sent: float) -> PulseError | None:
        """The store refused a value the exchange carried: which reservation's?

        Reservations are batched all or nothing, so one delivery the store can't keep
        (a value too long, over the packet size) fails the whole exchange. Its effect is
        known (nothing: the store answered with an error), so the rest goes again without
        the reservations, then each reservation alone; the one refused alone is answered
        :class:`Unstorable` (its delivery is rejected), the others as usual.
        """
        if len(reserves) == 1 and not completes and not starts:
            self._answer(reserves, [exc], sent)
            return None
        logger.warning("pulse: the store refused a batch of %d reservation(s) (%s): "
                       "reserving each alone", len(reserves), exc)
        failure = self._exchange(completes, [], starts) if completes or starts else None
        for op in reserves:
            self._exchange([], [op], [])
        return failure

    def count_exchange(self, *kinds: list[tuple[str, Any, Any, bool]]) -> None:
        self.counters.exchanges += 1
        self.counters.exchanged_ops += sum(len(ops) for ops in kinds)

    def answer_failure(self, exc: BaseException, reserves: list[tuple[str, Any, Any, bool]],
                       starts: list[tuple[str, Any, Any, bool]], sent: float) -> PulseError:
        """An exchange failed: its reservations and starts get the error (the caller
        keeps its completions, to send again). The error, as a PulseError."""
        failure = exc if isinstance(exc, PulseError) else StoreUnavailable(
            f"exchange failed: {exc!r}")
        if not isinstance(exc, PulseError):
            logger.error("pulse: store exchange failed", exc_info=exc)
        if not isinstance(exc, Contended):  # the store answered: counted by the intake
            self.counters.store_errors += 1
        self._answer(reserves, [failure] * len(reserves), sent)
        self._answer(starts, [failure] * len(starts))
        return failure

    def answer_exchange(self, done: Exchanged, completes: list[tuple[str, Any, Any, bool]],
                        reserves: list[tuple[str, Any, Any, bool]],
                        starts: list[tuple[str, Any, Any, bool]], sent: float) -> None:
        """Every op of an exchange that took effect gets its answer."""
        if completes:
            self._answer_completions(completes, done.completed, done.counted)
        with self._lock:
            self._unsettled.update((g.task_id, g) for g in done.reserved if isinstance(g, Grant))
        self._answer(reserves, done.reserved, sent)
        claims = [op[1] for op in starts]
        self._answer(starts, [WAITING if c.task_id in done.waiting else (
            c.task_id in done.started and (c.start_in_background or self.mark_running(c, sent)))
            for c in claims])

    @staticmethod
    def _answer(ops: list[tuple[str, Any, Any, bool]], results: Sequence[Any],
                *extra: Any) -> None:
        for op, result in zip(ops, results, strict=True):
            if op[2] is None:
                continue
            try:
                op[2](result, *extra)
            except Exception:
                logger.exception("pulse: %s callback failed", op[0])

    def _answer_completions(self, ops: list[tuple[str, Any, Any, bool]],
                            outcomes: Mapping[str, Any],
                            counted: Mapping[str, tuple[int, str]] | None = None) -> None:
        for op in ops:
            result = outcomes.get(op[1].task_id)
            if result == "applied":
                self.counters.completed += 1
            elif result == "evidence":
                self.counters.stale_completions += 1
                logger.warning("pulse: late outcome %r for task %s epoch %d kept as evidence only",
                               op[1].outcome, op[1].task_id, op[1].epoch)
        for op in ops:
            if op[2] is None:
                continue
            task_id = op[1].task_id
            try:
                op[2](outcomes.get(task_id), (counted or {}).get(task_id))
            except Exception:
                logger.exception("pulse: complete callback failed")

    # -- renewal ----------------------------------------------------------------
    def _renew_loop(self) -> None:
        while not self._stop.is_set():
            try:
                delay = self.renew_once()
            except Exception:
                logger.exception("pulse: renewal failed unexpectedly")
                delay = self.interval
            self._stop.wait(delay)
        # Keep renewing while stop() waits for the committer: handled by the caller
        # stopping us only after the pool has drained.

    def _watchdog_loop(self) -> None:
        """Enforce local deadlines even while a store call hangs (a locked SQLite file, a
        half-open TCP connection): the renewer may be stuck, the deadline is not."""
        tick = min(0.25, self.interval / 4)
        while not self._stop.wait(tick):
            try:
                self.enforce_deadlines()
            except Exception:
                logger.exception("pulse: lease watchdog failed unexpectedly")

    def enforce_deadlines(self) -> None:
        """Lose every lease past its local deadline; hard-stop what ignored LeaseLost."""
        now = self.monotonic()
        with self._lock:
            claims = [*self.claims.values(), *self._displaced.values()]
        for claim in claims:
            if claim.state in (RESERVED, RUNNING) and now >= claim.deadline:
                self._lose(claim, "self-fenced: no successful renewal before the local deadline")
            elif (claim.state == LOST and claim.pid is not None and not claim.hard_stopped
                  and claim.lost_at is not None and now >= claim.lost_at + self.grace):
                claim.hard_stopped = True
                self.counters.hard_stopped += 1
                logger.error("pulse: task %s epoch %d ignored LeaseLost for %gs: hard stop",
                             claim.task_id, claim.epoch, self.grace)
                self.listener.on_hard_stop(claim)

    def renew_once(self) -> float:
        """Renew every lease, mark losses, hard-stop the overdue. Returns the next delay."""
        with self._lock:
            held = [c for c in self.claims.values() if c.state in (RESERVED, RUNNING)]
        if held:
            sent = self.monotonic()
            renewed: set[str] | None
            busy: set[str] | None
            try:
                renewed, busy = self.store.renew(self.holder, [c.key for c in held], self.ttl)
            except PulseError as exc:
                self.counters.renew_failures += 1
                logger.warning("pulse: renewing %d lease(s) failed: %s", len(held), exc)
                renewed = busy = None
            else:
                self.counters.renewals += 1
                self.counters.record_latency(self.monotonic() - sent)
            if renewed is not None and busy is not None:
                kept = []
                for claim in held:
                    if claim.task_id in renewed:
                        claim.deadline = sent + self.ttl - self.margin
                        kept.append(claim)
                    elif claim.task_id not in busy:
                        self._lose(claim, "not renewed: the store no longer grants this lease")
                    # A busy lease (its row held by a fenced transaction) is still valid
                    # but was not extended in the store: neither is its local deadline.
                if kept:
                    self.listener.on_renewed(kept)
        now = self.monotonic()
        with self._lock:
            claims = list(self.claims.values())
        for claim in claims:
            if (claim.state == LOST and claim.pid is None and claim.lost_at is not None
                    and now > claim.lost_at + LOST_MEMORY):
                self.forget(claim)  # never handed to a child: nothing will ask for it now
        self.enforce_deadlines()
        next_deadline = min((c.deadline for c in claims if c.state in (RESERVED, RUNNING)),
                            default=now + self.interval)
        next_stop = min((c.lost_at + self.grace for c in claims
                         if c.state == LOST and c.lost_at is not None and not c.hard_stopped),
                        default=now + self.interval)
        return max(0.01, min(self.interval, next_deadline - now, next_stop - now))

    def _lose(self, claim: LocalClaim, reason: str) -> None:
        with self._lock:  # the renewer and the watchdog may race here
            if claim.state == LOST:
                return
            if self.claims.get(claim.task_id) is not claim:
                # Completed (forgotten) after the renewer's snapshot: its lease ended with
                # the completion, and its pid may run another task by now.
                return
            was = claim.state
            self._uncount(claim)
            claim.state = LOST
            claim.lost_at = self.monotonic()
        claim.lost_reason = reason
        self.counters.lost += 1
        # A task running in a pool process gets LeaseLost, and its process logs the one
        # WARNING line about it (who held it, who holds it now): this one is the detail.
        level = logging.INFO if was == RUNNING and claim.pid is not None else logging.WARNING
        logger.log(level, "pulse: lease lost for task %s epoch %d (%s, was %s)",
                   claim.task_id, claim.epoch, reason, was)
        # A lost reservation stays in the table (state LOST) so the pool drops it
        # instead of running it when its turn comes.
        self.listener.on_lost(claim)
