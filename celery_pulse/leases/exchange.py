"""One exchange with the store, and every op's answer from it.

Both committers (the commit thread, :mod:`celery_pulse.leases.commit`, and the loop
committer, :mod:`celery_pulse.leases.loop`) send what queued up as one exchange:
completions, reservations and starts together (one round trip where the store
pipelines them). An exchange that took effect answers each op with its own result; a
failed one answers its reservations and starts with the error, and its completions are
kept by the committer, to be sent again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery_pulse.errors import Contended, PulseError, StoreUnavailable, Unstorable
from celery_pulse.leases.claims import WAITING
from celery_pulse.leases.ops import Op
from celery_pulse.leases.table import ClaimTable
from celery_pulse.store.base import ClaimStore, Exchanged, PendingExchange

#: The lease mechanism's log lines keep the logger they always had.
logger = logging.getLogger("celery_pulse.leases")


class Exchanger:
    """Sends a batch of ops to the store for ``holder`` and answers them on ``table``."""

    def __init__(self, store: ClaimStore, holder: str, table: ClaimTable) -> None:
        self.store = store
        self.holder = holder
        self.table = table
        self.ttl = table.ttl
        self.counters = table.counters
        self.monotonic = table.monotonic

    def exchange(self, completes: list[Op], reserves: list[Op],
                 starts: list[Op]) -> PulseError | None:
        """One exchange with the store; answers every reservation and start, and the
        completions if it worked. Returns the failure (completions then still pending)."""
        limited = [op for op in starts if op.item.permits]
        if limited and len(limited) < len(starts) + len(completes) + len(reserves):
            # Starts that need permits lock their keys in a transaction of their own:
            # one failing there (a contended key) must not fail the others' exchange.
            failure = self.exchange(completes, reserves,
                                    [op for op in starts if not op.item.permits])
            self.exchange([], [], limited)
            return failure
        sent = self.monotonic()
        self.count(completes, reserves, starts)
        claims = [op.item for op in starts]
        try:
            permits = {c.task_id: c.permits for c in claims if c.permits}
            done = self.store.exchange(self.holder, self.ttl, [op.item for op in completes],
                                       [op.item for op in reserves], [c.key for c in claims],
                                       permits or None)
        except Exception as exc:
            if reserves and isinstance(exc, Unstorable):
                return self._isolate(exc, completes, reserves, starts, sent)
            return self.answer_failure(exc, reserves, starts, sent)
        self.answer_exchange(done, completes, reserves, starts, sent)
        return None

    def begin(self, completes: list[Op], reserves: list[Op],
              starts: list[Op]) -> PendingExchange | None:
        """Send an exchange without waiting for its answer (None: it would block)."""
        claims = [op.item for op in starts]
        permits = {c.task_id: c.permits for c in claims if c.permits}
        return self.store.begin_exchange(
            self.holder, self.ttl, [op.item for op in completes],
            [op.item for op in reserves], [c.key for c in claims], permits or None)

    def _isolate(self, exc: Unstorable, completes: list[Op], reserves: list[Op],
                 starts: list[Op], sent: float) -> PulseError | None:
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
        failure = self.exchange(completes, [], starts) if completes or starts else None
        for op in reserves:
            self.exchange([], [op], [])
        return failure

    def reserve_locally(self, op: Op) -> None:
        """Answer a reservation without an exchange, where the store's reservations ask
        no server (:attr:`~celery_pulse.store.base.ClaimStore.local_reservations`): a
        gateway worker's reservation waited, behind the exchange in flight and the
        next, for two of its gateway's round trips (10 ms of a no-op's 40)."""
        sent = self.monotonic()
        try:
            reserved = self.store.reserve(self.holder, [op.item], self.ttl)
        except Exception as exc:
            self.answer_failure(exc, [op], [], sent)
            return
        self.table.note_grants(reserved)
        self._answer([op], reserved, sent)

    def count(self, *kinds: list[Op]) -> None:
        self.counters.exchanges += 1
        self.counters.exchanged_ops += sum(len(ops) for ops in kinds)

    def answer_failure(self, exc: BaseException, reserves: list[Op], starts: list[Op],
                       sent: float) -> PulseError:
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

    def answer_exchange(self, done: Exchanged, completes: list[Op], reserves: list[Op],
                        starts: list[Op], sent: float) -> None:
        """Every op of an exchange that took effect gets its answer."""
        if completes:
            self.answer_completions(completes, done.completed, done.counted)
        self.table.note_grants(done.reserved)
        self._answer(reserves, done.reserved, sent)
        claims = [op.item for op in starts]
        for c in claims:
            c.retry_in = done.retry_in.get(c.task_id)
        self._answer(starts, [WAITING if c.task_id in done.waiting else (
            c.task_id in done.started
            and (c.start_in_background or self.table.mark_running(c, sent)))
            for c in claims])

    @staticmethod
    def _answer(ops: list[Op], results: Sequence[Any], *extra: Any) -> None:
        for op, result in zip(ops, results, strict=True):
            if op.callback is None:
                continue
            try:
                op.callback(result, *extra)
            except Exception:
                logger.exception("pulse: %s callback failed", op.kind)

    def answer_completions(self, ops: list[Op], outcomes: Mapping[str, Any],
                           counted: Mapping[str, tuple[int, str]] | None = None) -> None:
        for op in ops:
            result = outcomes.get(op.item.task_id)
            if result == "applied":
                self.counters.completed += 1
            elif result == "evidence":
                self.counters.stale_completions += 1
                logger.warning("pulse: late outcome %r for task %s epoch %d kept as evidence only",
                               op.item.outcome, op.item.task_id, op.item.epoch)
        for op in ops:
            if op.callback is None:
                continue
            task_id = op.item.task_id
            try:
                op.callback(outcomes.get(task_id), (counted or {}).get(task_id))
            except Exception:
                logger.exception("pulse: complete callback failed")
