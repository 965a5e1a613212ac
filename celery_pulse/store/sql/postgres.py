"""PostgreSQL's claim hot path: the batch statements (:mod:`.batch_sql`), in autocommit,
with the exchange on libpq's pipeline (:mod:`.pipeline`).

An exchange (completions, then reservations, then starts of one group commit) goes out
as three statements in one round trip and one implicit transaction; the completions'
statement also writes their results (the ``pulse://`` backend's), for the claims it
applied only. :meth:`PostgresClaims.begin_exchange` sends it without waiting, for the
worker's event loop; :class:`PipelinedExchange` reads its answers when they arrive.
Starts under permits make the exchange one transaction of two round trips
(:class:`~.pipeline_tx.TwoTrips`): the permits' first half goes out with the rest, their
starts with the ``COMMIT`` (:mod:`.permits_postgres`). A reservation asked to start with
its permits (``ReserveRequest.permits``) is reserved in the first trip and started in the
second when they have room: folded, as an unlimited one's start is into its statement.
A task id twice in one kind, a batch over the chunk size, or a chord part's counter
takes the general path (rare: the keeper's batches are of distinct, recent tasks).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from celery_pulse.errors import PulseError
from celery_pulse.store.base import (
    Completion,
    Exchanged,
    Grant,
    LeaseKey,
    Permit,
    Refusal,
    ReserveRequest,
    ResultRecord,
)
from celery_pulse.store.rules import split_by_permits
from celery_pulse.store.sql import permits as permits_sql
from celery_pulse.store.sql import permits_postgres
from celery_pulse.store.sql.batch_sql import Statement
from celery_pulse.store.sql.claim_rows import (
    CHUNK,
    grants,
    stale_answers,
    started_leases,
    task_id_of,
)
from celery_pulse.store.sql.claims import BatchClaims
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.pipeline import InFlight, Pipeline
from celery_pulse.store.sql.pipeline_tx import TwoTrips
from celery_pulse.store.sql.results import ResultRows, fenced_upsert_cte, fenced_upsert_params


class PostgresClaims(BatchClaims):
    """:class:`BatchClaims` on PostgreSQL, plus the pipelined exchange."""

    nonblocking_exchange = True
    folds_permits = True
    results_in_statement = True

    def __init__(self, conns: Connections, results: ResultRows) -> None:
        super().__init__(conns, results)
        self.pipeline: Pipeline | None = Pipeline(conns.engine)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()

    # -- the completions' statement, with their results -----------------------------------
    def complete_statement(self, chunk: Sequence[Completion]) -> Statement:
        """The completions' statement; it also writes their results, for those it applies."""
        params = self.sql.complete_params(chunk)
        records: list[tuple[str, ResultRecord]] = [
            (c.task_id, c.result) for c in sorted(chunk, key=task_id_of) if c.result is not None]
        if not records:
            return self.sql.complete_sql(len(chunk)), tuple(params)
        return (self.complete_results_sql(len(chunk), len(records)),
                (*params, *fenced_upsert_params(records)))

    def complete_results_sql(self, rows: int, records: int) -> str:
        """The completions' update as a CTE, and the results written only for the rows it
        returned, in one statement."""
        kind, size = "complete+results", rows * 100_000 + records
        cached = self.sql.cached(kind, size)
        if cached is not None:
            return cached
        # batch_update's shape: "WITH v(..) AS (VALUES ..) UPDATE pulse_claims .. RETURNING
        # pulse_claims.task_id".
        values, update = self.sql.complete_sql(rows).split(" UPDATE pulse_claims ", 1)
        return self.sql.keep(kind, size, (
            f"{values}, done AS (UPDATE pulse_claims {update}), "
            f"{fenced_upsert_cte(records, self.dialect.clock)} SELECT task_id FROM done"))

    # -- the exchange ---------------------------------------------------------------------
    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged | None:
        """The statements in one pipeline, or two round trips of one transaction with
        starts under permits (None: the general path, see the module doc)."""
        if not self.pipelined(completions, reserves, starts):
            return None
        exchange = self._begin(holder, ttl, completions, reserves, starts, permits, now=False)
        assert exchange is not None
        exchange.flight.wait(None)
        answers = exchange.finish(blocking=True)
        assert answers is not None
        return answers

    def limited_chunks(self) -> permits_sql.ChunkStarter | None:
        if self.pipeline is None:
            return None
        return functools.partial(permits_postgres.start_pipelined, self.pipeline, self.dialect)

    def pipelined(self, completions: Sequence[Completion], reserves: Sequence[ReserveRequest],
                  starts: Sequence[LeaseKey]) -> bool:
        """Whether this exchange goes on the pipeline (see the module doc)."""
        ids = ([c.task_id for c in completions], [r.task_id for r in reserves],
               [lease[0] for lease in starts])
        # (A chord part's counter is counted in a transaction of its own: rare.)
        return self.pipeline is not None and any(ids) and not any(
            len(kind) > CHUNK or len(set(kind)) < len(kind) for kind in ids) and not any(
            c.result is not None and c.result.counter is not None for c in completions)

    def begin_exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                       reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
                       permits: Mapping[str, Sequence[Permit]] | None = None
                       ) -> PipelinedExchange | None:
        """:meth:`exchange`, sent on the pipeline without waiting for the answer (for the
        worker's event loop); None where it takes another path (see :meth:`exchange`)."""
        if not self.pipelined(completions, reserves, starts):
            return None
        return self._begin(holder, ttl, completions, reserves, starts, permits, now=True)

    def _begin(self, holder: str, ttl: float, completions: Sequence[Completion],
               reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey],
               permits: Mapping[str, Sequence[Permit]] | None, *, now: bool
               ) -> PipelinedExchange | None:
        """Send the exchange (``now``: None where that could block). Starts that need
        permits make it one transaction of two round trips: the rest of the exchange and
        the permits' first half (their keys locked after the completions gave theirs
        back), then the starts under permits with the ``COMMIT``. A reservation asked to
        start with permits is reserved, then started there too (folded)."""
        pipeline = self.pipeline
        assert pipeline is not None
        limited, starts = split_by_permits(permits, starts)
        folded = [r for r in reserves if r.start and r.permits]
        statements = self.exchange_statements(holder, ttl, completions, reserves, starts)
        if not limited and not folded:
            flight = (pipeline.begin_now if now else pipeline.begin)("exchange", statements)
            return None if flight is None else PipelinedExchange(
                self, holder, flight, completions, reserves, bool(starts))
        needs = {**(permits or {}), **{r.task_id: r.permits for r in folded}}
        plan = permits_postgres.PermitPlan(self.dialect, holder, limited, ttl, needs,
                                           [r.task_id for r in folded])
        at, reserved_at = len(statements), 1 if completions else 0
        trips = (TwoTrips.begin_now if now else TwoTrips.begin)(
            pipeline, "exchange", [*statements, *plan.first],
            lambda rows: plan.then(rows[at:], rows[reserved_at] if folded else ()))
        return None if trips is None else PipelinedExchange(
            self, holder, trips, completions, reserves, bool(starts), plan)

    def exchange_statements(self, holder: str, ttl: float, completions: Sequence[Completion],
                            reserves: Sequence[ReserveRequest], starts: Sequence[LeaseKey]
                            ) -> list[Statement]:
        statements = []
        if completions:
            statements.append(self.complete_statement(completions))
        if reserves:
            statements.append(self.sql.reserve_statement(holder, reserves, ttl))
        if starts:
            statements.append(self.sql.start_statement(holder, starts, ttl))
        return statements

    def exchanged(self, holder: str, completions: Sequence[Completion],
                  reserves: Sequence[ReserveRequest], starts: bool,
                  results: Iterator[list[tuple[Any, ...]]]) -> Exchanged:
        """The answers of a committed pipelined exchange, from its rows (plus the reads
        that say why a completion was stale or a reservation refused: rare)."""
        # Committed: from here on a failure only leaves some answers unknown (each of
        # them answered with the error), never the exchange undone.
        completed: dict[str, str | PulseError] = {}
        if completions:
            applied = {row[0] for row in next(results)}
            completed = dict.fromkeys(applied, "applied")
            stale = [c for c in completions if c.task_id not in applied]
            if stale:
                try:
                    with translated("complete"), self.conns.single() as conn:
                        completed.update(stale_answers(conn, holder, stale, self.conns.now))
                except PulseError as exc:
                    completed.update(dict.fromkeys((c.task_id for c in stale), exc))
        reserved: Sequence[Grant | Refusal | PulseError] = []
        if reserves:
            rows = next(results)
            try:
                reserved = self.reserve_answers(None, reserves, rows)
            except PulseError as exc:  # why some were refused could not be asked
                granted = grants(rows)
                reserved = [granted.get(r.task_id, exc) for r in reserves]
        started = started_leases(next(results)) if starts else {}
        return Exchanged(completed, reserved, started)


class PipelinedExchange:
    """An exchange in flight on the PostgreSQL pipeline (:meth:`PostgresClaims.begin_exchange`).

    Drive :attr:`flight` to its end (``step`` on an event loop, or ``wait``), then
    :meth:`finish` gives the answers. Most exchanges need nothing more than their rows;
    one with a stale completion or a refused reservation reads why in a query of its
    own, which ``finish(blocking=False)`` leaves to a caller that may block (None).
    """

    def __init__(self, claims: PostgresClaims, holder: str, flight: InFlight | TwoTrips,
                 completions: Sequence[Completion], reserves: Sequence[ReserveRequest],
                 starts: bool, plan: permits_postgres.PermitPlan | None = None) -> None:
        self.claims, self.holder, self.flight = claims, holder, flight
        self.completions, self.reserves, self.starts = completions, reserves, starts
        #: Starts under permits, in the same transaction (their rows come last).
        self.plan = plan
        self._rows: list[list[tuple[Any, ...]]] | None = None

    def finish(self, *, blocking: bool) -> Exchanged | None:
        """The answers (raises the store's error if the exchange failed)."""
        if self._rows is None:
            self._rows = self.flight.rows()
        rows = self._rows
        if not blocking and self._needs_reads(rows):
            return None
        results = iter(rows)
        done = self.claims.exchanged(self.holder, self.completions, self.reserves,
                                     self.starts, results)
        plan = self.plan
        if plan is None:
            return done
        started, waiting = plan.outcome(list(results))
        reserved = done.reserved
        if plan.folded:  # granted reserved, then started in the same transaction
            folded = set(plan.folded)
            reserved = [dataclasses.replace(g, started=True, lease_until=started.pop(g.task_id))
                        if isinstance(g, Grant) and g.task_id in folded and g.task_id in started
                        else g for g in reserved]
        return dataclasses.replace(done, reserved=reserved, started={**done.started, **started},
                                   waiting=frozenset(waiting), retry_in=dict(waiting.retry_in))

    def _needs_reads(self, rows: list[list[tuple[Any, ...]]]) -> bool:
        at = 0
        if self.completions:
            if len(rows[at]) < len(self.completions):
                return True
            at += 1
        return bool(self.reserves) and len(rows[at]) < len(self.reserves)
