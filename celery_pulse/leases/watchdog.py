"""The watchdog: local deadlines enforced even while a store call hangs.

A locked SQLite file or a half-open TCP connection may hold the renewer in a store call
for longer than a lease lasts; the deadline does not wait for it. Every quarter of the
renewal interval (at most 0.25 s) the watchdog loses each lease past its local deadline
and hard-stops (``on_hard_stop``) a lost task still running ``grace`` seconds after it
was told (LeaseLost).
"""

from __future__ import annotations

import logging

from celery_pulse.leases.claims import LOST, RESERVED, RUNNING
from celery_pulse.leases.table import ClaimTable
from celery_pulse.service import Service

#: The lease mechanism's log lines keep the logger they always had.
logger = logging.getLogger("celery_pulse.leases")


class Watchdog(Service):
    """``pulse-watchdog``: enforces the table's local deadlines."""

    def __init__(self, table: ClaimTable, *, interval: float) -> None:
        super().__init__("pulse-watchdog", join_timeout=interval + 5)
        self.table = table
        self.tick = min(0.25, interval / 4)

    def run(self) -> None:
        while not self.sleep(self.tick):
            try:
                self.enforce_deadlines()
            except Exception:
                logger.exception("pulse: lease watchdog failed unexpectedly")

    def enforce_deadlines(self) -> None:
        """Lose every lease past its local deadline; hard-stop what ignored LeaseLost."""
        table = self.table
        now = table.monotonic()
        for claim in table.snapshot(displaced=True):
            if claim.state in (RESERVED, RUNNING) and now >= claim.deadline:
                table.lose(claim, "self-fenced: no successful renewal before the local deadline")
            elif (claim.state == LOST and claim.pid is not None and not claim.hard_stopped
                  and claim.lost_at is not None and now >= claim.lost_at + table.grace):
                claim.hard_stopped = True
                table.counters.hard_stopped += 1
                logger.error("pulse: task %s epoch %d ignored LeaseLost for %gs: hard stop",
                             claim.task_id, claim.epoch, table.grace)
                table.listener.on_hard_stop(claim)
