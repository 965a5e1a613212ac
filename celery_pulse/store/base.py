"""The store contract: every rule the mechanism relies on, independent of SQL.

Rules common to every method:

* Time is the **store's clock**. "Expired" means ``expires_at <= store_now`` as the
  store evaluates it inside the statement; callers never compare their own clock
  with a stored timestamp. Timestamps returned are store-clock seconds since the
  epoch (float), useful only for display and for differences with :meth:`now`.
* Tokens are minted by the store inside the atomic statement that grants them
  (at least 128 bits of randomness). A token is the only credential.
* A store that cannot be reached raises :class:`~celery_pulse.errors.StoreUnavailable`;
  a store without the current schema raises :class:`~celery_pulse.errors.SchemaMissing`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

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


class RegistryStore(abc.ABC):
    """What worker membership needs from persistent storage."""

    # -- housekeeping -------------------------------------------------------
    @abc.abstractmethod
    def now(self) -> float:
        """The store clock (seconds since the epoch)."""

    @abc.abstractmethod
    def check_schema(self) -> None:
        """Raise :class:`SchemaMissing` unless the schema is present and current."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    # -- worker registry (seed 000 ``Registry``) ----------------------------
    @abc.abstractmethod
    def register(self, worker_id: str, labels: Mapping[str, Any], ttl: float, *,
                 replace_live: bool = True) -> Registration:
        """Register ``worker_id`` for ``ttl`` seconds under a freshly minted token.

        The same id replaces any earlier registration (a restarted worker is normal):
        the old token stops working at once. With ``replace_live=False`` a live
        registration is left alone and :class:`NotRegistered` (``replaced``) is
        raised instead — how a worker whose own registration expired takes its name
        back without stealing it from a newer process. The drain flag is kept.
        """

    @abc.abstractmethod
    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        """Extend the registration to ``store_now + ttl`` in one atomic statement.

        Applies only if ``token`` is the current token *and* the registration has
        not expired; otherwise raises :class:`NotRegistered` whose ``reason`` is
        ``replaced`` (a live registration with another token holds the name),
        ``expired`` (ours, or a dead one, ran out) or ``missing`` (no row).
        """

    @abc.abstractmethod
    def deregister(self, worker_id: str, token: str) -> bool:
        """Remove the registration if ``token`` is current; True if a row went away."""

    @abc.abstractmethod
    def list_workers(self) -> list[WorkerInfo]:
        """Every registration, with ``alive`` judged by the store clock, ordered by id."""

    def set_drain(self, worker_id: str, draining: bool, who: str) -> None:
        """Ask ``worker_id`` to drain (persistent across its restarts), or undo it.

        The worker sees the flag in the answer to its next heartbeat (or register).
        """
        raise NotImplementedError


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
    claims hold ``key`` while ``running``, across every worker of the store."""

    key: str
    limit: int


@dataclasses.dataclass(frozen=True, slots=True)
class PermitUsage:
    """A concurrency limit as the store sees it now."""

    key: str
    limit: int
    #: Running claims holding the permit.
    running: int
    #: Reserved claims whose start was refused for want of it (they wait in a worker).
    waiting: int


class PermitSignals(Protocol):
    """Announcements that permits of some keys were given back (a hint, never a grant)."""

    def send(self, keys: Sequence[str]) -> None: ...

    def receive(self, timeout: float) -> set[str]:
        """Keys announced since the last call, waiting up to ``timeout`` for one."""


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


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimInfo:
    """A claim as the store sees it now (store clock)."""

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


class InFlightIO(Protocol):
    """The socket side of an exchange in flight (see :class:`PendingExchange`)."""

    #: The connection's socket: step when it is readable.
    fileno: int
    #: Some of the request is not sent yet: :meth:`send_more` soon, readable or not.
    writing: bool
    done: bool

    def step(self) -> bool:
        """Send what is left and read what came, never blocking; True once all is in."""
        ...

    def send_more(self) -> bool:
        """Send what is left of the request, never blocking, reading nothing; True while
        some of it is still unsent."""
        ...

    def wait(self, timeout: float | None) -> None:
        """Block until all is in (the store's error after ``timeout`` seconds)."""
        ...

    def abandon(self) -> None:
        """Give up on the answer (its effect unknown): the connection is dropped."""
        ...


class PendingExchange(Protocol):
    """An exchange sent by :meth:`ClaimStore.begin_exchange`, its answer not read yet.

    If :attr:`flight` (or :meth:`finish`) raises the store's error, none of the
    operations is known to have taken effect, as when :meth:`ClaimStore.exchange` raises.
    """

    @property
    def flight(self) -> InFlightIO:
        """The exchange's socket side."""
        ...

    def finish(self, *, blocking: bool) -> Exchanged | None:
        """The answers, once :attr:`flight` is done. Answering some of them may need a
        read of its own (rare: a stale completion, a refused reservation): with
        ``blocking`` False that is left undone and None returned, to be called again
        where blocking is allowed."""
        ...


class ClaimStore(abc.ABC):
    """What per-task leases need from persistent storage."""

    #: :meth:`begin_exchange` sends exchanges without blocking: the worker then runs its
    #: hot path on its event loop (:mod:`celery_pulse.loop_commit`).
    nonblocking_exchange: bool = False

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest],
                 starts: Sequence[tuple[str, int, str]],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged:
        """A worker's hot path in one call: completions, then reservations, then starts.

        The same answers as :meth:`complete`, :meth:`reserve` and :meth:`start_many`
        called in that order (a retry's completion re-opens the claim before its next
        delivery is reserved; a completion frees its permits before the starts take
        theirs). A store may send them in one round trip and one transaction; if it
        raises, none of them is known to have taken effect (a completion sent again is
        answered ``duplicate``).
        """
        counted: dict[str, tuple[int, str]] = {}
        waiting: set[str] = set()
        return Exchanged(self.complete(holder, completions, counted) if completions else {},
                         self.reserve(holder, reserves, ttl) if reserves else [],
                         self.start_many(holder, starts, ttl, permits, waiting) if starts
                         else {}, counted, frozenset(waiting))

    def begin_exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                       reserves: Sequence[ReserveRequest],
                       starts: Sequence[tuple[str, int, str]],
                       permits: Mapping[str, Sequence[Permit]] | None = None
                       ) -> PendingExchange | None:
        """:meth:`exchange` without waiting for its answer, for a caller on an event loop
        (it registers the exchange's socket and reads the answer when it arrives).

        None (the default): this store, or this batch, only has the blocking
        :meth:`exchange`, or sending it now could block (a connection to open, or in use
        by another thread). Never blocks.
        """
        return None

    def max_message_bytes(self) -> int | None:
        """The largest message body one claim row takes (None: no limit worth checking).

        The intake rejects a bigger delivery before it reaches the store: sent, it would
        fail the whole batch it travels in, as a driver error, again at every retry.
        """
        return None

    @abc.abstractmethod
    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]:
        """Reserve each task for ``holder`` until ``store_now + ttl``; one result per request.

        A request is granted (epoch + 1, attempts + 1, new token, the message stored)
        when there is no claim, the claim is ``open``, or it is ``reserved`` and
        expired; a ``running`` claim only when its policy is ``redispatch`` and it is
        expired. A live lease is never granted again, not even to its own holder.

        A request of a *new publication* (``publication`` set and not the claim's)
        counts its attempts from 1 and is also granted over a finished claim
        (:data:`RESTARTABLE_STATES`): a task id published again runs again, once the
        previous run has ended. Otherwise it is refused: ``terminal`` for finished or
        needs-review claims, ``exhausted`` when ``attempts >= max_attempts`` (the claim
        becomes ``failed``), ``taken`` else.

        A request with ``start`` is granted as ``running`` (``started_at`` set), as if
        :meth:`start_many` had followed in the same statement.
        """

    @abc.abstractmethod
    def start_many(self, holder: str, leases: Sequence[tuple[str, int, str]], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]:
        """Move live reservations to ``running`` in one statement (group commit).

        Returns ``task_id -> new lease_until`` for those that moved. One moves only if
        (epoch, token) are current, the state is ``reserved`` and the lease has not
        expired by the store clock; the others are refused (absent from the result).

        A lease with ``permits[task_id]`` also needs each of them: it moves only if,
        for every permit, fewer than ``limit`` claims hold its key ``running``, judged
        under a lock on the key, so that concurrent starts on any number of workers
        never exceed a limit (starts of one call are granted in the order given). One
        that finds no room stays ``reserved``, its lease unchanged, and its task id goes
        into ``waiting``. A claim holds its permits exactly as long as it is ``running``
        under the epoch that took them: the statement that ends that (a completion, a
        release, a requeue, Recover's takeover, a new reservation) gives them back, and
        nothing else can, so a permit is never given back twice.
        """

    def permit_usage(self) -> list[PermitUsage]:
        """Every concurrency limit the store has seen a start ask for, ordered by key."""
        return []

    def permit_signals(self) -> AbstractContextManager[PermitSignals] | None:
        """A channel on which workers tell each other that permits were given back
        (None: the store has none; waiting tasks then only poll)."""
        return None

    def start(self, holder: str, task_id: str, epoch: int, token: str, ttl: float) -> float | None:
        """:meth:`start_many` for one lease: the new lease_until, or None if refused."""
        return self.start_many(holder, [(task_id, epoch, token)], ttl).get(task_id)

    @abc.abstractmethod
    def renew(self, holder: str, leases: Sequence[tuple[str, int, str]], ttl: float
              ) -> tuple[set[str], set[str]]:
        """Extend every live lease of ``holder`` in one statement (token and epoch checked).

        Returns ``(renewed, busy)``: ``busy`` holds leases that are still valid but
        were not extended because a fenced transaction holds the row; every other
        lease passed in is lost.
        """

    def lease_of(self, holder: str, task_id: str, epoch: int, token: str
                 ) -> tuple[str, float] | None:
        """``(state, lease_until)`` if ``(task_id, epoch, token)`` is ``holder``'s live lease
        by the store clock now (nothing extended), else None."""
        raise NotImplementedError

    @abc.abstractmethod
    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        """Record outcomes; returns ``task_id -> applied|duplicate|evidence``.

        ``applied``: (epoch, token) still held, the claim took the outcome.
        ``duplicate``: the same outcome for the same epoch was already recorded.
        ``evidence``: stale; kept in the evidence table, never authoritative.

        An applied completion's result (:attr:`Completion.result`) is written, and its
        counter counted, in the same transaction; ``counted`` receives the counts
        (:attr:`Exchanged.counted`). Stores without a result table ignore both.
        """

    @abc.abstractmethod
    def release(self, holder: str, leases: Sequence[tuple[str, int, str]], *,
                never_ran: bool = False) -> int:
        """Expire ``holder``'s reservations now (never started), for immediate recovery.

        Running claims are left alone, unless ``never_ran``: the worker knows their job
        never reached a pool process (it stopped between the start and the hand-over),
        so they go back to ``reserved`` too.
        """

    @abc.abstractmethod
    def purge_finished(self, older_than: float, limit: int = 500) -> int:
        """Delete up to ``limit`` finished claims older than ``older_than`` seconds (and
        as many results of the ``pulse://`` backend past their ``result_expires``)."""

    @abc.abstractmethod
    def list_claims(self, states: Sequence[str] | None = None, limit: int = 1000
                    ) -> list[ClaimInfo]:
        """Claims (optionally of some states), newest first."""

    @abc.abstractmethod
    def claim_counts(self) -> dict[str, int]:
        """Number of claims per state, plus ``expired`` (live states past their lease)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Recovered:
    """A claim Recover (or a reviewer) took over.

    ``state`` is ``open`` (re-publish ``message``, then :meth:`RecoverStore.mark_published`
    with ``epoch``/``token``), ``needs_review`` or ``failed`` (budget spent).
    """

    task_id: str
    task_name: str
    state: str
    was: str
    epoch: int
    token: str | None
    attempts: int
    message: Message

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


class RecoverStore(abc.ABC):
    """What Recover and the review workflow need."""

    @abc.abstractmethod
    def recover(self, scanner: str, batch: int, publish_ttl: float) -> list[Recovered]:
        """Take over up to ``batch`` claims whose lease expired by the store clock.

        Each is moved under a new epoch, atomically, never by two scanners:
        a never-started reservation, or a started claim whose policy is
        ``redispatch``, becomes ``open`` under the scanner's short publish lease
        (``publish_ttl``) — or ``failed`` when its attempt budget is spent; a started
        claim with policy ``review`` becomes ``needs_review``. An ``open`` claim whose
        publish lease expired (the scanner died before publishing) is taken again.
        """

    @abc.abstractmethod
    def requeue(self, holder: str, leases: Sequence[tuple[str, int, str]], publish_ttl: float
                ) -> list[Recovered]:
        """Give ``holder``'s live claims back for another delivery (Celery's requeue).

        Each moves to ``open`` under a new epoch with ``holder``'s short publish lease,
        exactly as Recover takes an expired claim, so a publisher that dies before
        :meth:`RecoverStore.mark_published` leaves it to the next Recover scan. Leases
        no longer held are left alone (absent from the result).
        """

    @abc.abstractmethod
    def mark_published(self, items: Sequence[tuple[str, int, str]]) -> int:
        """The message of each ``(task_id, epoch, token)`` is back in the broker."""

    @abc.abstractmethod
    def list_review(self, limit: int = 1000) -> list[ReviewItem]:
        """Tasks waiting for a human decision, oldest first."""

    @abc.abstractmethod
    def review_retry(self, task_id: str, scanner: str, publish_ttl: float, who: str,
                     note: str | None) -> Recovered:
        """Re-open a needs-review (or failed) task for one more attempt; the caller publishes."""

    @abc.abstractmethod
    def review_resolve(self, task_id: str, outcome: str, who: str, note: str | None) -> None:
        """Close a needs-review task as ``succeeded`` or ``failed`` (recorded for audit)."""


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


class LeaderStore(abc.ABC):
    """Leader election (seed 001 ``LeaseStore``)."""

    @abc.abstractmethod
    def try_acquire(self, key: str, holder: str, ttl: float, token: str | None = None
                    ) -> LeaderGrant | None:
        """One atomic conditional upsert judged by the store clock.

        Succeeds when the key is free, its lease expired, or ``token`` is the current
        token (a renewal: same token and epoch, lease extended). A new term gets a new
        token and ``epoch + 1``. Returns None when someone else holds a live lease.
        """

    @abc.abstractmethod
    def release_leader(self, key: str, token: str) -> bool:
        """End the lease now, only if ``token`` is current."""

    @abc.abstractmethod
    def get_leader(self, key: str) -> LeaderInfo | None: ...


class BeatStore(abc.ABC):
    """Exactly-once periodic slots and the dynamic schedule."""

    @abc.abstractmethod
    def last_run(self) -> dict[str, float]:
        """``last_run_at`` (the due time of the latest slot) per entry."""

    @abc.abstractmethod
    def init_last_run(self, entry: str, at: float) -> float:
        """Set ``last_run_at`` if the entry has none; returns the stored value."""

    @abc.abstractmethod
    def fire_slot(self, key: str, token: str, epoch: int, slot: Slot) -> bool:
        """Insert the slot and advance ``last_run_at``, only while ``(token, epoch)``
        is the live leader term by the store clock. False if the slot existed already
        or the term is over."""

    @abc.abstractmethod
    def mark_slot_published(self, entry: str, due_at: float) -> None: ...

    @abc.abstractmethod
    def unpublished_slots(self, limit: int = 100) -> list[Slot]: ...

    @abc.abstractmethod
    def list_schedule(self) -> list[ScheduleRow]: ...

    @abc.abstractmethod
    def put_schedule(self, row: ScheduleRow) -> None: ...

    @abc.abstractmethod
    def remove_schedule(self, name: str) -> bool: ...

    @abc.abstractmethod
    def set_schedule_enabled(self, name: str, enabled: bool) -> bool: ...


class Store(RegistryStore, ClaimStore, RecoverStore, LeaderStore, BeatStore):
    """The whole contract (the SQL store implements it)."""
