"""What the lease gateway keeps in the store so that any of its processes answers any
worker: each instance's sessions and declared capacity, and the attempts assigned to it.

The rules, before any code:

* **One current session per instance, cluster-wide.** :meth:`GatewayState.open_session`
  moves the instance to its next *generation* in one write; whatever gateway holds an
  older generation's session learns it at its next check (:meth:`generations`) and closes
  it. A reconnect must present the identity the first hello recorded (queue and
  capabilities, as a digest: :func:`identity_digest`); who owns the instance id is the
  credential store's (``bind_instance``), checked before.
* **Capacity with the instance.** The declared capacity (sequence, value, drain) is
  written by the session holding the current generation only (:meth:`declare`), and read
  back by the next session wherever it opens, so a drain survives a restart.
* **Attempts by id.** Every ``task.assign`` is recorded (:meth:`record_attempts`) before it
  is sent, with the claim token as a digest only: a frame naming an attempt a gateway
  never saw is checked against the record and the claim, never trusted. Records of
  attempts whose claims no longer run are purged after a while (:meth:`purge_attempts`).

Everything here is a small, rare write (a hello, a capacity change) or one insert per
assignment; no frame of a running task reads it unless its gateway has never seen it.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from celery_pulse.store.records import LIVE_STATES


def identity_digest(queue_id: str, capabilities: Iterable[Any]) -> str:
    """What a reconnect must present again, in any order of its capabilities."""
    canon = json.dumps([queue_id, sorted(json.dumps(c, sort_keys=True, default=str)
                                         for c in capabilities)], separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class Opened:
    """A session just opened: its generation and the instance's declared capacity."""

    generation: int
    capacity_sequence: int = -1
    capacity: int = 0
    drain: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One assignment, as any gateway may look it up (the token as a digest only)."""

    attempt_id: str
    instance_id: str
    task_id: str
    wire_task_id: str
    epoch: int
    token_digest: str
    task_name: str


def current_attempt(record: AttemptRecord, claim_state: str, claim_epoch: int) -> bool:
    """Whether ``record`` is the assignment that holds its claim now (the claim live,
    at the record's epoch)."""
    return claim_state in LIVE_STATES and record.epoch == claim_epoch


class IdentityChanged(Exception):
    """A reconnect presented another queue or other capabilities than the first hello."""


class GatewayState(abc.ABC):
    """Sessions, capacity and attempts of gateway instances (see the module's rules)."""

    @abc.abstractmethod
    def open_session(self, instance_id: str, session_id: str, gateway: str,
                     identity: str) -> Opened:
        """The instance's next generation, held by ``session_id`` on ``gateway``;
        :class:`IdentityChanged` if ``identity`` is not the one first recorded. The
        instance is bound (``bind_instance``) before."""

    @abc.abstractmethod
    def generations(self, instance_ids: Sequence[str]) -> dict[str, int]:
        """The current generation of each instance (those with a row)."""

    @abc.abstractmethod
    def declare(self, instance_id: str, generation: int, sequence: int, capacity: int,
                drain: bool) -> bool:
        """Record a capacity declaration if ``generation`` is still current (False:
        a newer session replaced it, nothing written)."""

    @abc.abstractmethod
    def record_attempts(self, records: Sequence[AttemptRecord]) -> None:
        """Keep assignments before they are sent (one statement for a batch)."""

    @abc.abstractmethod
    def find_attempt(self, attempt_id: str) -> AttemptRecord | None:
        """The assignment with this id, if recorded."""

    @abc.abstractmethod
    def live_attempts(self, instance_id: str, holder: str
                      ) -> list[tuple[AttemptRecord, str]]:
        """The instance's assignments whose claims its holder still holds under their
        epoch, with the claim's state (``reserved`` or ``running``): what a new session
        counts against its capacity."""

    @abc.abstractmethod
    def attempts_of(self, task_id: str) -> list[tuple[AttemptRecord, float]]:
        """Every recorded assignment of a task, with when (store clock), oldest first:
        what an operator reads beside the claim (``celery pulse attempts``)."""

    @abc.abstractmethod
    def purge_attempts(self, older_than: float) -> int:
        """Forget assignments recorded before ``older_than`` (store clock) whose claims
        no longer run under them; how many."""


class MemoryGatewayState(GatewayState):
    """In memory, for unit tests and the memory store; ``live(task_id, epoch, holder)``
    answers the state of a claim the holder (None: anyone) still holds under an epoch
    (None: nobody does)."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 live: Callable[[str, int, str | None], str | None] | None = None) -> None:
        self._clock = clock
        self._live = live or (lambda task_id, epoch, holder: None)
        self._lock = threading.Lock()
        #: instance_id -> [generation, identity, sequence, capacity, drain]
        self._instances: dict[str, list[Any]] = {}
        self._attempts: dict[str, tuple[AttemptRecord, float]] = {}

    def open_session(self, instance_id: str, session_id: str, gateway: str,
                     identity: str) -> Opened:
        with self._lock:
            row = self._instances.setdefault(instance_id, [0, identity, -1, 0, False])
            if row[1] != identity:
                raise IdentityChanged()
            row[0] += 1
            return Opened(row[0], row[2], row[3], row[4])

    def generations(self, instance_ids: Sequence[str]) -> dict[str, int]:
        with self._lock:
            return {i: self._instances[i][0] for i in instance_ids if i in self._instances}

    def declare(self, instance_id: str, generation: int, sequence: int, capacity: int,
                drain: bool) -> bool:
        with self._lock:
            row = self._instances.get(instance_id)
            if row is None or row[0] != generation:
                return False
            row[2:] = [sequence, capacity, drain]
            return True

    def record_attempts(self, records: Sequence[AttemptRecord]) -> None:
        with self._lock:
            for record in records:
                self._attempts[record.attempt_id] = (record, self._clock())

    def find_attempt(self, attempt_id: str) -> AttemptRecord | None:
        with self._lock:
            found = self._attempts.get(attempt_id)
        return None if found is None else found[0]

    def live_attempts(self, instance_id: str, holder: str
                      ) -> list[tuple[AttemptRecord, str]]:
        with self._lock:
            mine = [r for r, _ in self._attempts.values() if r.instance_id == instance_id]
        states = [(r, self._live(r.task_id, r.epoch, holder)) for r in mine]
        return [(r, state) for r, state in states if state is not None]

    def attempts_of(self, task_id: str) -> list[tuple[AttemptRecord, float]]:
        with self._lock:
            mine = [(r, at) for r, at in self._attempts.values() if r.task_id == task_id]
        return sorted(mine, key=lambda pair: (pair[1], pair[0].epoch))

    def purge_attempts(self, older_than: float) -> int:
        with self._lock:
            old = [a for a, (r, at) in self._attempts.items()
                   if at < older_than and self._live(r.task_id, r.epoch, None) is None]
            for attempt_id in old:
                del self._attempts[attempt_id]
        return len(old)
