"""Renewal: one statement per interval extends every lease this worker holds.

A renewal carries each lease's token, so it extends only the attempts this worker still
holds. One the store returns gets a new local deadline (``sent_at + ttl - margin``);
one it does not return is lost, except a *busy* one (its row held by a fenced
transaction: still valid, not extended, neither is its local deadline). A failed
renewal changes nothing: the watchdog's deadlines still hold. The renewer also forgets
lost claims that never reached a pool process once :data:`LOST_MEMORY` has passed, and
wakes in time for the next deadline or hard stop.

The renewal also carries the running tasks' checkpoints that changed since the last one
(:class:`CheckpointCarrier`), in one more statement for all of them; none when nothing
changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from celery_pulse.errors import PulseError
from celery_pulse.leases.claims import LOST, LOST_MEMORY, RESERVED, RUNNING, LocalClaim
from celery_pulse.leases.table import ClaimTable
from celery_pulse.service import Service
from celery_pulse.store.base import ClaimStore
from celery_pulse.store.checkpoints import CheckpointWrite

#: The lease mechanism's log lines keep the logger they always had.
logger = logging.getLogger("celery_pulse.leases")


class CheckpointCarrier(Protocol):
    """Where the running tasks' checkpoints wait for the renewal (the pool's shared slots)."""

    def pending(self, held: Sequence[LocalClaim]) -> list[CheckpointWrite]: ...

    def mark_carried(self, held: Sequence[LocalClaim], writes: Sequence[CheckpointWrite]
                     ) -> None: ...


class Renewer(Service):
    """``pulse-renew``: renews the table's leases for ``holder`` every ``interval``."""

    def __init__(self, table: ClaimTable, store: ClaimStore, holder: str, *,
                 interval: float, enforce_deadlines: Callable[[], None],
                 checkpoints: CheckpointCarrier | None = None) -> None:
        super().__init__("pulse-renew", join_timeout=interval + 5)
        self.table = table
        self.store = store
        self.holder = holder
        self.interval = interval
        self.enforce_deadlines = enforce_deadlines
        self.checkpoints = checkpoints

    def run(self) -> None:
        while not self.stopping:
            try:
                delay = self.renew_once()
            except Exception:
                logger.exception("pulse: renewal failed unexpectedly")
                delay = self.interval
            self.sleep(delay)
        # Keep renewing while stop() waits for the committer: handled by the caller
        # stopping us only after the pool has drained.

    def renew_once(self) -> float:
        """Renew every lease, mark losses, hard-stop the overdue. Returns the next delay."""
        table = self.table
        ttl = table.ttl
        held = table.held()
        if held:
            sent = table.monotonic()
            renewed: set[str] | None
            busy: set[str] | None
            try:
                renewed, busy = self.store.renew(self.holder, [c.key for c in held], ttl)
            except PulseError as exc:
                table.counters.renew_failures += 1
                logger.warning("pulse: renewing %d lease(s) failed: %s", len(held), exc)
                renewed = busy = None
            else:
                table.counters.renewals += 1
                table.counters.record_latency(table.monotonic() - sent)
            if renewed is not None and busy is not None:
                kept = []
                for claim in held:
                    if claim.task_id in renewed:
                        claim.deadline = sent + ttl - table.margin
                        kept.append(claim)
                    elif claim.task_id not in busy:
                        table.lose(claim, "not renewed: the store no longer grants this lease")
                    # A busy lease (its row held by a fenced transaction) is still valid
                    # but was not extended in the store: neither is its local deadline.
                if kept:
                    table.listener.on_renewed(kept)
                    self.carry([c for c in kept if c.state == RUNNING])
        now = table.monotonic()
        claims = table.snapshot()
        for claim in claims:
            if (claim.state == LOST and claim.pid is None and claim.lost_at is not None
                    and now > claim.lost_at + LOST_MEMORY):
                table.forget(claim)  # never handed to a child: nothing will ask for it now
        self.enforce_deadlines()
        next_deadline = min((c.deadline for c in claims if c.state in (RESERVED, RUNNING)),
                            default=now + self.interval)
        next_stop = min((c.lost_at + table.grace for c in claims
                         if c.state == LOST and c.lost_at is not None and not c.hard_stopped),
                        default=now + self.interval)
        return max(0.01, min(self.interval, next_deadline - now, next_stop - now))

    def carry(self, running: Sequence[LocalClaim]) -> None:
        """Send the checkpoints of ``running`` leases written since the last renewal."""
        write = getattr(self.store, "checkpoint", None)  # a gateway worker's has none
        if self.checkpoints is None or write is None:
            return
        writes = self.checkpoints.pending(running)
        if not writes:
            return
        try:
            held, _busy = write(self.holder, writes)
        except PulseError as exc:  # kept in the slots: the next renewal tries again
            logger.warning("pulse: carrying %d checkpoint(s) failed: %s", len(writes), exc)
            return
        except Exception:  # never at the cost of the deadlines enforced after this
            logger.exception("pulse: carrying %d checkpoint(s) failed unexpectedly",
                             len(writes))
            return
        self.table.counters.checkpoints += len(held)
        self.checkpoints.mark_carried(running, [w for w in writes if w.task_id in held])
