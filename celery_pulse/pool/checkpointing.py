"""A pool child's checkpoints (``lease.checkpoint()``): to the slots, or to the store.

By default a checkpoint is left in the attempt's shared slot
(:class:`~celery_pulse.pool.slots.CheckpointSlots`) and the worker's next renewal
carries it. ``wait=True`` also commits it from here, on the child's own store
connection, fenced as the renewal's. When the body ends, a value no renewal carried yet
is committed here before the outcome goes to the worker, so the attempt that follows (a
retry, say) reads it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery_pulse.errors import PulseError
from celery_pulse.lease import Lease
from celery_pulse.pool.slots import CheckpointSlots
from celery_pulse.store.checkpoints import Checkpoint, CheckpointWrite

logger = logging.getLogger(__name__)

#: How often a ``wait=True`` checkpoint asks again while a fenced transaction holds the row.
BUSY_POLL = 0.05


class SlotCheckpointer:
    """One attempt's checkpoints (see :class:`celery_pulse.lease.Checkpointer`)."""

    def __init__(self, store: Callable[[], Any], holder: str, ttl: float,
                 slots: CheckpointSlots | None, slot: int | None) -> None:
        self._store = store
        self._holder = holder
        self._ttl = ttl
        self._slots = slots if slot is not None else None
        self._slot = slot
        self._latest: tuple[int, str] | None = None
        self._committed = 0

    def write(self, lease: Lease, seq: int, text: str, wait: bool) -> None:
        self._latest = (seq, text)
        if wait or self._slots is None or self._slot is None:
            # Not left for the renewal too: it would only send it again, for nothing (an
            # older value still in the slot is not newer than this one: never kept).
            self._commit(lease, seq, text)
        else:
            self._slots.put(self._slot, lease.task_id, lease.epoch, seq, text)

    def last(self, lease: Lease) -> Checkpoint | None:
        found: Checkpoint | None = self._store().last_checkpoint(lease.task_id)
        return found if found is not None and found.epoch < lease.epoch else None

    def flush(self, lease: Lease) -> None:
        """The body ended: commit the latest value if no renewal has yet."""
        if self._latest is None or lease.lost:
            return
        seq, text = self._latest
        carried = self._committed
        if self._slots is not None and self._slot is not None:
            carried = max(carried, self._slots.carried(self._slot, lease.task_id, lease.epoch))
        if seq > carried:
            self._commit(lease, seq, text)

    def _commit(self, lease: Lease, seq: int, text: str) -> None:
        write = CheckpointWrite(lease.task_id, lease.epoch, lease.token, seq, text)
        deadline = time.monotonic() + self._ttl
        while True:
            held, busy = self._store().checkpoint(self._holder, [write])
            if lease.task_id in held:
                self._committed = max(self._committed, seq)
                return
            if lease.task_id not in busy:
                raise lease.lost_error(" (the store refused the checkpoint)")
            if time.monotonic() >= deadline:
                raise PulseError(f"checkpoint of task {lease.task_id} not committed: a "
                                 "fenced transaction held its claim row for a whole TTL")
            time.sleep(BUSY_POLL)  # a poll with a deadline: the row's holder decides


def flush(lease: Lease) -> None:
    """Commit what the body's last checkpoint left uncarried (never fails the task)."""
    checkpointer = lease.checkpointer
    if not isinstance(checkpointer, SlotCheckpointer):
        return
    try:
        checkpointer.flush(lease)
    except Exception as exc:  # a lost lease, a store away: the task's outcome stands
        logger.warning("pulse: the last checkpoint of task %s (epoch %d) was not committed: "
                       "%s", lease.task_id, lease.epoch, exc)
