"""The task-side API: ``current_lease()`` and the :class:`Lease` it returns.

Inside a task run by a pulse worker, the lease is the task's authority to apply
side effects. Its fencing token is ``(task_id, epoch)``: the epoch strictly grows
each time the task is granted again, so a resource that remembers the highest
epoch it has seen can refuse a stale holder's write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from celery_pulse.errors import InvalidConfig, LeaseLost, PulseError
from celery_pulse.store.base import mask_token
from celery_pulse.store.checkpoints import Checkpoint, encode_checkpoint

#: ``(deadline, lost)`` reader supplied by the pool child; None when the slot is gone.
DeadlineReader = Callable[[], "tuple[float, bool] | None"]
Fencer = Callable[["Lease", Any], AbstractContextManager[Any]]

_local = threading.local()


class FenceKind(Protocol):
    """How ``lease.fenced()`` fences a connection of another library than SQLAlchemy (an
    integration registers one: :mod:`celery_pulse.contrib.django`)."""

    def accepts(self, target: Any) -> bool:
        """Whether ``target`` is one of this kind's connections."""

    def fenced(self, lease: Lease, target: Any, ttl: float,
               same_store: Callable[[str], bool]) -> AbstractContextManager[Any]:
        """The fenced block on ``target`` (``same_store(url)``: whether a store URL
        names the pulse store's database; ``ttl`` caps its waits)."""

    def plain(self, target: Any) -> AbstractContextManager[Any]:
        """A plain transaction on ``target``: an in-process lease's fence."""


class Checkpointer(Protocol):
    """Where a lease's checkpoints go (the pool child's: :mod:`celery_pulse.pool.checkpointing`)."""

    def write(self, lease: Lease, seq: int, text: str, wait: bool) -> None:
        """Record ``text`` as write ``seq`` of this attempt: carried by the worker's next
        renewal, or (``wait``) committed before returning; LeaseLost if the store refuses."""

    def last(self, lease: Lease) -> Checkpoint | None:
        """The task's checkpoint committed by an earlier attempt, if any."""


#: A fenced block's own writer of checkpoints: it commits them with the block.
FenceWriter = Callable[[int, str], None]

#: The kinds registered, newest last.
_kinds: list[FenceKind] = []


def register_fence_kind(kind: FenceKind) -> None:
    """Let ``lease.fenced()`` take ``kind``'s connections (once per kind's type)."""
    if not any(type(known) is type(kind) for known in _kinds):
        _kinds.append(kind)


def fence_kind_of(target: Any) -> FenceKind | None:
    """The registered kind ``target`` is a connection of, if any."""
    return next((kind for kind in _kinds if kind.accepts(target)), None)


class Lease:
    """The lease under which the current task runs."""

    def __init__(self, task_id: str, epoch: int, token: str, holder: str, *,
                 read_deadline: DeadlineReader, fencer: Fencer, initial_deadline: float,
                 checkpointer: Checkpointer | None = None) -> None:
        self.task_id = task_id
        self.epoch = epoch
        self.token = token
        self.holder = holder
        self._read_deadline = read_deadline
        self._fencer = fencer
        self._initial_deadline = initial_deadline
        self._lost_signalled = False
        self._checkpointer = checkpointer
        #: This attempt's last checkpoint write (its sequence number).
        self.checkpoint_seq = 0
        self._last: tuple[Checkpoint | None] | None = None  # read once, then kept
        self._fences = 0  # fenced blocks open
        self._fence_writer: FenceWriter | None = None
        #: A LeaseLost was raised into the task already (by a check, a fenced block or
        #: the signal): the signal raises no second one while the task unwinds the first.
        self.raised = False

    def __repr__(self) -> str:
        return (f"<Lease task_id={self.task_id!r} epoch={self.epoch} "
                f"token={mask_token(self.token)!r} lost={self.lost}>")

    @property
    def deadline(self) -> float:
        """Local self-fence deadline (``time.monotonic()`` seconds)."""
        state = self._read_deadline()
        return self._initial_deadline if state is None else state[0]

    @property
    def lost(self) -> bool:
        """True once the lease is gone: revoked by the worker or past the local deadline."""
        if self._lost_signalled:
            return True
        state = self._read_deadline()
        if state is None:
            return time.monotonic() >= self._initial_deadline
        deadline, lost = state
        return lost or time.monotonic() >= deadline

    def mark_lost(self) -> None:
        self._lost_signalled = True

    def check(self) -> None:
        """Raise :class:`LeaseLost` if this task no longer holds its lease."""
        if self.lost:
            raise self.lost_error()

    def lost_error(self, detail: str = "") -> LeaseLost:
        """The :class:`LeaseLost` to raise into the task now (the lease is lost for good).

        Remembered, because a second one raised by the signal while the task unwinds the
        first would land anywhere: inside a library's rollback it broke SQLAlchemy's own
        state, and the task ended with an AssertionError instead of LeaseLost.
        """
        self._lost_signalled = True
        self.raised = True
        return LeaseLost(self.lost_message() + detail)

    def lost_message(self) -> str:
        # Not "held by": read as who holds the task now, it named the stale holder.
        return (f"lease lost for task {self.task_id} epoch {self.epoch}: this attempt, on "
                f"{self.holder}, no longer holds the task; stop applying side effects")

    @contextmanager
    def fenced(self, conn: Any) -> Iterator[Any]:
        """Run a block of writes on the store's database that commits only while we hold.

        ``conn`` is a SQLAlchemy ``Connection`` or ``Session`` on the store's database,
        not in a transaction (or a registered kind's: Django's ``connection`` with
        ``celery_pulse.contrib.django``). The claim row stays locked until commit, so no
        takeover can be granted in between; on loss the block rolls back and raises
        LeaseLost. A :meth:`checkpoint` inside a SQLAlchemy block commits with it.
        """
        with self._fencer(self, conn) as target:
            self._fences += 1
            try:
                yield target
            finally:
                self._fences -= 1

    @property
    def checkpointer(self) -> Checkpointer | None:
        return self._checkpointer

    def fence_writes(self, writer: FenceWriter | None) -> None:
        """Set (None: clear) the open fenced block's checkpoint writer (the fence's)."""
        self._fence_writer = writer

    # -- checkpoints (issue 40) --------------------------------------------------------
    def checkpoint(self, value: Any, *, wait: bool = False) -> None:
        """Record ``value`` (JSON, at most 64 KiB) as how far this task got.

        Fenced: only this attempt, while it holds the lease, can make it the task's
        checkpoint; a later attempt reads it as :attr:`last_checkpoint`. By default the
        worker's next renewal carries it (the latest value of each task, batched with
        the other renewals: no statement of its own); ``wait=True`` returns once it is
        committed. Inside a ``fenced()`` block it commits with the block. LeaseLost if
        this attempt no longer holds the lease: its value is never read.
        """
        text = encode_checkpoint(value)
        self.check()
        checkpointer = self._checkpoints()
        if self._last is None:  # before this attempt's first write replaces it
            self._last = (checkpointer.last(self),)
        self.checkpoint_seq += 1
        if self._fence_writer is not None:
            self._fence_writer(self.checkpoint_seq, text)
            return
        if self._fences:
            raise InvalidConfig("lease.checkpoint() inside a fenced block of this kind of "
                                "connection cannot commit with it: call it after the block")
        checkpointer.write(self, self.checkpoint_seq, text, wait)

    def _checkpoints(self) -> Checkpointer:
        if self._checkpointer is None:
            raise PulseError("checkpoints need a pulse worker with a SQL store "
                             "(a gateway worker cannot carry them yet)")
        return self._checkpointer

    @property
    def last_checkpoint(self) -> Checkpoint | None:
        """The task's checkpoint committed by an earlier attempt (Recover's re-dispatch,
        a retry, a requeue, ``review retry``): value, epoch and store time; None on a
        first attempt. Read from the store once, at first use."""
        if self._last is None:
            self._last = (self._checkpoints().last(self),)
        return self._last[0]


def current_lease() -> Lease | None:
    """The lease a pulse worker's pool process set for the task it runs, or None.

    The public ``celery_pulse.current_lease`` (:mod:`celery_pulse.inprocess`) adds the
    lease of tasks run in-process.
    """
    lease: Lease | None = getattr(_local, "lease", None)
    return lease


def set_current(lease: Lease | None) -> None:
    """Bind (or clear) the lease :func:`current_lease` answers: the pool process's runner
    calls it around each task it runs, nothing else should."""
    _local.lease = lease

