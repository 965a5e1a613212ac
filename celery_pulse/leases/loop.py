"""The hot path on the worker's event loop: group commit without a thread hand-off.

The commit thread of :class:`~celery_pulse.leases.LeaseKeeper` costs every task two
trips across threads (the op to the thread, the answer back to the loop) and, on a busy
machine, a fight for the GIL with the loop it serves: on 2 cores, 13 futex calls and 5
context switches per no-op task in the worker's parent, where plain prefork makes none
and 0.7. Where the store can send an exchange without waiting for its answer
(:meth:`~celery_pulse.store.base.ClaimStore.begin_exchange`: PostgreSQL's pipeline), or
make it at once without waiting for a lock (SQLite, where the exchange is the worker's
own work), the :class:`LoopCommitter` does the committer's job on the loop itself:

* ops submitted on the loop thread queue here; once per loop turn (before the loop
  polls), if no exchange is in flight, whatever queued up goes out in one exchange. An
  exchange in flight gathers the next batch: under load batches grow by themselves;
* the connection's socket is registered with the loop, and the answer is read when it
  arrives: the callbacks run on the loop, and what queued up meanwhile goes out at once;
* what it cannot do without blocking goes to the committer thread, in order: a batch
  the store only takes blocking (a chord's counter; starts under permits on a store
  without a pipeline), the follow-up reads of a stale completion or a refused
  reservation;
* a store failure answers reservations and starts with the error; completions are kept
  and sent again with backoff, as on the thread.

The loop stops running when the consumer stops (a broker reconnect, a warm shutdown):
:meth:`LoopCommitter.detach` then waits for the exchange in flight (blocking) and hands
whatever is left to the committer thread, which serves every op from then on. Attached
again (the consumer restarted), ops wait until the thread's backlog has gone out
(a barrier), so that nothing overtakes what was submitted before.

Mechanism only: the event loop is anything with kombu's hub's methods (:class:`Reactor`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from celery_pulse.errors import Unstorable
from celery_pulse.leases.exchange import Exchanger
from celery_pulse.leases.ops import (
    BATCH,
    FIRST_BACKOFF,
    LINGER,
    MAX_BACKOFF,
    InFlight,
    Op,
    Pending,
    pending,
    waited_for,
)
from celery_pulse.store.base import PendingExchange

#: Its log lines keep the logger they had as ``celery_pulse.loop_commit``.
logger = logging.getLogger("celery_pulse.loop_commit")

#: Seconds between tries to send the rest of a request the socket did not take at once.
WRITE_RETRY = 0.0005


class Reactor(Protocol):
    """What the committer needs of an event loop (kombu's ``Hub`` has it)."""

    on_tick: set[Callable[[], None]]

    def add_reader(self, fds: int, callback: Callable[..., Any], *args: Any) -> None: ...

    def remove_reader(self, fd: int) -> None: ...

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> Any: ...

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Any: ...


def _cancel(timer: Any) -> None:
    if timer is not None:
        with contextlib.suppress(Exception):
            timer.cancel()


class LoopCommitter:
    """The keeper's group commit for ops submitted on the loop thread.

    Handed what it works with: the ``exchanger`` that sends and answers exchanges, and
    ``hand_to_thread``, which queues an op for the commit thread.
    """

    def __init__(self, exchanger: Exchanger, hand_to_thread: Callable[[Op], None],
                 reactor: Reactor) -> None:
        self.exchanger = exchanger
        self.hand_to_thread = hand_to_thread
        self.reactor = reactor
        self.thread_id = threading.get_ident()
        self.pending: Pending = pending()
        self.attached = True
        #: False until the committer thread's backlog has gone out (see :meth:`attach`).
        self.active = False
        self._exchange: PendingExchange | None = None
        self._ops: InFlight | None = None
        self._fd: int | None = None
        #: An exchange of ours is with the committer thread (a batch, a finish).
        self._away = False
        self._retry_at = 0.0
        self._delay = FIRST_BACKOFF
        #: Something waits for what is pending: it goes at the end of this loop turn.
        self._urgent = False
        #: What nothing waits for lingers up to LINGER for company (this timer), then goes.
        self._linger: Any = None
        self._due = False
        self._write_timer: Any = None

    # -- lifecycle -------------------------------------------------------------------
    def attach(self) -> None:
        """Start serving ops (called on the loop thread, before the loop runs)."""
        self.reactor.on_tick.add(self._tick)
        self.hand_to_thread(Op("barrier", None, self._back_on_loop(self._activate), True))

    def _activate(self) -> None:
        self.active = True
        self._tick()

    def accepts(self) -> bool:
        """Whether an op submitted now is ours: attached, and on the loop's thread."""
        return self.attached and threading.get_ident() == self.thread_id

    def submit(self, op: Op) -> None:
        self.pending[op.kind].append(op)
        if waited_for(op):
            self._urgent = True  # a pool process (or a retry's next delivery) waits for it
        elif self._linger is None and not self._urgent:
            self._linger = self.reactor.call_later(LINGER, self._lingered)

    def detach(self, timeout: float) -> None:
        """The loop stops: finish the exchange in flight (waiting up to ``timeout``
        seconds) and hand every op left to the committer thread, in order."""
        if not self.attached:
            return
        self.attached = False  # from now on ops go straight to the thread
        self.reactor.on_tick.discard(self._tick)
        _cancel(self._linger)
        self._linger = None
        exchange, ops = self._exchange, self._ops
        self._stop_io()
        answers = None
        if exchange is not None and ops is not None:
            try:
                exchange.flight.wait(timeout)
                answers = exchange.finish(blocking=True)
                assert answers is not None
            except Exception as exc:
                self._failed(exc, ops)
                ops = None
        for kind in ("complete", "reserve", "start"):
            for op in self.pending[kind]:
                self.hand_to_thread(op)
            self.pending[kind] = []
        if answers is not None and ops is not None:  # after: what they submit comes later
            self.exchanger.answer_exchange(answers, *ops)

    # -- the loop's side ---------------------------------------------------------------
    def _tick(self) -> None:
        """Once per loop turn, before it polls: send what queued up, if nothing is in
        flight (an exchange in flight sends the next batch when its answer is in)."""
        try:
            if not self.active or self._exchange is not None or self._away:
                return
            pending = self.pending
            count = len(pending["reserve"]) + len(pending["start"])
            if not count and (not pending["complete"]
                              or self.exchanger.monotonic() < self._retry_at):
                return  # (failed completions wait for their retry, or for company)
            count += len(pending["complete"])
            if self._urgent or self._due or count >= BATCH:
                self._send()
        except Exception:  # never into the loop: it would restart the consumer
            logger.exception("pulse: loop committer failed")

    def _lingered(self) -> None:
        self._linger, self._due = None, True
        self._tick()

    def _send(self) -> None:
        exchanger = self.exchanger
        self._urgent = self._due = False
        _cancel(self._linger)
        self._linger = None
        completes, reserves, starts = (self.pending["complete"], self.pending["reserve"],
                                       self.pending["start"])
        self.pending = pending()
        sent = exchanger.monotonic()
        ops = (completes, reserves, starts, sent)
        try:
            exchange = exchanger.begin(completes, reserves, starts)
        except Exception as exc:  # as a failed exchange: its effect is unknown
            exchanger.count(completes, reserves, starts)
            self._failed(exc, ops)  # (their callbacks run after the loop's next poll)
            return
        if exchange is None:  # it would block: the committer thread sends it
            self._hand_over(("batch", (completes, reserves, starts)))
            return
        exchanger.count(completes, reserves, starts)
        self._exchange, self._ops = exchange, ops
        self._fd = exchange.flight.fileno
        self.reactor.add_reader(self._fd, self._on_io)
        if exchange.flight.writing:  # bigger than the socket took at once (rare)
            self._write_timer = self.reactor.call_later(WRITE_RETRY, self._send_more)

    def _send_more(self) -> None:
        """Send the rest of a big request (a timer: only the reader answers, see
        :meth:`_on_io`)."""
        self._write_timer = None
        exchange, ops = self._exchange, self._ops
        if exchange is None or ops is None:
            return
        try:
            try:
                more = exchange.flight.send_more()
            except Exception as exc:
                self._stop_io()
                self._failed(exc, ops)  # (their callbacks run after the loop's next poll)
                return
            if more:
                self._write_timer = self.reactor.call_later(WRITE_RETRY, self._send_more)
        except Exception:
            logger.exception("pulse: loop committer failed")

    def _hand_over(self, what: tuple[str, Any]) -> None:
        """Give the thread an exchange: it answers the ops (from the thread: their
        callbacks reach the loop through its waker) and tells us when it is through."""
        self._away = True
        self.hand_to_thread(Op(what[0], what[1], self._back_on_loop(self._returned), True))

    def _on_io(self) -> None:
        """The socket is readable: read what came, and answer once all is in. (Answers
        are given here, while the loop handles events: a callback they schedule on the
        loop runs on its next turn, not after its next poll.)"""
        try:
            self._step()
        except Exception:
            logger.exception("pulse: loop committer failed")

    def _step(self) -> None:
        exchange, ops = self._exchange, self._ops
        if exchange is None or ops is None:
            return
        try:
            done = exchange.flight.step()
            if not done:
                if exchange.flight.writing and self._write_timer is None:
                    # (a transaction's second round trip went out, bigger than the
                    # socket took at once: rare)
                    self._write_timer = self.reactor.call_later(WRITE_RETRY, self._send_more)
                return
            self._stop_io()
            answers = exchange.finish(blocking=False)
        except Exception as exc:
            self._stop_io()
            self._failed(exc, ops)
            return
        if answers is None:  # it needs reads of its own: the thread makes them
            self._hand_over(("finish", (exchange, *ops)))
            return
        self._delay, self._retry_at = FIRST_BACKOFF, 0.0
        self.exchanger.answer_exchange(answers, *ops)
        self._tick()  # what queued up meanwhile goes now

    def _stop_io(self) -> None:
        fd, self._fd = self._fd, None
        self._exchange = self._ops = None
        _cancel(self._write_timer)
        self._write_timer = None
        if fd is not None:
            with contextlib.suppress(Exception):  # gone already if the loop was reset
                self.reactor.remove_reader(fd)

    def _failed(self, exc: BaseException, ops: InFlight) -> None:
        completes, reserves, starts, sent = ops
        if reserves and isinstance(exc, Unstorable):
            # One reservation the store refused failed them all: the thread reserves
            # each alone (Exchanger.exchange). Nothing took effect; a completion sent
            # again is answered as a duplicate.
            self._hand_over(("batch", (completes, reserves, starts)))
            return
        failure = self.exchanger.answer_failure(exc, reserves, starts, sent)
        if not completes:
            return
        logger.warning("pulse: recording %d completion(s) failed, retrying: %s",
                       len(completes), failure)
        self.pending["complete"][:0] = completes
        self._retry_at = self.exchanger.monotonic() + self._delay
        if self.attached:
            self.reactor.call_later(self._delay, self._retry_due)
        self._delay = min(self._delay * 2, MAX_BACKOFF)

    def _retry_due(self) -> None:
        self._due = True
        self._tick()

    def _returned(self) -> None:
        """The committer thread is through with what it was handed."""
        self._away = False
        self._tick()

    def _back_on_loop(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn``, called from the committer thread, run on the loop (if still attached)."""
        def call() -> None:
            if self.attached:
                self.reactor.call_soon(self._guarded, fn)
        return call

    @staticmethod
    def _guarded(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            logger.exception("pulse: loop committer failed")
