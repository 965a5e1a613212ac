"""The SQL implementation of the store contract (see :mod:`celery_pulse.store.base`),
assembled from its parts.

:class:`SqlStore` is one class on every database: the control plane, written once in
SQLAlchemy Core, comes from one module per contract part (:mod:`.registry`,
:mod:`.claims_admin`, :mod:`.monitor`, :mod:`.recover`, :mod:`.reviews`, :mod:`.leader`, :mod:`.beat`,
:mod:`.retention`), each asking the :class:`~.dialect.Dialect` what the database can do;
the per-task hot path is the dialect's claim engine (:mod:`.claim_engine`), which the
factory (:mod:`.factory`) picks. Every grant is one atomic statement, or on MySQL one
transaction under row locks, whose ``WHERE`` carries both the credential check (token,
epoch) and the expiry check by the store clock.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import sqlalchemy as sa

from celery_pulse.errors import SchemaMissing
from celery_pulse.store.base import (
    Completion,
    Exchanged,
    Grant,
    LeaseKey,
    PendingExchange,
    Permit,
    Refusal,
    ReserveRequest,
    Store,
)
from celery_pulse.store.sql import migrate
from celery_pulse.store.sql.beat import SqlBeat
from celery_pulse.store.sql.checkpoints import SqlCheckpoints
from celery_pulse.store.sql.claim_engine import ClaimEngine
from celery_pulse.store.sql.claims_admin import SqlClaimsAdmin
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.leader import SqlLeader
from celery_pulse.store.sql.monitor import SqlViews
from celery_pulse.store.sql.recover import SqlRecover
from celery_pulse.store.sql.registry import SqlRegistry
from celery_pulse.store.sql.results import ResultRows
from celery_pulse.store.sql.retention import SqlRetention
from celery_pulse.store.sql.reviews import SqlReviews
from celery_pulse.store_urls import mask_url

if TYPE_CHECKING:
    from celery_pulse.store.sql.credentials import SqlCredentials
    from celery_pulse.store.sql.gateway_state import SqlGatewayState
    from celery_pulse.store.sql.pipeline import Pipeline


class SqlStore(SqlRegistry, SqlClaimsAdmin, SqlViews, SqlRecover, SqlReviews, SqlLeader,
               SqlBeat, SqlRetention, SqlCheckpoints, Store):
    """A :class:`Store` on a SQLAlchemy engine (PostgreSQL, MySQL/MariaDB or SQLite),
    its hot path run by ``claims`` (see :func:`~.factory.store_on`)."""

    def __init__(self, conns: Connections, results: ResultRows, claims: ClaimEngine) -> None:
        self.conns = conns
        self.engine = conns.engine
        self.dialect = conns.dialect
        self.results = results
        self.claims = claims
        self.nonblocking_exchange = claims.nonblocking_exchange
        self.folds_permits = claims.folds_permits
        self.exchange_in_process = claims.exchange_in_process

    @property
    def _pipeline(self) -> Pipeline | None:
        """PostgreSQL's pipelined connection (tests reach it to warm it up or cut it)."""
        return self.claims.pipeline

    @functools.cached_property
    def credentials(self) -> SqlCredentials:
        """The lease gateway's credentials (``pulse_credentials``)."""
        # Imported here: a store that never serves a gateway never loads its credentials.
        from celery_pulse.store.sql.credentials import SqlCredentials

        return SqlCredentials(self.engine)

    @functools.cached_property
    def gateway_state(self) -> SqlGatewayState:
        """The lease gateway's sessions and attempts (any gateway process reads them)."""
        from celery_pulse.store.sql.gateway_state import SqlGatewayState

        return SqlGatewayState(self.engine)

    def hot_path_counts(self) -> Mapping[str, int]:
        return dict(self.claims.counts)

    @property
    def url(self) -> str:
        return mask_url(self.engine.url.render_as_string(hide_password=False))

    def close(self) -> None:
        self.claims.close()
        self.engine.dispose()

    # -- housekeeping ---------------------------------------------------------------------
    def now(self) -> float:
        with translated("now"), self.conns.read() as conn:
            return float(conn.execute(sa.select(self.conns.now)).scalar_one())

    def check_schema(self) -> None:
        """Run on our own revision, or a newer one that declares this code compatible."""
        with translated("schema check"):
            current = migrate.current_revision(self.engine)
            head = migrate.head_revision()
            if current == head:
                return
            if current is None or not migrate.is_newer(current, head):
                state = "missing" if current is None else (
                    f"at revision {current}, older than this celery-pulse (revision {head})")
                raise SchemaMissing(f"the pulse schema in {self.url} is {state}: "
                                    f"run `celery -A <app> pulse migrate`")
            oldest = migrate.oldest_code(self.engine, current)
            if oldest is None or migrate.is_newer(oldest, head):
                raise migrate.too_new(self.url, current, head, oldest)

    def migrate(self) -> tuple[str | None, str]:
        with translated("migrate"):
            return migrate.upgrade(self.engine, self.url)

    # -- the hot path: the dialect's claim engine -----------------------------------------
    def max_message_bytes(self) -> int | None:
        return self.claims.max_message_bytes()

    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]:
        return self.claims.reserve(holder, requests, ttl)

    def start_many(self, holder: str, leases: Sequence[LeaseKey], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]:
        return self.claims.start_many(holder, leases, ttl, permits, waiting)

    def renew(self, holder: str, leases: Sequence[LeaseKey], ttl: float
              ) -> tuple[set[str], set[str]]:
        return self.claims.renew(holder, leases, ttl)

    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        return self.claims.complete(holder, completions, counted)

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged:
        """In one round trip where the engine has one (PostgreSQL's pipeline); else the
        three verbs in order, as the contract says."""
        done = self.claims.exchange(holder, ttl, completions, reserves, starts, permits)
        if done is None:
            return super().exchange(holder, ttl, completions, reserves, starts, permits)
        return done

    def begin_exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                       reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                       permits: Mapping[str, Sequence[Permit]] | None = None
                       ) -> PendingExchange | None:
        return self.claims.begin_exchange(holder, ttl, completions, reserves, starts, permits)
