"""``current_lease()`` for every task, the ones run in-process included.

A pulse worker's pool process gives the task it runs a real :class:`~celery_pulse.Lease`
(:mod:`celery_pulse.pool.child`). A task run in the calling process instead — eagerly
(``task_always_eager``, ``.apply()``), called directly, or by a worker of another pool
(``celery.contrib.testing`` workers, ``-P solo``/``threads``) — has no lease: no store
granted it, nothing renews it, nobody can take it over. It gets an
:class:`InProcessLease` that always holds, so code written for a pulse worker runs
unchanged in a test: ``check()`` passes and ``fenced(conn)`` is a plain transaction.
It fences nothing. Outside any task ``current_lease()`` stays None.

"Inside a task" is Celery's own answer: its current task (a thread-local stack the
tracer and ``Task.__call__`` push) is set.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import current_task

from celery_pulse import lease as pulse_lease
from celery_pulse.errors import InvalidConfig
from celery_pulse.lease import Lease
from celery_pulse.store.checkpoints import Checkpoint, encode_checkpoint

#: The epoch of an in-process lease: no store ever granted it (real epochs start at 1).
IN_PROCESS_EPOCH = 0


@contextmanager
def _plain_transaction(lease: Lease, target: Any) -> Iterator[Any]:
    """``fenced(conn)`` without a store: one transaction, commit on exit, roll back on error.

    The same argument checks as the real fence, so a test catches what production refuses.
    """
    kind = pulse_lease.fence_kind_of(target)
    if kind is not None:
        with kind.plain(target):
            yield target
        return
    begin = getattr(target, "begin", None)
    in_transaction = getattr(target, "in_transaction", None)
    if not callable(begin) or not callable(in_transaction):
        raise InvalidConfig("lease.fenced() takes a SQLAlchemy Connection or Session")
    if in_transaction():
        raise InvalidConfig("lease.fenced(): the connection is already in a transaction; "
                            "commit or roll back first")
    with begin():
        yield target


class InProcessLease(Lease):
    """The lease of a task run in-process: always held, fences nothing.

    ``task_id`` is the request's id (None for a direct call), ``epoch`` is
    :data:`IN_PROCESS_EPOCH`, ``token`` is empty.
    """

    def __init__(self, task_id: Any, holder: str) -> None:
        super().__init__(task_id, IN_PROCESS_EPOCH, "", holder,
                         read_deadline=lambda: (math.inf, False),
                         fencer=_plain_transaction, initial_deadline=math.inf)

    def __repr__(self) -> str:
        return f"<InProcessLease task_id={self.task_id!r} (always held, fences nothing)>"

    @property
    def lost(self) -> bool:
        return False

    def checkpoint(self, value: Any, *, wait: bool = False) -> None:
        """Checked as a pulse worker checks it (JSON, at most 64 KiB), then kept nowhere:
        no later attempt of an in-process task reads it."""
        encode_checkpoint(value)
        self.checkpoint_seq += 1

    @property
    def last_checkpoint(self) -> Checkpoint | None:
        return None


def current_lease() -> Lease | None:
    """The lease of the task running here: a pulse worker's, an in-process one, or None.

    None only outside any task. Under a pulse worker it is the real lease; a task run
    in-process (eager, ``.apply()``, a direct call, another pool) gets an
    :class:`InProcessLease`.
    """
    lease = pulse_lease.current_lease()
    if lease is not None:
        return lease
    task = current_task._get_current_object()  # None outside any task
    if task is None:
        return None
    request = task.request
    return InProcessLease(getattr(request, "id", None),
                          getattr(request, "hostname", None) or "in-process")
