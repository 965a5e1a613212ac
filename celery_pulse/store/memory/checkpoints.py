"""Checkpoints on the memory store's claims (:mod:`celery_pulse.store.checkpoints`)."""

from __future__ import annotations

from collections.abc import Sequence

from celery_pulse.store.checkpoints import Checkpoint, CheckpointWrite, newest
from celery_pulse.store.memory.core import MemoryCore
from celery_pulse.store.memory.tables import ClaimRow


def is_newer(row: ClaimRow, write: CheckpointWrite) -> bool:
    """Whether ``write`` replaces the row's checkpoint (a later epoch, or a later write
    of the same attempt)."""
    if row.checkpoint_epoch is None or row.checkpoint_seq is None:
        return True
    return (write.epoch, write.seq) > (row.checkpoint_epoch, row.checkpoint_seq)


class MemoryCheckpoints(MemoryCore):
    """No row locks here: nothing is ever ``busy``."""

    def checkpoint(self, holder: str, writes: Sequence[CheckpointWrite]
                   ) -> tuple[set[str], set[str]]:
        with self._lock:
            now = self._enter()
            chosen = newest(writes)
            live = {row.task_id: row for row in self._live(holder, [w.key for w in chosen], now)}
            for write in chosen:
                row = live.get(write.task_id)
                if row is not None and is_newer(row, write):
                    row.checkpoint, row.checkpoint_epoch = write.value, write.epoch
                    row.checkpoint_seq, row.checkpoint_at = write.seq, now
            return set(live), set()

    def last_checkpoint(self, task_id: str) -> Checkpoint | None:
        with self._lock:
            self._enter()
            row = self.tables.claims.get(task_id)
            if row is None or row.checkpoint is None or row.checkpoint_epoch is None:
                return None
            return Checkpoint.of(row.checkpoint, row.checkpoint_epoch, row.checkpoint_at or 0.0)
