"""The claim hot path in one statement per batch (PostgreSQL and SQLite build on it).

Every grant is one atomic statement whose ``WHERE`` clause carries both the credential
check (token, epoch) and the expiry check by the store clock (:mod:`.batch_sql`). A task
id twice in one batch is decided in rounds: the later copy against the claim as the
earlier one left it (a duplicate is refused, a new publication waits).
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from celery_pulse.errors import Contended
from celery_pulse.store.base import (
    LIVE_STATES,
    TERMINAL_STATES,
    Completion,
    Exchanged,
    Grant,
    LeaseKey,
    PendingExchange,
    Permit,
    Refusal,
    ReserveRequest,
)
from celery_pulse.store.rules import new_publication, rounds, split_starts
from celery_pulse.store.sql import permits as permits_sql
from celery_pulse.store.sql.batch_sql import BatchSql, Statement
from celery_pulse.store.sql.claim_rows import (
    CHUNK,
    best,
    claimable,
    exhaust,
    grants,
    lease_key_in,
    stale_answers,
    started_leases,
)
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.results import ResultRows
from celery_pulse.store.sql.tables import claims

if TYPE_CHECKING:
    from celery_pulse.store.sql.pipeline import Pipeline

T = TypeVar("T")

#: The largest message body a claim row takes on PostgreSQL and SQLite (bytes).
MAX_FIELD_BYTES = 1_000_000_000 - (1 << 20)


class BatchClaims:
    """The hot path of a database with ``ON CONFLICT .. WHERE`` and ``UPDATE .. RETURNING``."""

    nonblocking_exchange = False
    folds_permits = False
    exchange_in_process = False
    #: The results of the ``pulse://`` backend are written by the completion's own
    #: statement (PostgreSQL), not beside it in its transaction.
    results_in_statement = False
    counts: Mapping[str, int] = MappingProxyType({})

    def __init__(self, conns: Connections, results: ResultRows) -> None:
        self.conns = conns
        self.dialect = conns.dialect
        self.results = results
        self.sql = BatchSql(conns.dialect)
        self.pipeline: Pipeline | None = None

    def close(self) -> None:
        """Nothing of its own to close (the store disposes of the engine)."""

    def max_message_bytes(self) -> int | None:
        """PostgreSQL keeps at most 1 GB in a bytea value, SQLite in a blob
        (``SQLITE_MAX_LENGTH``); a little is left for the row's other columns."""
        return MAX_FIELD_BYTES

    # -- reservations ---------------------------------------------------------------------
    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]:
        if not requests:
            return []
        with translated("reserve"), self.conns.single() as conn:
            return self.reserve_in(conn, holder, requests, ttl)

    def reserve_in(self, conn: sa.Connection, holder: str, requests: Sequence[ReserveRequest],
                   ttl: float) -> list[Grant | Refusal]:
        """:meth:`reserve` on ``conn``, in rounds of distinct task ids."""
        out: list[Grant | Refusal | None] = [None] * len(requests)
        for batch in rounds(list(enumerate(requests)), lambda item: item[1].task_id):
            answers = self._round_again_if_contended(functools.partial(
                self._reserve_round, conn, holder, [r for _, r in batch], ttl))
            for (i, _), answer in zip(batch, answers, strict=True):
                out[i] = answer
        return [answer for answer in out if answer is not None]

    def rows(self, conn: sa.Connection, statement: Statement) -> Any:
        """Run one of :mod:`.batch_sql`'s statements on ``conn``; its rows (tuples)."""
        return conn.exec_driver_sql(*statement)

    def _round_again_if_contended(self, run: Callable[[], T]) -> T:
        """Run one round again after a deadlock (PostgreSQL: each round is one autocommit
        statement, so a failed one left nothing behind; earlier rounds stay committed)."""
        attempts = self.dialect.round_attempts
        for attempt in range(attempts):
            try:
                with translated("reserve"):
                    return run()
            except Contended:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.005 * (attempt + 1) * (0.5 + random.random()))
        raise AssertionError("unreachable")  # pragma: no cover

    def _reserve_round(self, conn: sa.Connection, holder: str, requests: list[ReserveRequest],
                       ttl: float) -> list[Grant | Refusal]:
        """One statement for requests of distinct task ids."""
        rows = self.rows(conn, self.sql.reserve_statement(holder, requests, ttl))
        return self.reserve_answers(conn, requests, rows)

    def reserve_answers(self, conn: sa.Connection | None, requests: Sequence[ReserveRequest],
                        rows: Any) -> list[Grant | Refusal]:
        """Grants from the statement's rows; the others are refused, and asked why on
        ``conn`` (None: a new one)."""
        results: dict[str, Grant | Refusal] = dict(grants(rows))
        missing = [r for r in requests if r.task_id not in results]
        if missing:
            if conn is None:
                with translated("reserve"), self.conns.single() as own:
                    results.update(self._refusals(own, missing))
            else:
                results.update(self._refusals(conn, missing))
        return [results[r.task_id] for r in requests]

    def _refusals(self, conn: sa.Connection, requests: list[ReserveRequest]
                  ) -> dict[str, Refusal]:
        now = self.conns.now
        by_id = {r.task_id: r for r in requests}
        rows = conn.execute(
            sa.select(claims.c.task_id, claims.c.state, claims.c.holder, claims.c.epoch,
                      claims.c.attempts, claims.c.max_attempts, claims.c.retries,
                      claims.c.policy, claims.c.publication,
                      (claims.c.lease_until <= now).label("expired"))
            .where(claims.c.task_id.in_(list(by_id)))).all()
        out: dict[str, Refusal] = {}
        for r in rows:
            new_pub = new_publication(by_id[r.task_id].publication, r.publication)
            if r.state in TERMINAL_STATES:
                reason = "terminal"
            elif claimable(r) and r.attempts >= r.max_attempts and not new_pub:
                reason = "exhausted"
                exhaust(conn, now, r, r.state)
            else:
                reason = "taken"
            out[r.task_id] = Refusal(r.task_id, reason, r.state, r.holder, int(r.epoch),
                                     int(r.retries), r.publication)
        return out

    # -- starts ---------------------------------------------------------------------------
    def start_many(self, holder: str, leases: Sequence[LeaseKey], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]:
        # Plain SQL, built once per batch size: run by the worker's committer for every
        # task, right before the pool gets the job.
        limited, unique = split_starts(permits, leases)
        started = permits_sql.start_limited(self.conns, holder, limited, ttl, permits or {},
                                            waiting, self.limited_chunks())
        for i in range(0, len(unique), CHUNK):
            with translated("start"), self.conns.single() as conn:
                started.update(self.start_in(conn, holder, unique[i:i + CHUNK], ttl))
        return started

    def limited_chunks(self) -> permits_sql.ChunkStarter | None:
        """How a chunk of starts under permits is taken (None: in a transaction of the
        general kind, :func:`.permits.start`)."""
        return None

    def start_in(self, conn: sa.Connection, holder: str, leases: Sequence[LeaseKey],
                 ttl: float) -> dict[str, float]:
        """Starts under no concurrency limit, on ``conn``: ``task_id -> lease_until``."""
        started: dict[str, float] = {}
        for i in range(0, len(leases), CHUNK):
            chunk: list[Any] = list(leases[i:i + CHUNK])
            started.update(started_leases(
                self.rows(conn, self.sql.start_statement(holder, chunk, ttl))))
        return started

    # -- renewals -------------------------------------------------------------------------
    def renew(self, holder: str, leases: Sequence[LeaseKey], ttl: float
              ) -> tuple[set[str], set[str]]:
        renewed: set[str] = set()
        busy: set[str] = set()
        now = self.conns.now
        skips = self.dialect.renew_skips_locked
        for i in range(0, len(leases), CHUNK):
            chunk = leases[i:i + CHUNK]
            held = sa.and_(claims.c.holder == holder, lease_key_in(chunk),
                           claims.c.state.in_(LIVE_STATES), claims.c.lease_until > now)
            if skips:
                # Skip rows a fenced transaction holds: waiting would stall every lease.
                ids = sa.select(claims.c.task_id).where(held).with_for_update(skip_locked=True)
                where: Any = claims.c.task_id.in_(ids.scalar_subquery())
            else:
                where = held
            stmt = (sa.update(claims).where(where).values(lease_until=now + ttl)
                    .returning(claims.c.task_id))
            with translated("renew"), self.conns.single() as conn:
                got = set(conn.execute(stmt).scalars())
                missing = [lease for lease in chunk if lease[0] not in got]
                if missing and skips:
                    busy.update(conn.execute(sa.select(claims.c.task_id).where(
                        claims.c.holder == holder, lease_key_in(missing),
                        claims.c.state.in_(LIVE_STATES), claims.c.lease_until > now)).scalars())
            renewed |= got
        return renewed, busy

    # -- completions ----------------------------------------------------------------------
    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        """See the contract. Two completions of one task id in one call (a stale attempt's
        and the current one's) are applied in order, each to the claim as the earlier left
        it; the answer for that id is the best of theirs (applied, duplicate, evidence)."""
        # A counter is a second statement that must commit with the completion: on
        # PostgreSQL that takes a transaction instead of autocommit.
        counting = any(c.result is not None and c.result.counter is not None
                       for c in completions)
        session = self.conns.engine.begin() if counting else self.conns.single()
        with translated("complete"), session as conn:
            return self.complete_in(conn, holder, completions, counted)

    def complete_in(self, conn: sa.Connection, holder: str, completions: Sequence[Completion],
                    counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        """:meth:`complete` on ``conn`` (a transaction, if a completion adds to a counter)."""
        out: dict[str, str] = {}
        for batch in rounds(list(completions), lambda c: c.task_id):
            for i in range(0, len(batch), CHUNK):
                chunk = batch[i:i + CHUNK]
                applied = {row[0] for row in self.rows(conn, self.complete_statement(chunk))}
                mine = [(c.task_id, c.result) for c in chunk
                        if c.result is not None and c.task_id in applied]
                if not self.results_in_statement and mine:
                    self.results.write_fenced(conn, [r for _, r in mine])
                if any(r.counter is not None for _, r in mine):
                    counts = self.results.count_parts(conn, mine)
                    if counted is not None:
                        counted.update(counts)
                answers = dict.fromkeys(applied, "applied")
                stale = [c for c in chunk if c.task_id not in applied]
                if stale:
                    answers.update(stale_answers(conn, holder, stale, self.conns.now))
                best(out, answers)
        return out

    def complete_statement(self, chunk: Sequence[Completion]) -> Statement:
        """The completions' statement (results are written beside it, in its transaction)."""
        return self.sql.complete_sql(len(chunk)), tuple(self.sql.complete_params(chunk))

    # -- exchanges ------------------------------------------------------------------------
    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged | None:
        """None: no single round trip here (the store calls the three verbs in order)."""
        return None

    def begin_exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                       reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                       permits: Mapping[str, Sequence[Permit]] | None = None
                       ) -> PendingExchange | None:
        return None
