"""The verbs of a claim engine: the per-task hot path of one dialect.

The SQL store is one class (:class:`~.store.SqlStore`); what differs between databases on
the hot path is an engine the factory picks for the dialect, Oban-style siblings that
share helpers (:mod:`.claim_rows`), never each other's insides:

* :class:`~.claims.BatchClaims`: one multi-row statement per batch.
* :class:`~.sqlite.SqliteClaims` (SQLite): the same statements, a worker's whole
  exchange in one transaction.
* :class:`~.postgres.PostgresClaims` (PostgreSQL): the same statements, in autocommit,
  plus the exchange on libpq's pipeline.
* :class:`~.mysql.MySqlClaims` (MySQL/MariaDB): one transaction per batch that decides
  under row locks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from celery_pulse.store.base import (
    Completion,
    Exchanged,
    Grant,
    LeaseKey,
    PendingExchange,
    Permit,
    Refusal,
    ReserveRequest,
)

if TYPE_CHECKING:  # psycopg is an extra: only PostgreSQL's engine imports the pipeline
    from celery_pulse.store.sql.pipeline import Pipeline


class ClaimEngine(Protocol):
    """The hot-path verbs of :class:`~celery_pulse.store.base.ClaimStore`, as one dialect
    runs them (their contracts are the store's)."""

    #: See :attr:`ClaimStore.nonblocking_exchange`.
    nonblocking_exchange: bool
    #: See :attr:`ClaimStore.folds_permits`.
    folds_permits: bool
    #: See :attr:`ClaimStore.exchange_in_process`.
    exchange_in_process: bool
    #: PostgreSQL's pipelined connection (None elsewhere).
    pipeline: Pipeline | None
    #: What the hot path sent, by name (:meth:`ClaimStore.hot_path_counts`).
    counts: Mapping[str, int]

    def max_message_bytes(self) -> int | None: ...

    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]: ...

    def start_many(self, holder: str, leases: Sequence[LeaseKey], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]: ...

    def renew(self, holder: str, leases: Sequence[LeaseKey], ttl: float
              ) -> tuple[set[str], set[str]]: ...

    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]: ...

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged | None:
        """The exchange in one round trip; None where the engine has none for this batch
        (the store then runs complete, reserve and start_many in that order)."""
        ...

    def begin_exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                       reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                       permits: Mapping[str, Sequence[Permit]] | None = None
                       ) -> PendingExchange | None: ...

    def close(self) -> None: ...
