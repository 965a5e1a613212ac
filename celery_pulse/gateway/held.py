"""The attempts a worker instance holds, as its gateway client keeps them.

Two views, one lock: the references to resume after a reconnect (until the attempt is
finished or lost), and every assignment by ``(Celery task id, epoch)`` until it is
finished or given up: a lost attempt is still found, because its late finish must
still reach the gateway (to be kept as evidence). At most ``KEPT`` of the latter: the
oldest go first (lost ones nobody finished).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from celery_pulse.gateway.replies import KEPT, Assigned

_REF = ("task_id", "attempt_id", "epoch", "lease_secret")


def assigned_of(body: Mapping[str, Any]) -> Assigned:
    """A ``task.assign`` body as the worker takes it (received now)."""
    task = body["task"]
    return Assigned(task["id"], task["name"], task, {k: body[k] for k in _REF},
                    body["lease_until"], time.monotonic())


class Held:
    """See the module's rules (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._resume: dict[str, Mapping[str, str]] = {}  # attempt_id -> ref
        self._by_task: dict[tuple[str, int], Assigned] = {}

    def add(self, assigned: Assigned) -> None:
        with self._lock:
            self._resume[assigned.ref["attempt_id"]] = assigned.ref
            self._by_task[(assigned.task_id, int(assigned.ref["epoch"]))] = assigned
            while len(self._by_task) > KEPT:
                del self._by_task[next(iter(self._by_task))]

    def get(self, task_id: str, epoch: int) -> Assigned | None:
        with self._lock:
            return self._by_task.get((task_id, epoch))

    def of_attempt(self, attempt_id: str) -> Assigned | None:
        with self._lock:
            for assigned in self._by_task.values():
                if assigned.ref["attempt_id"] == attempt_id:
                    return assigned
        return None

    def to_resume(self) -> list[Mapping[str, str]]:
        with self._lock:
            return list(self._resume.values())

    def forget(self, ref: Mapping[str, str], *, lost_only: bool = False) -> None:
        with self._lock:
            self._resume.pop(ref["attempt_id"], None)
            if lost_only:
                return
            for key, value in list(self._by_task.items()):
                if value.ref["attempt_id"] == ref["attempt_id"]:
                    del self._by_task[key]
