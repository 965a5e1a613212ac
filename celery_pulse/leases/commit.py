"""The commit thread: the hot path's group commit, on a thread of its own.

Completions, reservations and starts go to the store together, in one exchange (one
round trip where the store pipelines them): whatever queued up while the previous
exchange was in flight goes in the next one. None of it depends on the broker. Where
the store sends exchanges without blocking, ops submitted on the worker's event loop
are served on that loop (:mod:`celery_pulse.leases.loop`), and this thread takes only
what would block it (:meth:`CommitThread.from_loop`).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from celery_pulse.leases.exchange import Exchanger
from celery_pulse.leases.ops import (
    BATCH,
    FIRST_BACKOFF,
    FROM_LOOP,
    LINGER,
    MAX_BACKOFF,
    QUIET,
    Op,
    Pending,
    notify,
    pending,
    waited_for,
)
from celery_pulse.service import Service

#: The lease mechanism's log lines keep the logger they always had.
logger = logging.getLogger("celery_pulse.leases")


class CommitThread(Service):
    """``pulse-commit``: sends the queued ops; stopped by a sentinel after the last op."""

    def __init__(self, exchanger: Exchanger) -> None:
        super().__init__("pulse-commit", join_timeout=exchanger.ttl + 30)
        self.exchanger = exchanger
        self.monotonic = exchanger.monotonic
        self._ops: queue.Queue[Op | None] = queue.Queue()

    def put(self, op: Op) -> None:
        self._ops.put(op)

    def signal_stop(self) -> None:
        """Flush what is queued (completions: for at most one lease TTL), then end."""
        super().signal_stop()
        self._ops.put(None)

    def run(self) -> None:
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
        exchanger = self.exchanger
        closing = False
        give_up = 0.0
        waiting = pending()
        due_at: float | None = None  # when what lingers goes out
        quiet_at: float | None = None  # ... or sooner, once no op came for QUIET
        delay = FIRST_BACKOFF  # of failed completions (reset by an exchange that worked)
        after: list[Callable[[], None]] = []  # the loop committer's, after the next exchange
        while True:
            wake = due_at if quiet_at is None or due_at is None else min(due_at, quiet_at)
            timeout = None if wake is None else max(0.0, wake - time.monotonic())
            batch = self._take(timeout)
            if None in batch and not closing:
                closing = True
                give_up = self.monotonic() + exchanger.ttl
            now = time.monotonic()
            urgent = closing
            for op in batch:
                if op is None:
                    continue
                if op.kind in FROM_LOOP:
                    urgent = True
                    self.from_loop(op, waiting, after)
                    continue
                waiting[op.kind].append(op)
                # A retry's completion re-opens the claim its next delivery needs.
                urgent = urgent or waited_for(op)
            count = sum(len(ops) for ops in waiting.values())
            if not count:
                notify(after)
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
            completes = waiting["complete"]
            failed = exchanger.exchange(completes, waiting["reserve"], waiting["start"])
            waiting["reserve"], waiting["start"] = [], []
            notify(after)
            if failed is None:
                waiting["complete"], delay, due_at = [], FIRST_BACKOFF, None
            elif closing and self.monotonic() > give_up:
                logger.error("pulse: could not record %d completion(s) before exit: %s",
                             len(completes), failed)
                exchanger.answer_completions(completes, dict.fromkeys(
                    (op.item.task_id for op in completes), failed))
                return
            elif completes:
                logger.warning("pulse: recording %d completion(s) failed, retrying: %s",
                               len(completes), failed)
                due_at = time.monotonic() + delay
                delay = min(delay * 2, MAX_BACKOFF)
            else:
                due_at = None
            if closing and not waiting["complete"]:
                return

    def from_loop(self, op: Op, waiting: Pending, after: list[Callable[[], None]]) -> None:
        """What the loop committer hands this thread (see :mod:`celery_pulse.leases.loop`):
        an exchange it cannot send without blocking (``batch``: sent with the next one
        here), one it sent whose end may block (``finish``, done now: the follow-up
        reads of a refusal or a stale completion), or a ``barrier``
        (nothing: its callback runs once what queued up before it has gone out)."""
        kind, item, callback = op.kind, op.item, op.callback
        if kind == "finish":
            pending_exchange, completes, reserves, starts, sent = item
            try:
                done = pending_exchange.finish(blocking=True)
                assert done is not None
            except Exception as exc:
                failure = self.exchanger.answer_failure(exc, reserves, starts, sent)
                waiting["complete"].extend(completes)  # sent again with the next exchange
                logger.warning("pulse: recording %d completion(s) failed, retrying: %s",
                               len(completes), failure)
            else:
                self.exchanger.answer_exchange(done, completes, reserves, starts, sent)
            notify([callback])
            return
        if kind == "batch":
            for ops in item:
                for each in ops:
                    waiting[each.kind].append(each)
        after.append(callback)

    def _take(self, timeout: float | None) -> list[Op | None]:
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
