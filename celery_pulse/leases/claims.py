"""The records of the lease table: one held lease, its states, and the counters.

What a :class:`LocalClaim` is (this worker's view of one lease), the states it goes
through, what the keeper tells its :class:`LeaseListener`, and what an operator sees
counted (:class:`Counters`). No behaviour beyond the records' own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from celery_pulse.errors import PulseError
from celery_pulse.store.base import (
    Grant,
    LeaseKey,
    Permit,
    Refusal,
    ResultRecord,
    mask_token,
)

RESERVED, RUNNING, LOST = "reserved", "running", "lost"
#: A start's answer when the store found no free concurrency permit for it: the claim is
#: still reserved and its lease unchanged (neither True, started, nor False, refused).
WAITING = "waiting"
#: How long a lost, never-started claim stays in the table (for the intake's duplicate
#: check only: the adapter binds each claim to its request, so a late request still
#: finds its lost claim and is dropped however long it waited).
LOST_MEMORY = 300.0


@dataclasses.dataclass(slots=True, eq=False)
class LocalClaim:
    """This worker's view of one lease it holds."""

    task_id: str
    epoch: int
    token: str
    deadline: float
    retries: int = 0
    state: str = RESERVED
    #: The claim's attempts count with this grant (its reservations so far, this one
    #: included): the attempt number task events carry.
    attempts: int = 0
    #: Held in memory until an ETA/countdown: does not count against prefetch.
    scheduled: bool = False
    pid: int | None = None
    slot: int | None = None
    lost_at: float | None = None
    lost_reason: str = ""
    hard_stopped: bool = False
    #: Counted in ``LeaseKeeper.unstarted()`` (waiting for a pool process: reserved, or
    #: started ahead of the pool).
    counted: bool = False
    #: The job went to the pool (it may run; before that, a started claim never ran).
    in_pool: bool = False
    #: Recover re-dispatches this task whether it started or not (acks_late, idempotent):
    #: its start is recorded in the background instead of before the body.
    start_in_background: bool = False
    #: The publication this grant belongs to (None: the message carried none).
    publication: str | None = None
    #: The adapter asked for the job to be run (it may be waiting for its start).
    applied: bool = False
    #: The adapter's check, once the job went to the pool, that the pool dropped it
    #: before writing it to any process (Celery flushes such jobs on a broker reconnect
    #: and at shutdown): then it never ran.
    dropped_by_pool: Callable[[], bool] | None = None
    #: A start ahead of the pool is in flight; the job waiting for its answer, if any.
    starting: bool = False
    #: Its last start waited on a rate limit: seconds until the rate may have room.
    retry_in: float | None = None
    waiting_job: Any = None
    #: When the job went to the pool (monotonic), for the mean run time.
    handed_at: float = 0.0
    #: The attempt's result for the store's result backend, sent with its completion.
    result: ResultRecord | None = None
    #: What the attempt returned, as Celery shows it (its repr): kept as evidence if the
    #: attempt turns out stale.
    returned: str | None = None
    #: Opaque adapter data of a chord part (its request), for when its count comes back.
    chord_part: Any = None
    #: Messages the attempt published that its completion carries (a gateway worker's).
    published: tuple[Any, ...] = ()
    #: The cluster-wide concurrency permits its start needs (None: not decided yet).
    permits: tuple[Permit, ...] | None = None
    #: When its start first found no free permit (monotonic), while it waits for one.
    parked_at: float | None = None
    #: Starts of it the store failed in a row (the retry backs off on them).
    start_failures: int = 0
    #: Opaque adapter data (the Celery request, the captured message, its verdict).
    request: Any = None
    message: Any = None
    verdict: str | None = None

    @property
    def key(self) -> LeaseKey:
        return (self.task_id, self.epoch, self.token)

    def __repr__(self) -> str:
        return (f"LocalClaim({self.task_id!r}, epoch={self.epoch}, "
                f"token={mask_token(self.token)!r}, state={self.state})")


def dropped_unwritten(claim: LocalClaim) -> bool:
    """The job went to the pool, no process accepted it, and the pool dropped it unwritten."""
    return claim.pid is None and claim.dropped_by_pool is not None and claim.dropped_by_pool()


class LeaseListener(Protocol):
    """Called from the renewer thread."""

    def on_lost(self, claim: LocalClaim) -> None: ...
    def on_hard_stop(self, claim: LocalClaim) -> None: ...
    def on_renewed(self, claims: Sequence[LocalClaim]) -> None: ...


@dataclasses.dataclass
class Counters:
    """What an operator wants counted (exported in worker stats)."""

    reserved: int = 0
    duplicates: int = 0
    lost: int = 0
    hard_stopped: int = 0
    completed: int = 0
    stale_completions: int = 0
    renewals: int = 0
    renew_failures: int = 0
    #: Checkpoints the renewals carried to the store.
    checkpoints: int = 0
    store_errors: int = 0
    #: Reservations the store refused to decide for contention (rows locked by other
    #: workers through all of its retries): tried again, not counted as store errors.
    contended: int = 0
    #: Hot-path exchanges with the store (one round trip each on PostgreSQL) and the
    #: operations they carried: what the group commit saves is ops / exchanges.
    exchanges: int = 0
    exchanged_ops: int = 0
    #: Deliveries settled without running: malformed, or refused by the store alone.
    rejected: int = 0
    renew_latency: list[float] = dataclasses.field(default_factory=list)

    def record_latency(self, seconds: float) -> None:
        self.renew_latency.append(seconds)
        del self.renew_latency[:-256]

    def latency_percentiles(self) -> dict[str, float | None]:
        data = sorted(self.renew_latency)
        if not data:
            return {"p50": None, "p99": None}
        return {"p50": round(data[len(data) // 2], 6),
                "p99": round(data[min(len(data) - 1, int(len(data) * 0.99))], 6)}


ReserveCallback = Callable[[Grant | Refusal | PulseError, float], None]
#: ``callback(answer, counted)``: ``counted`` is the completion's count, for one that
#: added to a counter (:attr:`Exchanged.counted`), else None.
CompleteCallback = Callable[[str | PulseError, tuple[int, str] | None], None]
StartCallback = Callable[[bool | str | PulseError], None]
