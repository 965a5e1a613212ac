"""A table of lease deadlines shared between the worker and its pool children.

The worker renews leases; the child running a task must know, without asking the
store, until when its lease holds (``lease.deadline``, ``lease.check()``) — also
when the worker itself is gone. The table is an anonymous shared ``mmap`` created
before the children fork, so every child (replacements included) sees the
parent's writes. Each slot is ``(task id hash, deadline, lost)``; deadlines are
``time.monotonic()`` values, which are system-wide on Linux.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import threading

_SLOT = struct.Struct("=qdB7x")


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

    def assign(self, task_id: str, deadline: float) -> int | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
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
