"""What the committers queue: one op, its kinds, and when it goes out.

An :class:`Op` is what a submitter hands the keeper's committers (the commit thread,
or the loop committer on the event loop): a reservation, a start or a completion, the
callback its answer goes to, and whether something waits for it. The loop committer
hands the thread ops of its own (:data:`FROM_LOOP`: see
:meth:`celery_pulse.leases.commit.CommitThread.from_loop`).

What nothing waits for lingers up to :data:`LINGER` for company, or until :data:`BATCH`
ops share an exchange; both committers follow these numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from celery_pulse.store.base import RETRY

#: The lease mechanism's log lines keep the logger they always had.
logger = logging.getLogger("celery_pulse.leases")

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
#: The kinds of op an exchange carries, in the order :class:`Pending` keeps them.
RESERVE, START, COMPLETE = "reserve", "start", "complete"
#: Op kinds the loop committer hands the commit thread.
FROM_LOOP = frozenset({"batch", "finish", "barrier"})


class Op(NamedTuple):
    """One queued operation and where its answer goes."""

    #: :data:`RESERVE`, :data:`START`, :data:`COMPLETE`, or one of :data:`FROM_LOOP`.
    kind: str
    #: A ReserveRequest, a LocalClaim (start), a Completion, or the loop's batch/exchange.
    item: Any
    #: Called with the answer (None: nobody asked for it).
    callback: Any
    #: Something waits for it: it goes out at once, not lingering.
    urgent: bool


#: Ops waiting to go out, by kind (:func:`pending`).
Pending = dict[str, list[Op]]
#: An exchange's ops and when it was sent: ``(completes, reserves, starts, sent_at)``.
InFlight = tuple[list[Op], list[Op], list[Op], float]


def pending() -> Pending:
    """Nothing pending yet."""
    return {COMPLETE: [], RESERVE: [], START: []}


def waited_for(op: Op) -> bool:
    """Whether something waits for ``op`` (it goes out at once, not lingering): its
    submitter said so, or it is a retry's completion, which re-opens the claim its next
    delivery needs."""
    return op.urgent or (op.kind == COMPLETE and op.item.outcome == RETRY)


def notify(callbacks: list[Callable[[], None]]) -> None:
    """Run and clear the loop committer's callbacks (each failure logged, none raised)."""
    for callback in callbacks:
        try:
            callback()
        except Exception:
            logger.exception("pulse: loop committer callback failed")
    callbacks.clear()
