"""A table of lease deadlines shared between the worker and its pool children.

The worker renews leases; the child running a task must know, without asking the
store, until when its lease holds (``lease.deadline``, ``lease.check()``) — also
when the worker itself is gone. The table is an anonymous shared ``mmap`` created
before the children fork, so every child (replacements included) sees the
parent's writes. Each slot is ``(task id hash, deadline, lost)``; deadlines are
``time.monotonic()`` values, which are system-wide on Linux.

:class:`CheckpointSlots`, beside it: checkpoints on their way from a pool child to the
worker's renewal.

A task's ``lease.checkpoint(value)`` (:mod:`celery_pulse.lease`) must not cost a
statement of its own: the child leaves the latest value of its attempt here, in the
slot its deadline has in :class:`~celery_pulse.pool.slots.DeadlineTable`, and the
worker's renewer reads every running lease's slot once per interval and carries what
changed to the store in one batch (:class:`~celery_pulse.leases.renewal.Renewer`).

Each slot has one writer for its value (the child running the attempt) and one for
``carried`` (the parent, after the store committed a write). The value is published
with a sequence lock: the child makes ``version`` odd, writes, makes it even again; the
parent takes a value only if it read the same even version before and after. The
mapping is anonymous and shared, made before the children fork, and reserves no memory:
only the pages a checkpoint touches are ever used.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import threading
from collections.abc import Sequence
from typing import Protocol

from celery_pulse.store.checkpoints import MAX_CHECKPOINT_BYTES, CheckpointWrite

_SLOT = struct.Struct("=qdB7x")
#: A checkpoint slot's head: version, owner (task id hash), epoch, seq, carried seq,
#: length of the value; the value follows.
_HEAD = struct.Struct("=QqqQQI4x")
_VERSION = struct.Struct("=Q")
_CARRIED_AT = struct.calcsize("=Qqqq")  # the offset of ``carried`` in a slot
_CARRIED = struct.Struct("=Q")
_STRIDE = _HEAD.size + MAX_CHECKPOINT_BYTES


def task_hash(task_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(task_id.encode(), digest_size=8).digest(), "little",
                          signed=True)


class DeadlineTable:
    """Fixed-size shared table; the parent assigns and writes slots, children read them."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._mm = mmap.mmap(-1, size * _SLOT.size)
        self._free = list(range(size - 1, -1, -1))
        self._lock = threading.Lock()
        #: Checkpoints, one slot per deadline slot.
        self.checkpoints = CheckpointSlots(size)

    def assign(self, task_id: str, deadline: float) -> int | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        self.checkpoints.clear(slot)
        self.write(slot, task_id, deadline, False)
        return slot

    def write(self, slot: int, task_id: str, deadline: float, lost: bool) -> None:
        _SLOT.pack_into(self._mm, slot * _SLOT.size, task_hash(task_id), deadline, lost)

    def read(self, slot: int, task_id: str) -> tuple[float, bool] | None:
        """``(deadline, lost)`` if the slot still belongs to ``task_id``."""
        owner, deadline, lost = _SLOT.unpack_from(self._mm, slot * _SLOT.size)
        if owner != task_hash(task_id):
            return None
        return deadline, bool(lost)

    def free(self, slot: int) -> None:
        _SLOT.pack_into(self._mm, slot * _SLOT.size, 0, 0.0, True)
        with self._lock:
            self._free.append(slot)


class Held(Protocol):
    """What the slots need of a held lease (the keeper's ``LocalClaim``)."""

    task_id: str
    epoch: int
    token: str
    slot: int | None


class CheckpointSlots:
    """One slot per deadline slot; the child writes values, the parent carries them."""

    def __init__(self, size: int) -> None:
        self.size = size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_NORESERVE", 0)
        self._mm = mmap.mmap(-1, size * _STRIDE, flags=flags)

    # -- the child's side --------------------------------------------------------------
    def put(self, slot: int, task_id: str, epoch: int, seq: int, text: str) -> None:
        """Leave write ``seq`` of attempt ``(task_id, epoch)`` for the next renewal."""
        data = text.encode()
        base = slot * _STRIDE
        version = _VERSION.unpack_from(self._mm, base)[0]
        carried = self.carried(slot, task_id, epoch)
        _VERSION.pack_into(self._mm, base, version | 1)  # odd: being written
        self._mm[base + _HEAD.size:base + _HEAD.size + len(data)] = data
        _HEAD.pack_into(self._mm, base, version | 1, task_hash(task_id), epoch, seq, carried,
                        len(data))
        _VERSION.pack_into(self._mm, base, (version | 1) + 1)  # even: readable

    def carried(self, slot: int, task_id: str, epoch: int) -> int:
        """The highest write of this attempt the store committed from here (0: none)."""
        _, owner, owner_epoch, _, carried, _ = _HEAD.unpack_from(self._mm, slot * _STRIDE)
        return carried if (owner, owner_epoch) == (task_hash(task_id), epoch) else 0

    # -- the parent's side -------------------------------------------------------------
    def clear(self, slot: int) -> None:
        """A slot given to a new lease holds nothing of the one before."""
        base = slot * _STRIDE
        version = _VERSION.unpack_from(self._mm, base)[0]
        _HEAD.pack_into(self._mm, base, version + (version & 1), 0, 0, 0, 0, 0)

    def pending(self, held: Sequence[Held]) -> list[CheckpointWrite]:
        """The writes of ``held`` leases not carried yet (a slot being written is
        skipped: its value goes with the next renewal)."""
        out: list[CheckpointWrite] = []
        for claim in held:
            if claim.slot is None:
                continue
            base = claim.slot * _STRIDE
            version, owner, epoch, seq, carried, length = _HEAD.unpack_from(self._mm, base)
            if seq <= carried or version & 1 or epoch != claim.epoch \
                    or owner != task_hash(claim.task_id):
                continue
            text = self._mm[base + _HEAD.size:base + _HEAD.size + length].decode(
                errors="replace")
            if _VERSION.unpack_from(self._mm, base)[0] != version:
                continue  # rewritten while read
            out.append(CheckpointWrite(claim.task_id, claim.epoch, claim.token, seq, text))
        return out

    def mark_carried(self, held: Sequence[Held], writes: Sequence[CheckpointWrite]) -> None:
        """The store committed ``writes``: their children need not write them again."""
        slots = {(c.task_id, c.epoch): c.slot for c in held}
        for write in writes:
            slot = slots.get((write.task_id, write.epoch))
            if slot is not None and self.carried(slot, write.task_id, write.epoch) < write.seq:
                _CARRIED.pack_into(self._mm, slot * _STRIDE + _CARRIED_AT, write.seq)
