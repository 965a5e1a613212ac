"""Checkpoints carried by the lease: the contract, its records and its one rule.

A running attempt records a small JSON value (how far it got) on its claim, fenced like
every other write of an attempt: only while ``(task_id, epoch, token)`` holds the lease
by the store's clock. A later attempt of the same task (Recover's re-dispatch, a retry, a
requeue, ``review retry``) reads the latest value committed, with the epoch and the store
time that wrote it. The value lives on the claim row, so retention purges it with the
claim.

Each write of one attempt carries a sequence number that grows with every
``checkpoint()`` call; the store keeps a write only if it is newer than what the row
holds (a later epoch, or the same epoch and a higher sequence), so a value the worker's
renewal carries late never replaces a newer one the task wrote itself.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from celery_pulse.errors import PulseError
from celery_pulse.store.records import LeaseKey, mask_token

#: The largest checkpoint, as UTF-8 JSON: a cursor and a few counters, not a payload.
MAX_CHECKPOINT_BYTES = 64 * 1024


class CheckpointTooLarge(PulseError, ValueError):
    """A checkpoint's JSON is longer than :data:`MAX_CHECKPOINT_BYTES`."""


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointWrite:
    """One attempt's checkpoint to record: its lease, its sequence number and its JSON."""

    task_id: str
    epoch: int
    token: str
    seq: int
    value: str

    @property
    def key(self) -> LeaseKey:
        return (self.task_id, self.epoch, self.token)

    def __repr__(self) -> str:
        return (f"CheckpointWrite({self.task_id!r}, epoch={self.epoch}, "
                f"token={mask_token(self.token)!r}, seq={self.seq}, {len(self.value)} bytes)")


@dataclasses.dataclass(frozen=True, slots=True)
class Checkpoint:
    """A task's committed checkpoint: the value, the attempt and store time that wrote it."""

    value: Any
    epoch: int
    written_at: float
    size: int  # bytes of its JSON

    @classmethod
    def of(cls, text: str, epoch: int, written_at: float) -> Checkpoint:
        return cls(json.loads(text), int(epoch), float(written_at), len(text.encode()))


def encode_checkpoint(value: Any) -> str:
    """``value`` as the compact JSON a store keeps; TypeError if it is not JSON, and
    :class:`CheckpointTooLarge` past :data:`MAX_CHECKPOINT_BYTES`."""
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a checkpoint must be JSON-serialisable: {exc}") from exc
    size = len(text.encode())
    if size > MAX_CHECKPOINT_BYTES:
        raise CheckpointTooLarge(
            f"checkpoint is {size} bytes of JSON, more than {MAX_CHECKPOINT_BYTES}: keep a "
            "cursor in it, not the data")
    return text


def newest(writes: Sequence[CheckpointWrite]) -> list[CheckpointWrite]:
    """One write per lease, the highest sequence number of each."""
    best: dict[LeaseKey, CheckpointWrite] = {}
    for write in writes:
        known = best.get(write.key)
        if known is None or write.seq > known.seq:
            best[write.key] = write
    return list(best.values())


class CheckpointStore(abc.ABC):
    """Checkpoints on claims (issue 40)."""

    @abc.abstractmethod
    def checkpoint(self, holder: str, writes: Sequence[CheckpointWrite]
                   ) -> tuple[set[str], set[str]]:
        """Record each write as its task's checkpoint, in one transaction, where
        ``holder`` still holds the write's lease (epoch, token, a live state, unexpired by
        the store clock) and the write is newer than the row's (a later epoch, or this
        epoch and a higher ``seq``): the value, its epoch and sequence, and the store time.

        Returns ``(held, busy)``: ``held``, the task ids whose lease held (the write is
        the checkpoint now, or a newer one of the same attempt already was); ``busy``,
        those whose row a fenced transaction holds locked (still valid, nothing written:
        never waited for, as a renewal never waits). Any other task id's write changed
        nothing: its lease is gone, and its value is never read.
        """

    @abc.abstractmethod
    def last_checkpoint(self, task_id: str) -> Checkpoint | None:
        """The task's committed checkpoint, or None (no claim, or none written)."""
