"""The store's records: the frozen values its contract takes and answers, and the claim states.

No behaviour lives here: what a store does with these is written in
:mod:`celery_pulse.store.contracts`. Tokens are credentials, so every record holding one
masks it in its ``repr`` (:func:`mask_token`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from celery_pulse.errors import PulseError

#: One attempt's lease as the store fences it: ``(task_id, epoch, token)``. The epoch
#: orders attempts of one task; the token proves this attempt holds the epoch.
LeaseKey = tuple[str, int, str]


@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """A granted worker registration."""

    worker_id: str
    token: str
    expires_at: float
    draining: bool = False

    def __repr__(self) -> str:  # tokens are never shown in full
        return (f"Registration(worker_id={self.worker_id!r}, token={mask_token(self.token)!r}, "
                f"expires_at={self.expires_at!r})")


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    """The answer to a successful heartbeat."""

    expires_at: float
    draining: bool


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One row of the registry as seen now by the store clock."""

    worker_id: str
    labels: Mapping[str, Any]
    registered_at: float
    last_heartbeat: float
    expires_at: float
    alive: bool
    #: ``expires_at - store_now`` (negative once expired).
    expires_in: float
    draining: bool


def mask_token(token: str) -> str:
    """The first 6 characters of a token: enough to correlate logs, useless to an attacker."""
    return token[:6] + "…" if token else ""


# -- task claims (seed 000 taskboard, seed 003 LEASED -> RUNNING) --------------------

#: Claim states. ``open``: released (a retry, a requeue, or Recover re-published it) and
#: waiting for the next delivery to reserve it. ``needs_review``: a started attempt was
#: lost and nobody can know whether its side effects happened. ``revoked``: Celery
#: dropped the request (revoked or expired) or terminated it on a revoke.
RESERVED, RUNNING, OPEN = "reserved", "running", "open"
SUCCEEDED, FAILED, NEEDS_REVIEW, REVOKED = "succeeded", "failed", "needs_review", "revoked"
LIVE_STATES = (RESERVED, RUNNING)
TERMINAL_STATES = (SUCCEEDED, FAILED, NEEDS_REVIEW, REVOKED)
#: Terminal states a *new publication* of the same task id may start over from (a
#: needs-review task waits for a human, whatever is published meanwhile).
RESTARTABLE_STATES = (SUCCEEDED, FAILED, REVOKED)
#: Finished states retention purges.
FINISHED_STATES = (SUCCEEDED, FAILED, REVOKED)
#: Every claim state, as a filter of :class:`~celery_pulse.store.pages.ClaimQuery` names them.
CLAIM_STATES = (RESERVED, RUNNING, OPEN, SUCCEEDED, FAILED, NEEDS_REVIEW, REVOKED)
#: Completion outcomes a holder may report: ``succeeded``, ``failed``, ``revoked``, or
#: ``retry`` (the claim re-opens for the next delivery of the task: a Celery retry or a
#: requeue).
RETRY = "retry"
POLICIES = ("redispatch", "review")


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """The original broker message, byte-exact, so it can be re-published as it came."""

    body: bytes
    headers: Mapping[str, Any]
    properties: Mapping[str, Any]
    delivery_info: Mapping[str, Any]
    content_type: str
    content_encoding: str


@dataclasses.dataclass(frozen=True, slots=True)
class ReserveRequest:
    task_id: str
    task_name: str
    message: Message
    policy: str
    max_attempts: int
    #: Celery's ``retries`` header: a higher value is a newer message for the same id.
    retries: int = 0
    #: Identity of the publication (stamped by the publisher; None if it has none): a
    #: redelivery of the same publication is a duplicate, a new publication of the same
    #: task id is a new run once the previous one has ended.
    publication: str | None = None
    #: Grant it as ``running`` at once: its job goes straight to a free pool process,
    #: so the start is folded into the reservation (one statement instead of two).
    start: bool = False
    #: With ``start``: the permits that start needs. Only a store that
    #: :attr:`~celery_pulse.store.contracts.ClaimStore.folds_permits` takes them in the
    #: reservation's transaction (granted ``running`` if they are free, else reserved);
    #: any other reserves it, and the worker starts it with its permits as usual.
    permits: tuple[Permit, ...] = ()

    @property
    def starts_now(self) -> bool:
        """Granted as ``running`` by the reservation itself (no permits to take)."""
        return self.start and not self.permits


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """A lease: the credential ``(task_id, epoch, token)`` valid until ``lease_until``."""

    task_id: str
    epoch: int
    token: str
    lease_until: float
    attempts: int
    #: Granted as ``running`` (the request asked to ``start``).
    started: bool = False

    def __repr__(self) -> str:
        return (f"Grant(task_id={self.task_id!r}, epoch={self.epoch}, "
                f"token={mask_token(self.token)!r}, attempts={self.attempts}, "
                f"started={self.started})")


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why a reservation was not granted.

    ``reason`` is ``taken`` (another live holder, or a started attempt awaiting
    Recover), ``terminal`` (finished or needs review) or ``exhausted`` (the attempt
    budget is spent: the claim is now ``failed``).
    """

    task_id: str
    reason: str
    state: str
    holder: str | None
    epoch: int
    retries: int
    #: The publication the claim currently belongs to (None: unknown).
    publication: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Permit:
    """One of the cluster-wide concurrency permits a start needs: at most ``limit``
    claims hold ``key`` while ``running``, across every worker of the store.

    With ``window`` (seconds) it is a rate permit instead: at most ``limit`` starts of
    ``key`` are granted within any ``window`` seconds, across the cluster. A granted
    start counts for the window whatever becomes of its claim; nothing gives it back.
    """

    key: str
    limit: int
    window: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PermitUsage:
    """A concurrency limit as the store sees it now."""

    key: str
    limit: int
    #: Running claims holding the permit.
    running: int
    #: Reserved claims whose start was refused for want of it (they wait in a worker).
    waiting: int
    #: Store time the oldest waiter began (its reservation); None: nobody. Not compared.
    oldest_waiting_since: float | None = dataclasses.field(default=None, compare=False)
    #: A rate's window (seconds): then ``running`` is the starts granted within it.
    window: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ResultRecord:
    """A value for the result backend's table, written with a fenced completion."""

    key: str
    #: None: nothing to write (a chord part whose result is ignored still counts).
    value: bytes | None
    #: The backend's state of the value (a ``final`` one is never overwritten).
    state: str
    #: Seconds it lives from the write (None: for ever).
    expires: float | None
    #: The state no write replaces (the backend's success).
    final: str
    #: A counter (a chord's) to add one to, if the completion applies, in its transaction:
    #: each part counts once, whatever repeats. The count this part made is answered.
    counter: str | None = None
    #: Kept with the counter when this part creates it: what finishing the count needs
    #: if the worker that made it whole died before it could (a chord's callback).
    counter_note: bytes | None = None


#: The token of a completion whose holder knows its lease was lost (the worker's own
#: deadline passed, or the store said so): no lease has it, so the store never applies
#: it and keeps it as evidence (a late outcome the reviewer needs), however the claim
#: stands in the store.
LOST_TOKEN = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    task_id: str
    epoch: int
    token: str
    #: ``succeeded``, ``failed``, ``revoked``, ``retry`` (re-open for the next delivery) or
    #: ``needs_review`` (the holder can't tell what its attempt did: a human decides).
    outcome: str
    error: str | None = None
    #: The attempt's result for the ``pulse://`` backend: written only if the completion
    #: applies, in its transaction (a stale attempt's result is never visible).
    result: ResultRecord | None = None
    #: The attempt's return value as Celery shows it (its repr): kept in
    #: ``pulse_evidence`` if the completion is stale, for the reviewer; never applied.
    returned: str | None = None
    #: Messages the attempt published, carried for the store's side to publish before it
    #: applies the completion (a gateway worker's: :func:`celery_pulse.deferral.keep_published`).
    published: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimInfo:
    """A claim as the store sees it now (store clock); ``queue`` is its delivery's
    routing key (None on claims reserved before pulse kept it)."""

    task_id: str
    task_name: str
    state: str
    holder: str | None
    epoch: int
    attempts: int
    max_attempts: int
    policy: str
    #: ``lease_until - store_now``; None when there is no lease.
    lease_remaining: float | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    outcome: str | None
    error: str | None
    queue: str | None = None
    #: The task's last checkpoint: when it was written (store clock) and its JSON's size.
    checkpoint_at: float | None = None
    checkpoint_size: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Exchanged:
    """What one :meth:`ClaimStore.exchange` did: one answer per operation passed in.

    An answer the store could not give after the exchange took effect (a follow-up read
    failed) is the store's error, for that operation alone.
    """

    #: ``task_id -> applied|duplicate|evidence``, as :meth:`ClaimStore.complete`.
    completed: Mapping[str, str | PulseError]
    #: One grant or refusal per reservation, in order, as :meth:`ClaimStore.reserve`.
    reserved: Sequence[Grant | Refusal | PulseError]
    #: ``task_id -> new lease_until`` of the starts that moved, as
    #: :meth:`ClaimStore.start_many`.
    started: Mapping[str, float]
    #: ``task_id -> (count, nonce)`` of the applied completions that added to a counter
    #: (:attr:`ResultRecord.counter`): the counter's value once this one counted, and the
    #: nonce the counter got when it was created (a new one per run of a chord).
    counted: Mapping[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    #: Starts not made for want of a concurrency permit (still reserved, lease unchanged).
    waiting: frozenset[str] = frozenset()
    #: Of those, the ones that wait on a rate: seconds until it may have room.
    retry_in: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Waiting(set[str]):
    """The task ids whose start waits for a permit (``start_many``'s ``waiting``), and
    for those that wait on a rate limit, the seconds until the rate may have room by the
    store's clock (``retry_in``): a waiter asks again then, not by polling."""

    def __init__(self, *ids: str) -> None:
        super().__init__(ids)
        self.retry_in: dict[str, float] = {}

    def add_from(self, other: set[str]) -> None:
        self.update(other)
        self.retry_in.update(getattr(other, "retry_in", {}))


@dataclasses.dataclass(frozen=True, slots=True)
class Recovered:
    """A claim Recover (or a reviewer) took over.

    ``state`` is ``open`` (re-publish ``message``, then :meth:`RecoverStore.mark_published`
    with ``epoch``/``token``), ``needs_review`` or ``failed`` (budget spent). ``epoch`` is
    the new one; the attempt that was lost held ``epoch - 1``, as ``holder``.
    """

    task_id: str
    task_name: str
    state: str
    was: str
    epoch: int
    token: str | None
    attempts: int
    message: Message
    #: Who held the claim before it was taken over (the holder that lost its lease, the
    #: worker that requeued it, the last holder of a reviewed task); None if nobody did.
    holder: str | None = None

    def __repr__(self) -> str:
        return (f"Recovered(task_id={self.task_id!r}, state={self.state!r}, was={self.was!r}, "
                f"epoch={self.epoch})")


@dataclasses.dataclass(frozen=True, slots=True)
class ReviewItem:
    task_id: str
    task_name: str
    last_holder: str | None
    epoch: int
    attempts: int
    args_summary: str
    since: float
    #: Why it waits for a human ("holder a@h lost its lease at epoch 2 after it started").
    reason: str = ""
    #: Store time it entered review; None if the store did not record it (older rows).
    entered_at: float | None = None
    #: How far it got: its last checkpoint's time (store clock) and size, if any.
    checkpoint_at: float | None = None
    checkpoint_size: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderGrant:
    key: str
    holder: str
    token: str
    epoch: int
    lease_until: float

    def __repr__(self) -> str:
        return (f"LeaderGrant(key={self.key!r}, holder={self.holder!r}, epoch={self.epoch}, "
                f"token={mask_token(self.token)!r})")


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderInfo:
    key: str
    holder: str
    epoch: int
    alive: bool
    lease_remaining: float
    acquired_at: float


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """A periodic slot recorded by a leader: ``payload`` is the JSON publish spec."""

    entry: str
    due_at: float
    task_id: str
    task: str
    payload: str


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduleRow:
    name: str
    task: str
    kind: str
    spec: str
    args: str
    kwargs: str
    options: str
    enabled: bool
    updated_at: float

