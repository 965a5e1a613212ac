"""The store contracts: every rule the mechanism relies on, independent of SQL.

The values they take and answer are in :mod:`celery_pulse.store.records`; the SQL store
(:mod:`celery_pulse.store.sql`) and the memory store (:mod:`celery_pulse.store.memory`)
implement them, and one contract suite (``tests/contract``) runs on both.

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
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from celery_pulse.store.channels import PendingExchange, PermitSignals
from celery_pulse.store.checkpoints import CheckpointStore
from celery_pulse.store.leader_contracts import BeatStore, LeaderStore
from celery_pulse.store.pages import ClaimDetail, ClaimPage, ClaimQuery
from celery_pulse.store.records import (
    ClaimInfo,
    Completion,
    Exchanged,
    Grant,
    Heartbeat,
    Permit,
    PermitUsage,
    Recovered,
    Refusal,
    Registration,
    ReserveRequest,
    ReviewItem,
    Waiting,
    WorkerInfo,
)


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


class ClaimStore(abc.ABC):
    """What per-task leases need from persistent storage."""

    #: :meth:`begin_exchange` sends exchanges without blocking (or makes them at once,
    #: without waiting for a lock): the worker then runs its hot path on its event loop
    #: (:mod:`celery_pulse.loop_commit`).
    nonblocking_exchange: bool = False
    #: The exchange is the worker process's own work (SQLite), not a round trip: fewer,
    #: larger exchanges save the worker's event loop time, so a reservation nothing
    #: waits for lingers for company (:meth:`celery_pulse.worker.ahead.StartAhead.lingers`).
    exchange_in_process: bool = False
    #: :meth:`reserve` asks nothing of a server (a gateway worker's: its gateway reserved
    #: the delivery before sending it): a reservation is answered where it is submitted,
    #: never queued behind an exchange in flight.
    local_reservations: bool = False
    #: :meth:`exchange` takes the permits of a reservation asked to ``start``
    #: (:attr:`ReserveRequest.permits`) in the reservation's own transaction: a limited
    #: task then starts as a plain one does, with no start of its own.
    folds_permits: bool = False

    def hot_path_counts(self) -> Mapping[str, int]:
        """What the hot path sent the store, by name, for the worker's stats: where one
        round trip carries several statements, how many of each (empty: nothing to say)."""
        return {}

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
        waiting = Waiting()
        return Exchanged(self.complete(holder, completions, counted) if completions else {},
                         self.reserve(holder, reserves, ttl) if reserves else [],
                         self.start_many(holder, starts, ttl, permits, waiting) if starts
                         else {}, counted, frozenset(waiting), dict(waiting.retry_in))

    def begin_exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                       reserves: Sequence[ReserveRequest],
                       starts: Sequence[tuple[str, int, str]],
                       permits: Mapping[str, Sequence[Permit]] | None = None
                       ) -> PendingExchange | None:
        """:meth:`exchange` without waiting for its answer, for a caller on an event loop
        (it registers the exchange's socket and reads the answer when it arrives).

        None (the default): this store, or this batch, only has the blocking
        :meth:`exchange`, or sending it now could block (a connection to open, or in use
        by another thread). Never blocks; a store whose exchange is its own process's
        work (SQLite) makes it here, and answers None rather than wait for a lock.
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
        """Every concurrency limit the store has seen a start ask for, ordered by key, with
        ``oldest_waiting_since`` the reservation time of its oldest live waiter."""
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
        ``evidence``: stale; kept in the evidence table (with its error and
        :attr:`Completion.returned`), never authoritative. A completion under
        :data:`~celery_pulse.store.records.LOST_TOKEN` is always stale: its holder knows
        its lease was lost, and sends the late outcome to be kept.

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
    def purge_finished(self, older_than: float, limit: int = 500,
                       budget: float | None = None) -> int:
        """Retention's pass (:mod:`celery_pulse.store.retention`): delete finished claims
        (never ``needs_review``) and evidence older than ``older_than`` seconds, past
        permit holds and results past their ``result_expires``, in batches of at most
        ``limit`` of each, repeated while one came back full and ``budget`` seconds (None:
        unbounded; 0: one batch) are left. The finished claims deleted."""

    def retention_lag(self, older_than: float) -> float:
        """How long the oldest finished claim retention purges has been older than
        ``older_than`` seconds, by the store clock (0.0: none is)."""
        raise NotImplementedError

    @abc.abstractmethod
    def list_claims(self, states: Sequence[str] | None = None, limit: int = 1000
                    ) -> list[ClaimInfo]:
        """Claims (optionally of some states), newest first."""

    @abc.abstractmethod
    def claim_counts(self) -> dict[str, int]:
        """Number of claims per state, plus ``expired`` (live states past their lease)."""

    def find_claims(self, query: ClaimQuery) -> ClaimPage:
        """One page of the claims ``query`` matches, newest first (``created_at`` desc,
        ``task_id`` desc), with the total over every page and the store clock.

        Keyset pagination: ``next`` is the cursor after the page's last row (None once no
        row follows), so following it visits every matching row once, whatever was
        inserted meanwhile. An unknown state, a limit outside 1..500 or a cursor the store
        did not write raise :class:`InvalidConfig` naming the valid values.
        """
        raise NotImplementedError

    def claim_detail(self, task_id: str) -> ClaimDetail | None:
        """One claim with its evidence rows and review decisions (None: no such claim)."""
        raise NotImplementedError

    def oldest_review_since(self) -> float | None:
        """When the claim longest in ``needs_review`` entered it (None: none has a time)."""
        raise NotImplementedError


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
    def list_review(self, limit: int = 1000, query: ClaimQuery | None = None
                    ) -> list[ReviewItem]:
        """Tasks waiting for a human decision, oldest first, each with its ``reason`` and
        ``entered_at`` (a claim's ``finished_at`` is when it entered review: Recover's move
        and a completion set it, and retention never purges ``needs_review``).

        ``query`` filters by queue, task name and holder, and by state among
        ``needs_review`` (the default) and ``failed``; its limit and cursor are unused.
        """

    @abc.abstractmethod
    def review_retry(self, task_id: str, scanner: str, publish_ttl: float, who: str,
                     note: str | None, expected_epoch: int | None = None) -> Recovered:
        """Re-open a needs-review (or failed) task for one more attempt; the caller publishes.

        A claim that moved on (in no such state, or at another epoch than
        ``expected_epoch``) raises :class:`~celery_pulse.errors.Moved` saying what it is
        now, and nothing changes; no claim at all, :class:`NotFound`.
        """

    @abc.abstractmethod
    def review_resolve(self, task_id: str, outcome: str, who: str, note: str | None,
                       expected_epoch: int | None = None) -> None:
        """Close a needs-review task as ``succeeded`` or ``failed`` (recorded for audit);
        :class:`~celery_pulse.errors.Moved` as :meth:`review_retry`."""


class Store(RegistryStore, ClaimStore, RecoverStore, LeaderStore, BeatStore, CheckpointStore):
    """The whole contract (the SQL store implements it)."""
