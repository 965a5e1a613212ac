"""The SQL implementation of the store contract (see :mod:`celery_pulse.store.base`).

Every grant is one atomic statement whose ``WHERE`` clause carries both the
credential check (token, epoch) and the expiry check by the store clock.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from celery_pulse.errors import (
    Contended,
    InvalidConfig,
    NotFound,
    NotRegistered,
    PulseError,
    SchemaMissing,
    StoreUnavailable,
)
from celery_pulse.settings import mask_url
from celery_pulse.store.base import (
    FAILED,
    FINISHED_STATES,
    LIVE_STATES,
    NEEDS_REVIEW,
    OPEN,
    RESERVED,
    RESTARTABLE_STATES,
    RETRY,
    REVOKED,
    RUNNING,
    SUCCEEDED,
    TERMINAL_STATES,
    ClaimInfo,
    Completion,
    Exchanged,
    Grant,
    Heartbeat,
    LeaderGrant,
    LeaderInfo,
    Message,
    PendingExchange,
    Permit,
    PermitSignals,
    PermitUsage,
    Recovered,
    Refusal,
    Registration,
    ReserveRequest,
    ResultRecord,
    ReviewItem,
    ScheduleRow,
    Slot,
    Store,
    WorkerInfo,
)
from celery_pulse.store.sql import migrate
from celery_pulse.store.sql import permits as _permits
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.engine import READ_ONLY, make_engine
from celery_pulse.store.sql.errors import driver_message, refused_for_good, translated
from celery_pulse.store.sql.results import ResultRows, fenced_upsert_cte, fenced_upsert_params
from celery_pulse.store.sql.tables import (
    beat_slots,
    beat_state,
    claims,
    drains,
    evidence,
    leaders,
    reviews,
    schedule,
    workers,
)

if TYPE_CHECKING:
    from celery_pulse.store.sql.credentials import SqlCredentials
    from celery_pulse.store.sql.pipeline import InFlight, Pipeline

logger = logging.getLogger(__name__)

T = TypeVar("T")

_OUTCOME_STATE = {SUCCEEDED: SUCCEEDED, FAILED: FAILED, REVOKED: REVOKED, RETRY: OPEN,
                  NEEDS_REVIEW: NEEDS_REVIEW}
#: Renewals and completions are chunked so one statement never carries huge IN lists.
_CHUNK = 500
#: Attempts of one reservation round that meets a deadlock (PostgreSQL).
_ROUND_ATTEMPTS = 4
#: The largest message body a claim row takes on PostgreSQL and SQLite (bytes).
_MAX_FIELD_BYTES = 1_000_000_000 - (1 << 20)
#: Which answer of :meth:`SqlStore.complete` wins for a task id completed twice in a call.
_RANK = {"evidence": 0, "duplicate": 1, "applied": 2}


def _rounds(items: list[Any], key: Any) -> list[list[Any]]:
    """``items`` in rounds of distinct keys, in order: the n-th copy of a key goes in round n."""
    rounds: list[list[Any]] = []
    seen: dict[Any, int] = {}
    for item in items:
        k = key(item)
        n = seen.get(k, 0)
        seen[k] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(item)
    return rounds


def _grants(rows: Any) -> dict[str, Grant]:
    """The reservation statement's rows (task_id, epoch, token, lease_until, attempts,
    state) as grants."""
    return {task_id: Grant(task_id, int(epoch), token, float(lease_until), int(attempts),
                           state == RUNNING)
            for task_id, epoch, token, lease_until, attempts, state in rows}


def _task_id(item: Any) -> str:
    return str(item.task_id)


#: Built once: ``json.dumps`` with options builds an encoder per call (three per reservation).
_ENCODER = json.JSONEncoder(sort_keys=True, default=str)


def _dumps(value: Any) -> str:
    return _ENCODER.encode(dict(value))


class SqlStore(Store):
    """A :class:`Store` on a SQLAlchemy engine (PostgreSQL or SQLite; MySQL/MariaDB in
    :class:`~celery_pulse.store.sql.mysql.MySqlStore`)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.dialect = Dialect(engine.dialect.name)
        self._now = self.dialect.now()
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._reserve_sql_cache: dict[int, str] = {}
        self._sql_cache: dict[tuple[str, int], str] = {}
        self._pipeline: Pipeline | None = None
        self._result_rows: ResultRows | None = None
        if self.dialect.is_postgres:
            from celery_pulse.store.sql.pipeline import Pipeline

            self._pipeline = Pipeline(engine)
            self.nonblocking_exchange = True

    def _single(self) -> Any:
        """A connection for independent statements, each atomic on its own.

        On PostgreSQL: autocommit, so one statement costs one round trip (no BEGIN or
        COMMIT). On SQLite: a transaction (``BEGIN IMMEDIATE`` takes the write lock).
        """
        if self.dialect.is_postgres:
            return self._autocommit.connect()
        return self.engine.begin()

    def _read(self) -> Any:
        """A connection for reads that need no transaction around them.

        On PostgreSQL: autocommit, so a poll costs one round trip instead of three
        (BEGIN, the query, ROLLBACK): the leader's beat polls every second. On SQLite:
        no ``BEGIN IMMEDIATE`` either, so a writer holding the file's lock never blocks it.
        """
        if self.dialect.is_postgres:
            return self._autocommit.connect()
        return self.engine.connect().execution_options(**{READ_ONLY: True})

    @functools.cached_property
    def credentials(self) -> SqlCredentials:
        """The lease gateway's credentials (``pulse_credentials``)."""
        # Imported here: a store that never serves a gateway never loads the gateway package.
        from celery_pulse.store.sql.credentials import SqlCredentials

        return SqlCredentials(self.engine)

    @property
    def url(self) -> str:
        return mask_url(self.engine.url.render_as_string(hide_password=False))

    def close(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
        self.engine.dispose()

    # -- housekeeping ---------------------------------------------------------
    def now(self) -> float:
        with translated("now"), self._read() as conn:
            return float(conn.execute(sa.select(self._now)).scalar_one())

    def check_schema(self) -> None:
        with translated("schema check"):
            current = migrate.current_revision(self.engine)
        head = migrate.head_revision()
        if current != head:
            state = "missing" if current is None else f"at revision {current}, need {head}"
            raise SchemaMissing(f"the pulse schema in {self.url} is {state}: "
                                f"run `celery -A <app> pulse migrate`")

    def migrate(self) -> tuple[str | None, str]:
        with translated("migrate"):
            return migrate.upgrade(self.engine)

    # -- worker registry --------------------------------------------------------
    def register(self, worker_id: str, labels: Mapping[str, Any], ttl: float, *,
                 replace_live: bool = True) -> Registration:
        now = self._now
        drained = sa.exists().where(drains.c.worker_id == worker_id)
        stmt = self.dialect.insert(workers).values(
            worker_id=worker_id, token=self.dialect.new_token(),
            labels=json.dumps(dict(labels), sort_keys=True, default=str),
            registered_at=now, last_heartbeat=now, expires_at=now + ttl, draining=drained)
        stmt = stmt.on_conflict_do_update(
            index_elements=[workers.c.worker_id],
            set_={c: stmt.excluded[c] for c in
                  ("token", "labels", "registered_at", "last_heartbeat", "expires_at",
                   "draining")},
            where=None if replace_live else workers.c.expires_at <= now,
        ).returning(workers.c.token, workers.c.expires_at, workers.c.draining)
        with translated("register"), self._single() as conn:
            row = conn.execute(stmt).one_or_none()
        if row is None:
            raise NotRegistered(f"{worker_id}: another process registered this name",
                                reason=NotRegistered.REPLACED)
        return Registration(worker_id, row.token, float(row.expires_at), bool(row.draining))

    def set_drain(self, worker_id: str, draining: bool, who: str) -> None:
        with translated("set_drain"), self.engine.begin() as conn:
            if draining:
                conn.execute(self.dialect.insert(drains).values(
                    worker_id=worker_id, requested_by=who, requested_at=self._now
                ).on_conflict_do_nothing(index_elements=[drains.c.worker_id]))
            else:
                conn.execute(sa.delete(drains).where(drains.c.worker_id == worker_id))
            conn.execute(sa.update(workers).where(workers.c.worker_id == worker_id)
                         .values(draining=draining))

    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        now = self._now
        stmt = (sa.update(workers)
                .where(workers.c.worker_id == worker_id, workers.c.token == token,
                       workers.c.expires_at > now)
                .values(expires_at=now + ttl, last_heartbeat=now)
                .returning(workers.c.expires_at, workers.c.draining))
        with translated("heartbeat"), self._single() as conn:
            row = conn.execute(stmt).one_or_none()
            if row is not None:
                return Heartbeat(float(row.expires_at), bool(row.draining))
            # Diagnose only; the grant itself was decided by the statement above.
            other = conn.execute(
                sa.select(workers.c.token, (workers.c.expires_at > now).label("alive"))
                .where(workers.c.worker_id == worker_id)).one_or_none()
        if other is None:
            raise NotRegistered(f"{worker_id}: not registered", reason=NotRegistered.MISSING)
        if other.token != token and other.alive:
            raise NotRegistered(f"{worker_id}: another process registered this name",
                                reason=NotRegistered.REPLACED)
        raise NotRegistered(f"{worker_id}: registration expired", reason=NotRegistered.EXPIRED)

    def deregister(self, worker_id: str, token: str) -> bool:
        stmt = sa.delete(workers).where(workers.c.worker_id == worker_id,
                                        workers.c.token == token)
        with translated("deregister"), self._single() as conn:
            return bool(conn.execute(stmt).rowcount > 0)

    def list_workers(self) -> list[WorkerInfo]:
        now = sa.select(self._now).scalar_subquery()
        stmt = sa.select(workers, (workers.c.expires_at - now).label("expires_in")
                         ).order_by(workers.c.worker_id)
        with translated("list_workers"), self._read() as conn:
            rows = conn.execute(stmt).all()
        return [WorkerInfo(r.worker_id, json.loads(r.labels), float(r.registered_at),
                           float(r.last_heartbeat), float(r.expires_at), r.expires_in > 0,
                           float(r.expires_in), bool(r.draining)) for r in rows]

    # -- task claims ------------------------------------------------------------
    def _lease_key(self, leases: Sequence[tuple[str, int, str]]) -> Any:
        return sa.tuple_(claims.c.task_id, claims.c.epoch, claims.c.token).in_(
            [tuple(lease) for lease in leases])

    def _updated(self, conn: sa.Connection, task_ids: list[str], stmt: Any) -> list[Any]:
        """Run ``stmt`` (an UPDATE of ``pulse_claims``); the rows it changed as
        (task_id, epoch, token).

        Where there is no RETURNING (MySQL) the rows are read back after it: callers lock
        ``task_ids`` first, so nothing else can have changed them in between.
        """
        return list(conn.execute(stmt.returning(claims.c.task_id, claims.c.epoch,
                                                claims.c.token)))

    _RESERVE_COLUMNS = ("task_id", "task_name", "max_attempts", "policy", "retries", "body",
                        "headers", "properties", "delivery_info", "content_type",
                        "content_encoding", "publication", "state")

    def _reserve_sql(self, rows: int) -> str:
        """One multi-row ``INSERT .. ON CONFLICT DO UPDATE .. RETURNING`` for ``rows`` tasks.

        Plain SQL text, built once per batch size: this is the hot path (every delivered
        task), and one statement per batch is what keeps the cost per task low.
        """
        cached = self._reserve_sql_cache.get(rows)
        if cached is not None:
            return cached
        pg = self.dialect.is_postgres
        mark = "%s" if pg else "?"
        casts = ("", "", "::integer", "", "::integer", "::bytea", "", "", "", "", "", "", "") \
            if pg else ("",) * 13
        row = "(" + ", ".join(f"{mark}{cast}" for cast in casts) + ")"
        now = self.dialect._now
        token = self.dialect._token
        cols = ", ".join(self._RESERVE_COLUMNS)
        expired = f"pulse_claims.lease_until <= {now}"
        # A new publication of the task id (not a redelivery of the claim's own).
        new_pub = ("(excluded.publication IS NOT NULL AND (pulse_claims.publication IS NULL "
                   "OR pulse_claims.publication <> excluded.publication))")
        restartable = ", ".join(f"'{state}'" for state in RESTARTABLE_STATES)
        sql = (
            f"WITH v({cols}) AS (VALUES {', '.join([row] * rows)}) "
            f"INSERT INTO pulse_claims (task_id, task_name, state, holder, token, epoch, "
            f"lease_until, attempts, max_attempts, policy, retries, body, headers, properties, "
            f"delivery_info, content_type, content_encoding, publication, created_at, "
            f"reserved_at, started_at) "
            f"SELECT v.task_id, v.task_name, v.state, {mark}, {token}, 1, {now} + {mark}, 1, "
            f"v.max_attempts, v.policy, v.retries, v.body, v.headers, v.properties, "
            f"v.delivery_info, v.content_type, v.content_encoding, v.publication, {now}, {now}, "
            f"CASE WHEN v.state = '{RUNNING}' THEN {now} END "
            f"FROM v WHERE true "
            # A request with ``start`` is granted as running (its start folded in here).
            f"ON CONFLICT (task_id) DO UPDATE SET state = excluded.state, "
            f"holder = excluded.holder, "
            f"token = excluded.token, epoch = pulse_claims.epoch + 1, "
            f"lease_until = excluded.lease_until, "
            f"attempts = CASE WHEN {new_pub} THEN 1 ELSE pulse_claims.attempts + 1 END, "
            f"policy = excluded.policy, retries = excluded.retries, "
            f"task_name = excluded.task_name, body = excluded.body, headers = excluded.headers, "
            f"properties = excluded.properties, delivery_info = excluded.delivery_info, "
            f"content_type = excluded.content_type, "
            f"content_encoding = excluded.content_encoding, reserved_at = excluded.reserved_at, "
            f"publication = excluded.publication, "
            f"started_at = excluded.started_at, finished_at = NULL, outcome = NULL, error = NULL "
            # A live lease is never granted again, not even to its own holder: one holder
            # must never hold two live grants of one task.
            f"WHERE (({new_pub} OR pulse_claims.attempts < pulse_claims.max_attempts) AND ("
            f"pulse_claims.state = 'open' "
            f"OR (pulse_claims.state = 'reserved' AND {expired}) "
            f"OR (pulse_claims.state = 'running' AND pulse_claims.policy = 'redispatch' "
            f"AND {expired}))) "
            f"OR ({new_pub} AND pulse_claims.state IN ({restartable})) "
            f"RETURNING task_id, epoch, token, lease_until, attempts, state")
        self._reserve_sql_cache[rows] = sql
        return sql

    def max_message_bytes(self) -> int | None:
        """PostgreSQL keeps at most 1 GB in a bytea value, SQLite in a blob
        (``SQLITE_MAX_LENGTH``); a little is left for the row's other columns."""
        return _MAX_FIELD_BYTES

    def reserve(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                ) -> list[Grant | Refusal]:
        out: list[Grant | Refusal | None] = [None] * len(requests)
        if not requests:
            return []
        with translated("reserve"), self._single() as conn:
            # A task id twice in one batch: the later copy is decided against the claim as
            # the earlier one left it (a duplicate is refused, a new publication waits).
            for batch in _rounds(list(enumerate(requests)), lambda item: item[1].task_id):
                answers = self._round_again_if_contended(functools.partial(
                    self._reserve_round, conn, holder, [r for _, r in batch], ttl))
                for (i, _), answer in zip(batch, answers, strict=True):
                    out[i] = answer
        return [answer for answer in out if answer is not None]

    def _round_again_if_contended(self, run: Callable[[], T]) -> T:
        """Run one round again after a deadlock (PostgreSQL: each round is one autocommit
        statement, so a failed one left nothing behind; earlier rounds stay committed)."""
        for attempt in range(_ROUND_ATTEMPTS):
            try:
                with translated("reserve"):
                    return run()
            except Contended:
                if attempt == _ROUND_ATTEMPTS - 1 or not self.dialect.is_postgres:
                    raise
                time.sleep(0.005 * (attempt + 1) * (0.5 + random.random()))
        raise AssertionError("unreachable")  # pragma: no cover

    def _reserve_round(self, conn: sa.Connection, holder: str, requests: list[ReserveRequest],
                       ttl: float) -> list[Grant | Refusal]:
        """One statement for requests of distinct task ids."""
        rows = conn.exec_driver_sql(*self._reserve_statement(holder, requests, ttl))
        return self._reserve_answers(conn, requests, rows)

    def _reserve_statement(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                           ) -> tuple[str, tuple[Any, ...]]:
        params: list[Any] = []
        # Rows in task id order: concurrent batches lock their rows in one order, so two
        # workers reserving the same ids (redeliveries) never deadlock each other.
        for r in sorted(requests, key=_task_id):
            params += [r.task_id, r.task_name, r.max_attempts, r.policy, r.retries,
                       r.message.body, _dumps(r.message.headers),
                       _dumps(r.message.properties), _dumps(r.message.delivery_info),
                       r.message.content_type, r.message.content_encoding, r.publication,
                       RUNNING if r.start else RESERVED]
        params += [holder, ttl]  # the CTE's rows come first in the statement
        return self._reserve_sql(len(requests)), tuple(params)

    def _reserve_answers(self, conn: sa.Connection | None, requests: Sequence[ReserveRequest],
                         rows: Any) -> list[Grant | Refusal]:
        """Grants from the statement's rows; the others are refused, and asked why on
        ``conn`` (None: a new one)."""
        results: dict[str, Grant | Refusal] = dict(_grants(rows))
        missing = [r for r in requests if r.task_id not in results]
        if missing:
            if conn is None:
                with translated("reserve"), self._single() as own:
                    results.update(self._refusals(own, missing))
            else:
                results.update(self._refusals(conn, missing))
        return [results[r.task_id] for r in requests]

    def _refusals(self, conn: sa.Connection, requests: list[ReserveRequest]
                  ) -> dict[str, Refusal]:
        now = self._now
        by_id = {r.task_id: r for r in requests}
        rows = conn.execute(
            sa.select(claims.c.task_id, claims.c.state, claims.c.holder, claims.c.epoch,
                      claims.c.attempts, claims.c.max_attempts, claims.c.retries,
                      claims.c.policy, claims.c.publication,
                      (claims.c.lease_until <= now).label("expired"))
            .where(claims.c.task_id.in_(list(by_id)))).all()
        out: dict[str, Refusal] = {}
        for r in rows:
            claimable = r.state == OPEN or (r.state == RESERVED and r.expired) \
                or (r.state == RUNNING and r.policy == "redispatch" and r.expired)
            new_pub = by_id[r.task_id].publication not in (None, r.publication)
            if r.state in TERMINAL_STATES:
                reason = "terminal"
            elif claimable and r.attempts >= r.max_attempts and not new_pub:
                reason = "exhausted"
                conn.execute(sa.update(claims).where(
                    claims.c.task_id == r.task_id, claims.c.epoch == r.epoch,
                    claims.c.state == r.state).values(
                    state=FAILED, outcome="exhausted", finished_at=now, lease_until=None,
                    token=None, error=f"attempt budget exhausted ({r.attempts} of "
                                      f"{r.max_attempts} reservations used)"))
            else:
                reason = "taken"
            out[r.task_id] = Refusal(r.task_id, reason, r.state, r.holder, int(r.epoch),
                                     int(r.retries), r.publication)
        return out

    def exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                 reserves: Sequence[ReserveRequest],
                 starts: Sequence[tuple[str, int, str]],
                 permits: Mapping[str, Sequence[Permit]] | None = None) -> Exchanged:
        """On PostgreSQL: the three statements in one pipeline (see :mod:`.pipeline`).

        A task id twice in one kind, or a batch over the chunk size, takes the general
        path (rare: the keeper's batches are of distinct, recent tasks).
        """
        if not self._pipelined(completions, reserves, starts):
            return super().exchange(holder, ttl, completions, reserves, starts, permits)
        limited, starts = _permits.as_needs(permits, starts)
        if limited:
            # Starts that need permits lock their keys in a transaction of their own,
            # after the rest (whose completions give permits back first).
            done = self.exchange(holder, ttl, completions, reserves, starts) if (
                completions or reserves or starts) else Exchanged({}, [], {})
            waiting: set[str] = set()
            started = self._start_limited(holder, limited, ttl, permits or {}, waiting)
            return dataclasses.replace(done, started={**done.started, **started},
                                       waiting=frozenset(waiting))
        assert self._pipeline is not None
        flight = self._pipeline.begin("exchange", self._exchange_statements(
            holder, ttl, completions, reserves, starts))
        flight.wait(None)
        answers = PipelinedExchange(self, holder, flight, completions, reserves,
                                    bool(starts)).finish(blocking=True)
        assert answers is not None
        return answers

    def _pipelined(self, completions: Sequence[Completion], reserves: Sequence[ReserveRequest],
                   starts: Sequence[tuple[str, int, str]]) -> bool:
        ids = ([c.task_id for c in completions], [r.task_id for r in reserves],
               [lease[0] for lease in starts])
        # (A chord part's counter is counted in a transaction of its own: rare.)
        return self._pipeline is not None and any(ids) and not any(
            len(kind) > _CHUNK or len(set(kind)) < len(kind) for kind in ids) and not any(
            c.result is not None and c.result.counter is not None for c in completions)

    def begin_exchange(self, holder: str, ttl: float, completions: Sequence[Completion],
                       reserves: Sequence[ReserveRequest],
                       starts: Sequence[tuple[str, int, str]],
                       permits: Mapping[str, Sequence[Permit]] | None = None
                       ) -> PendingExchange | None:
        """:meth:`exchange`, sent on the pipeline without waiting for the answer (for the
        worker's event loop); None where it takes another path (see :meth:`exchange`)."""
        if permits or not self._pipelined(completions, reserves, starts):
            return None
        assert self._pipeline is not None
        flight = self._pipeline.begin_now("exchange", self._exchange_statements(
            holder, ttl, completions, reserves, starts))
        if flight is None:  # connecting (or waiting for another thread) would block
            return None
        return PipelinedExchange(self, holder, flight, completions, reserves, bool(starts))

    def _exchange_statements(self, holder: str, ttl: float, completions: Sequence[Completion],
                             reserves: Sequence[ReserveRequest],
                             starts: Sequence[tuple[str, int, str]]
                             ) -> list[tuple[str, tuple[Any, ...]]]:
        statements = []
        if completions:
            statements.append(self._complete_statement(completions))
        if reserves:
            statements.append(self._reserve_statement(holder, reserves, ttl))
        if starts:
            statements.append(self._start_statement(holder, starts, ttl))
        return statements

    def _exchanged(self, holder: str, completions: Sequence[Completion],
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
                    with translated("complete"), self._single() as conn:
                        completed.update(self._stale(conn, holder, stale, self._now))
                except PulseError as exc:
                    completed.update(dict.fromkeys((c.task_id for c in stale), exc))
        reserved: Sequence[Grant | Refusal | PulseError] = []
        if reserves:
            rows = next(results)
            try:
                reserved = self._reserve_answers(None, reserves, rows)
            except PulseError as exc:  # why some were refused could not be asked
                granted = _grants(rows)
                reserved = [granted.get(r.task_id, exc) for r in reserves]
        started = {row[0]: float(row[1]) for row in next(results)} if starts else {}
        return Exchanged(completed, reserved, started)

    def start_many(self, holder: str, leases: Sequence[tuple[str, int, str]], ttl: float,
                   permits: Mapping[str, Sequence[Permit]] | None = None,
                   waiting: set[str] | None = None) -> dict[str, float]:
        # Plain SQL, built once per batch size: run by the worker's committer for every
        # task, right before the pool gets the job.
        limited, unique = _permits.as_needs(permits, list(dict.fromkeys(
            (lease[0], lease[1], lease[2]) for lease in leases)))
        started = self._start_limited(holder, limited, ttl, permits or {}, waiting)
        for i in range(0, len(unique), _CHUNK):
            chunk: list[Any] = unique[i:i + _CHUNK]
            with translated("start"), self._single() as conn:
                for row in conn.exec_driver_sql(*self._start_statement(holder, chunk, ttl)):
                    started[row[0]] = float(row[1])
        return started

    def _start_limited(self, holder: str, leases: list[tuple[str, int, str]], ttl: float,
                       needs: Mapping[str, Sequence[Permit]], waiting: set[str] | None
                       ) -> dict[str, float]:
        """Starts that need permits: one transaction per chunk, their keys locked."""
        started: dict[str, float] = {}
        for i in range(0, len(leases), _CHUNK):
            chunk = leases[i:i + _CHUNK]
            if self._pipeline is not None:
                moved, wait = _permits.start_pipelined(self._pipeline, self.dialect, holder,
                                                       chunk, ttl, needs)
            else:
                moved, wait = self._atomic("start", functools.partial(
                    _permits.start, dialect=self.dialect, holder=holder, leases=chunk, ttl=ttl,
                    needs=needs))
            started.update(moved)
            if waiting is not None:
                waiting.update(wait)
        return started

    def _atomic(self, where: str, body: Callable[[sa.Connection], T]) -> T:
        """Run ``body`` in one transaction (MySQL's runs it again after a deadlock)."""
        with translated(where), self.engine.begin() as conn:
            return body(conn)

    def permit_usage(self) -> list[PermitUsage]:
        with translated("permit usage"), self._read() as conn:
            return _permits.usage(conn, self.dialect)

    def permit_signals(self) -> AbstractContextManager[PermitSignals] | None:
        return _permits.signals(self.engine) if self.dialect.is_postgres else None

    def _start_statement(self, holder: str, leases: Sequence[tuple[str, int, str]], ttl: float
                         ) -> tuple[str, tuple[Any, ...]]:
        params: list[Any] = []
        for lease in sorted(leases):  # one lock order (see _reserve_statement)
            params += lease
        params += [ttl, holder]
        return self._start_sql(len(leases)), tuple(params)

    def _start_sql(self, rows: int) -> str:
        now = self.dialect._now
        return self._batch_update(
            "start", rows, ("task_id", "epoch", "token"),
            f"state = '{RUNNING}', started_at = {now}, lease_until = {now} + {{mark}}",
            f"pulse_claims.holder = {{mark}} AND pulse_claims.state = '{RESERVED}' "
            f"AND pulse_claims.lease_until > {now}", "pulse_claims.lease_until")

    def _batch_update(self, kind: str, rows: int, columns: tuple[str, ...], assign: str,
                      where: str, returning: str = "") -> str:
        """``WITH v(columns) AS (VALUES ..) UPDATE pulse_claims .. FROM v`` for ``rows`` leases.

        Plain SQL, built once per (kind, batch size): the hot path. ``v`` starts with the
        lease key (task_id, epoch, token); ``{mark}`` in ``assign``/``where`` is a
        parameter placed after the rows'.
        """
        cached = self._sql_cache.get((kind, rows))
        if cached is not None:
            return cached
        mark = "%s" if self.dialect.is_postgres else "?"
        row = f"({', '.join([mark] * len(columns))})"
        sql = (f"WITH v({', '.join(columns)}) AS (VALUES {', '.join([row] * rows)}) "
               f"UPDATE pulse_claims SET {assign.format(mark=mark)} FROM v "
               f"WHERE pulse_claims.task_id = v.task_id AND pulse_claims.epoch = v.epoch "
               f"AND pulse_claims.token = v.token AND {where.format(mark=mark)} "
               f"RETURNING pulse_claims.task_id{', ' + returning if returning else ''}")
        self._sql_cache[(kind, rows)] = sql
        return sql

    def renew(self, holder: str, leases: Sequence[tuple[str, int, str]], ttl: float
              ) -> tuple[set[str], set[str]]:
        renewed: set[str] = set()
        busy: set[str] = set()
        now = self._now
        for i in range(0, len(leases), _CHUNK):
            chunk = leases[i:i + _CHUNK]
            held = sa.and_(claims.c.holder == holder, self._lease_key(chunk),
                           claims.c.state.in_(LIVE_STATES), claims.c.lease_until > now)
            if self.dialect.is_postgres:
                # Skip rows a fenced transaction holds: waiting would stall every lease.
                ids = sa.select(claims.c.task_id).where(held).with_for_update(skip_locked=True)
                where: Any = claims.c.task_id.in_(ids.scalar_subquery())
            else:
                where = held
            stmt = (sa.update(claims).where(where).values(lease_until=now + ttl)
                    .returning(claims.c.task_id))
            with translated("renew"), self._single() as conn:
                got = set(conn.execute(stmt).scalars())
                missing = [lease for lease in chunk if lease[0] not in got]
                if missing and self.dialect.is_postgres:
                    busy.update(conn.execute(sa.select(claims.c.task_id).where(
                        claims.c.holder == holder, self._lease_key(missing),
                        claims.c.state.in_(LIVE_STATES), claims.c.lease_until > now)).scalars())
            renewed |= got
        return renewed, busy

    def lease_of(self, holder: str, task_id: str, epoch: int, token: str
                 ) -> tuple[str, float] | None:
        stmt = sa.select(claims.c.state, claims.c.lease_until, self._now.label("now")).where(
            claims.c.task_id == task_id, claims.c.holder == holder, claims.c.epoch == epoch,
            claims.c.token == token, claims.c.state.in_(LIVE_STATES),
            claims.c.lease_until > self._now)
        with translated("lease_of"), self._read() as conn:
            row = conn.execute(stmt).one_or_none()
        return None if row is None else (str(row.state), float(row.lease_until))

    def complete(self, holder: str, completions: Sequence[Completion],
                 counted: dict[str, tuple[int, str]] | None = None) -> dict[str, str]:
        """See the contract. Two completions of one task id in one call (a stale attempt's
        and the current one's) are applied in order, each to the claim as the earlier left
        it; the answer for that id is the best of theirs (applied, duplicate, evidence)."""
        out: dict[str, str] = {}
        # A counter is a second statement that must commit with the completion: on
        # PostgreSQL that takes a transaction instead of autocommit.
        counting = any(c.result is not None and c.result.counter is not None
                       for c in completions)
        session = self.engine.begin() if counting else self._single()
        with translated("complete"), session as conn:
            for batch in _rounds(list(completions), lambda c: c.task_id):
                for i in range(0, len(batch), _CHUNK):
                    chunk = batch[i:i + _CHUNK]
                    applied = {row[0] for row in conn.exec_driver_sql(
                        *self._complete_statement(chunk))}
                    mine = [c for c in chunk if c.result is not None and c.task_id in applied]
                    if not self.dialect.is_postgres:  # there, in the statement itself
                        self._results().write_fenced(conn, [c.result for c in mine
                                                            if c.result is not None])
                    if counting:
                        counts = self._results().count_parts(
                            conn, [(c.task_id, c.result) for c in mine if c.result is not None])
                        if counted is not None:
                            counted.update(counts)
                    answers = dict.fromkeys(applied, "applied")
                    stale = [c for c in chunk if c.task_id not in applied]
                    if stale:
                        answers.update(self._stale(conn, holder, stale, self._now))
                    for task_id, answer in answers.items():
                        if _RANK[answer] > _RANK.get(out.get(task_id, ""), -1):
                            out[task_id] = answer
        return out

    def _complete_statement(self, chunk: Sequence[Completion]) -> tuple[str, tuple[Any, ...]]:
        """The completions' statement; on PostgreSQL it also writes their results (the
        ``pulse://`` backend's), for those it applies only."""
        params: list[Any] = []
        records: list[tuple[str, ResultRecord]] = []
        for c in sorted(chunk, key=_task_id):  # one lock order (see _reserve_statement)
            params += [c.task_id, c.epoch, c.token, _OUTCOME_STATE[c.outcome], c.outcome,
                       c.error]
            if c.result is not None:
                records.append((c.task_id, c.result))
        if not records or not self.dialect.is_postgres:
            return self._complete_sql(len(chunk)), tuple(params)
        return (self._complete_results_sql(len(chunk), len(records)),
                (*params, *fenced_upsert_params(records)))

    def _complete_results_sql(self, rows: int, records: int) -> str:
        """PostgreSQL: the completions' update as a CTE, and the results written only for
        the rows it returned, in one statement."""
        cached = self._sql_cache.get(("complete+results", rows * 100_000 + records))
        if cached is not None:
            return cached
        # _batch_update's shape: "WITH v(..) AS (VALUES ..) UPDATE pulse_claims .. RETURNING
        # pulse_claims.task_id".
        values, update = self._complete_sql(rows).split(" UPDATE pulse_claims ", 1)
        sql = (f"{values}, done AS (UPDATE pulse_claims {update}), "
               f"{fenced_upsert_cte(records, self.dialect.clock)} SELECT task_id FROM done")
        self._sql_cache[("complete+results", rows * 100_000 + records)] = sql
        return sql

    def _complete_sql(self, rows: int) -> str:
        """Outcomes of any mix of kinds in one statement. A retry reopens the claim for its
        next delivery: no ``finished_at``."""
        return self._batch_update(
            "complete", rows, ("task_id", "epoch", "token", "state", "outcome", "error"),
            f"state = v.state, outcome = v.outcome, error = v.error, token = NULL, "
            f"lease_until = NULL, finished_at = CASE WHEN v.state = '{OPEN}' THEN NULL "
            f"ELSE {self.dialect._now} END",
            f"pulse_claims.state IN ('{RESERVED}', '{RUNNING}')")

    def _stale(self, conn: sa.Connection, holder: str, stale: list[Completion], now: Any
               ) -> dict[str, str]:
        current = {r.task_id: r for r in conn.execute(
            sa.select(claims.c.task_id, claims.c.state, claims.c.epoch)
            .where(claims.c.task_id.in_([c.task_id for c in stale])))}
        out: dict[str, str] = {}
        evidence_rows = []
        for c in stale:
            row = current.get(c.task_id)
            if row is not None and int(row.epoch) == c.epoch and row.state == _OUTCOME_STATE[c.outcome]:
                out[c.task_id] = "duplicate"
                continue
            out[c.task_id] = "evidence"
            evidence_rows.append(dict(task_id=c.task_id, epoch=c.epoch, holder=holder,
                                      outcome=c.outcome, error=c.error, recorded_at=now))
        if evidence_rows:
            conn.execute(sa.insert(evidence).values(evidence_rows))
        return out

    def release(self, holder: str, leases: Sequence[tuple[str, int, str]], *,
                never_ran: bool = False) -> int:
        if not leases:
            return 0
        states = LIVE_STATES if never_ran else (RESERVED,)
        stmt = (sa.update(claims)
                .where(claims.c.holder == holder, self._lease_key(leases),
                       claims.c.state.in_(states))
                .values(lease_until=self._now, state=RESERVED, started_at=None))
        with translated("release"), self._single() as conn:
            return int(conn.execute(stmt).rowcount)

    def requeue(self, holder: str, leases: Sequence[tuple[str, int, str]], publish_ttl: float
                ) -> list[Recovered]:
        if not leases:
            return []
        now = self._now
        out: list[Recovered] = []
        with translated("requeue"), self.engine.begin() as conn:
            rows = {r.task_id: r for r in conn.execute(sa.select(claims).where(
                claims.c.holder == holder, self._lease_key(leases),
                claims.c.state.in_(LIVE_STATES), claims.c.lease_until > now
            ).with_for_update())}
            if not rows:
                return []
            moved = self._updated(conn, list(rows), sa.update(claims).where(
                sa.tuple_(claims.c.task_id, claims.c.epoch).in_(
                    [(r.task_id, r.epoch) for r in rows.values()]),
                claims.c.state.in_(LIVE_STATES)).values(
                state=OPEN, epoch=claims.c.epoch + 1, holder=holder,
                token=self.dialect.new_token(), lease_until=now + publish_ttl,
                started_at=None, outcome=RETRY, error="requeued"))
            for g in moved:
                out.append(self._recovered(rows[g.task_id], OPEN, int(g.epoch), g.token))
        return out

    def purge_finished(self, older_than: float, limit: int = 500) -> int:
        now = self._now
        ids = (sa.select(claims.c.task_id)
               .where(claims.c.state.in_(FINISHED_STATES),
                      claims.c.finished_at < now - older_than)
               .limit(limit).scalar_subquery())
        old_evidence = (sa.select(evidence.c.id).where(evidence.c.recorded_at < now - older_than)
                        .limit(limit).scalar_subquery())
        with translated("purge"), self.engine.begin() as conn:
            deleted = conn.execute(sa.delete(claims).where(claims.c.task_id.in_(ids))).rowcount
            conn.execute(sa.delete(evidence).where(evidence.c.id.in_(old_evidence)))
            _permits.purge(conn, self.dialect, older_than, limit)
        self._results().purge_expired(limit)
        return deleted

    def _results(self) -> ResultRows:
        """The result backend's rows (``pulse://``): their expired ones go with retention."""
        if self._result_rows is None:
            self._result_rows = ResultRows(self.engine)
        return self._result_rows

    def list_claims(self, states: Sequence[str] | None = None, limit: int = 1000
                    ) -> list[ClaimInfo]:
        now = sa.select(self._now).scalar_subquery()
        stmt = sa.select(claims.c.task_id, claims.c.task_name, claims.c.state, claims.c.holder,
                         claims.c.epoch, claims.c.attempts, claims.c.max_attempts,
                         claims.c.policy, (claims.c.lease_until - now).label("remaining"),
                         claims.c.created_at, claims.c.started_at, claims.c.finished_at,
                         claims.c.outcome, claims.c.error)
        if states:
            stmt = stmt.where(claims.c.state.in_(list(states)))
        stmt = stmt.order_by(claims.c.created_at.desc()).limit(limit)
        with translated("list_claims"), self._read() as conn:
            rows = conn.execute(stmt).all()
        return [ClaimInfo(r.task_id, r.task_name, r.state, r.holder, int(r.epoch),
                          int(r.attempts), int(r.max_attempts), r.policy,
                          None if r.remaining is None else float(r.remaining),
                          float(r.created_at), r.started_at, r.finished_at, r.outcome, r.error)
                for r in rows]

    def claim_counts(self) -> dict[str, int]:
        now = self._now
        expired = sa.and_(claims.c.state.in_(LIVE_STATES), claims.c.lease_until <= now)
        with translated("claim_counts"), self._read() as conn:
            counts = {r.state: int(r.n) for r in conn.execute(
                sa.select(claims.c.state, sa.func.count().label("n")).group_by(claims.c.state))}
            counts["expired"] = int(conn.execute(
                sa.select(sa.func.count()).select_from(claims).where(expired)).scalar_one())
        return counts

    # -- recover and review ------------------------------------------------------------
    def _recovered(self, row: Any, state: str, epoch: int, token: str | None) -> Recovered:
        return Recovered(row.task_id, row.task_name, state, row.state, epoch, token,
                         int(row.attempts), Message(
                             bytes(row.body), json.loads(row.headers), json.loads(row.properties),
                             json.loads(row.delivery_info), row.content_type,
                             row.content_encoding))

    def recover(self, scanner: str, batch: int, publish_ttl: float) -> list[Recovered]:
        now = self._now
        expired = sa.or_(
            sa.and_(claims.c.state.in_(LIVE_STATES), claims.c.lease_until <= now),
            sa.and_(claims.c.state == OPEN, claims.c.lease_until.is_not(None),
                    claims.c.lease_until <= now))
        pick = sa.select(claims).where(expired).order_by(claims.c.lease_until).limit(batch)
        if self.dialect.name != "sqlite":
            # Rows another scanner is taking right now are skipped, not waited for.
            pick = pick.with_for_update(skip_locked=True)
        out: list[Recovered] = []
        with translated("recover"), self.engine.begin() as conn:
            rows = conn.execute(pick).all()
            groups: dict[str, list[Any]] = {OPEN: [], FAILED: [], NEEDS_REVIEW: []}
            for r in rows:
                redispatch = r.state in (RESERVED, OPEN) or r.policy == "redispatch"
                if not redispatch:
                    groups[NEEDS_REVIEW].append(r)
                elif r.attempts >= r.max_attempts:
                    groups[FAILED].append(r)
                else:
                    groups[OPEN].append(r)
            for state, members in groups.items():
                if not members:
                    continue
                key = sa.tuple_(claims.c.task_id, claims.c.epoch).in_(
                    [(r.task_id, r.epoch) for r in members])
                values: dict[str, Any] = {"state": state, "epoch": claims.c.epoch + 1}
                if state == OPEN:
                    values.update(holder=scanner, token=self.dialect.new_token(),
                                  lease_until=now + publish_ttl)
                elif state == FAILED:
                    values.update(token=None, lease_until=None, finished_at=now,
                                  outcome="exhausted",
                                  error="attempt budget exhausted (lease expired)")
                else:
                    values.update(token=None, lease_until=None, outcome="unknown",
                                  error="started, then its lease expired: outcome unknown")
                granted = {g.task_id: g for g in self._updated(
                    conn, [r.task_id for r in members],
                    sa.update(claims).where(key).values(**values))}
                for r in members:
                    g = granted.get(r.task_id)
                    if g is None:
                        continue
                    try:
                        out.append(self._recovered(r, state, int(g.epoch), g.token))
                    except (ValueError, TypeError) as exc:
                        # A corrupted row must not stall recovery of every other claim.
                        logger.error("pulse: claim %s is corrupted (%s): marked failed",
                                     r.task_id, exc)
                        conn.execute(sa.update(claims).where(
                            claims.c.task_id == r.task_id, claims.c.epoch == g.epoch).values(
                            state=FAILED, outcome="corrupted", finished_at=now,
                            lease_until=None, token=None,
                            error=f"corrupted claim row: {exc}"[:500]))
        return out

    def mark_published(self, items: Sequence[tuple[str, int, str]]) -> int:
        if not items:
            return 0
        stmt = (sa.update(claims).where(self._lease_key(items), claims.c.state == OPEN)
                .values(lease_until=None, holder=None, token=None))
        with translated("mark_published"), self._single() as conn:
            return int(conn.execute(stmt).rowcount)

    def list_review(self, limit: int = 1000) -> list[ReviewItem]:
        stmt = (sa.select(claims.c.task_id, claims.c.task_name, claims.c.holder, claims.c.epoch,
                          claims.c.attempts, claims.c.headers, claims.c.reserved_at,
                          claims.c.created_at)
                .where(claims.c.state == NEEDS_REVIEW).order_by(claims.c.created_at).limit(limit))
        with translated("list_review"), self._read() as conn:
            rows = conn.execute(stmt).all()
        items = []
        for r in rows:
            try:
                headers = json.loads(r.headers)
                summary = f"{headers.get('argsrepr', '')} {headers.get('kwargsrepr', '')}".strip()
            except (ValueError, AttributeError):
                summary = "<unreadable headers>"
            items.append(ReviewItem(r.task_id, r.task_name, r.holder, int(r.epoch),
                                    int(r.attempts), summary[:200],
                                    float(r.reserved_at or r.created_at)))
        return items

    def _audit(self, conn: sa.Connection, task_id: str, action: str, outcome: str | None,
               who: str, note: str | None) -> None:
        conn.execute(sa.insert(reviews).values(task_id=task_id, action=action, outcome=outcome,
                                               note=note, decided_by=who, decided_at=self._now))

    def review_retry(self, task_id: str, scanner: str, publish_ttl: float, who: str,
                     note: str | None) -> Recovered:
        now = self._now
        with translated("review_retry"), self.engine.begin() as conn:
            row = conn.execute(sa.select(claims).where(
                claims.c.task_id == task_id,
                claims.c.state.in_((NEEDS_REVIEW, FAILED))).with_for_update()).one_or_none()
            if row is None:
                raise NotFound(f"no needs-review or failed task {task_id}")
            greatest = sa.func.max if self.dialect.name == "sqlite" else sa.func.greatest
            (got,) = self._updated(
                conn, [task_id], sa.update(claims)
                .where(claims.c.task_id == task_id, claims.c.epoch == row.epoch)
                .values(state=OPEN, epoch=claims.c.epoch + 1, holder=scanner,
                        token=self.dialect.new_token(), lease_until=now + publish_ttl,
                        max_attempts=greatest(claims.c.max_attempts, claims.c.attempts + 1),
                        finished_at=None, outcome=None, error=None))
            self._audit(conn, task_id, "retry", None, who, note)
        return self._recovered(row, OPEN, int(got.epoch), got.token)

    def review_resolve(self, task_id: str, outcome: str, who: str, note: str | None) -> None:
        if outcome not in (SUCCEEDED, FAILED):
            raise InvalidConfig(f"--outcome must be succeeded or failed, got {outcome!r}")
        with translated("review_resolve"), self.engine.begin() as conn:
            done = conn.execute(
                sa.update(claims).where(claims.c.task_id == task_id,
                                        claims.c.state == NEEDS_REVIEW)
                .values(state=outcome, outcome=outcome, finished_at=self._now,
                        error=f"resolved by {who}" + (f": {note}" if note else ""))).rowcount
            if not done:
                raise NotFound(f"no needs-review task {task_id}")
            self._audit(conn, task_id, "resolve", outcome, who, note)

    # -- leader election ------------------------------------------------------------------
    def try_acquire(self, key: str, holder: str, ttl: float, token: str | None = None
                    ) -> LeaderGrant | None:
        now = self._now
        stmt = self.dialect.insert(leaders).values(
            key=key, holder=holder, token=self.dialect.new_token(), epoch=1,
            lease_until=now + ttl, acquired_at=now)
        ex = stmt.excluded
        renewal: Any = (leaders.c.token == token) if token else sa.false()
        stmt = stmt.on_conflict_do_update(
            index_elements=[leaders.c.key],
            set_=dict(holder=ex.holder,
                      token=sa.case((renewal, leaders.c.token), else_=ex.token),
                      epoch=sa.case((renewal, leaders.c.epoch), else_=leaders.c.epoch + 1),
                      lease_until=ex.lease_until,
                      acquired_at=sa.case((renewal, leaders.c.acquired_at),
                                          else_=ex.acquired_at)),
            where=sa.or_(leaders.c.lease_until <= now, renewal),
        ).returning(leaders.c.holder, leaders.c.token, leaders.c.epoch, leaders.c.lease_until)
        with translated("try_acquire"), self._single() as conn:
            row = conn.execute(stmt).one_or_none()
        if row is None:
            return None
        return LeaderGrant(key, row.holder, row.token, int(row.epoch), float(row.lease_until))

    def release_leader(self, key: str, token: str) -> bool:
        stmt = (sa.update(leaders).where(leaders.c.key == key, leaders.c.token == token)
                .values(lease_until=self._now))
        with translated("release_leader"), self._single() as conn:
            return bool(conn.execute(stmt).rowcount > 0)

    def get_leader(self, key: str) -> LeaderInfo | None:
        now = sa.select(self._now).scalar_subquery()
        stmt = sa.select(leaders, (leaders.c.lease_until - now).label("remaining")).where(
            leaders.c.key == key)
        with translated("get_leader"), self._read() as conn:
            r = conn.execute(stmt).one_or_none()
        if r is None:
            return None
        return LeaderInfo(key, r.holder, int(r.epoch), r.remaining > 0, float(r.remaining),
                          float(r.acquired_at))

    # -- beat ----------------------------------------------------------------------------
    def last_run(self) -> dict[str, float]:
        with translated("last_run"), self._read() as conn:
            return {r.entry: float(r.last_run_at) for r in conn.execute(sa.select(beat_state))}

    def init_last_run(self, entry: str, at: float) -> float:
        stmt = self.dialect.insert(beat_state).values(entry=entry, last_run_at=at)
        stmt = stmt.on_conflict_do_nothing(index_elements=[beat_state.c.entry])
        with translated("init_last_run"), self.engine.begin() as conn:
            conn.execute(stmt)
            return float(conn.execute(sa.select(beat_state.c.last_run_at).where(
                beat_state.c.entry == entry)).scalar_one())

    def fire_slot(self, key: str, token: str, epoch: int, slot: Slot) -> bool:
        now = self._now
        term = (sa.select(leaders.c.key)
                .where(leaders.c.key == key, leaders.c.token == token, leaders.c.epoch == epoch,
                       leaders.c.lease_until > now))
        if self.dialect.name != "sqlite":
            term = term.with_for_update()  # a takeover waits until this slot is decided
        insert_slot = self.dialect.insert(beat_slots).values(
            entry=slot.entry, due_at=slot.due_at, task_id=slot.task_id, task=slot.task,
            payload=slot.payload, leader_epoch=epoch, created_at=now,
        ).on_conflict_do_nothing(index_elements=[beat_slots.c.entry, beat_slots.c.due_at]
                                 ).returning(beat_slots.c.entry)
        state = self.dialect.insert(beat_state).values(entry=slot.entry, last_run_at=slot.due_at)
        state = state.on_conflict_do_update(
            index_elements=[beat_state.c.entry],
            set_={"last_run_at": sa.case(
                (beat_state.c.last_run_at < state.excluded.last_run_at,
                 state.excluded.last_run_at), else_=beat_state.c.last_run_at)})
        with translated("fire_slot"), self.engine.begin() as conn:
            if conn.execute(term).first() is None:
                return False
            inserted = conn.execute(insert_slot).first() is not None
            conn.execute(state)
        return inserted

    def mark_slot_published(self, entry: str, due_at: float) -> None:
        stmt = (sa.update(beat_slots)
                .where(beat_slots.c.entry == entry, beat_slots.c.due_at == due_at)
                .values(published_at=self._now))
        with translated("mark_slot_published"), self._single() as conn:
            conn.execute(stmt)  # autocommit: a pause never holds the slot's row lock

    def unpublished_slots(self, limit: int = 100) -> list[Slot]:
        stmt = (sa.select(beat_slots).where(beat_slots.c.published_at.is_(None))
                .order_by(beat_slots.c.due_at).limit(limit))
        with translated("unpublished_slots"), self._read() as conn:
            return [Slot(r.entry, float(r.due_at), r.task_id, r.task, r.payload)
                    for r in conn.execute(stmt)]

    def list_schedule(self) -> list[ScheduleRow]:
        with translated("list_schedule"), self._read() as conn:
            return [ScheduleRow(r.name, r.task, r.kind, r.spec, r.args, r.kwargs, r.options,
                                bool(r.enabled), float(r.updated_at))
                    for r in conn.execute(sa.select(schedule).order_by(schedule.c.name))]

    def put_schedule(self, row: ScheduleRow) -> None:
        values = dict(name=row.name, task=row.task, kind=row.kind, spec=row.spec, args=row.args,
                      kwargs=row.kwargs, options=row.options, enabled=row.enabled,
                      updated_at=self._now)
        stmt = self.dialect.insert(schedule).values(**values)
        stmt = stmt.on_conflict_do_update(
            index_elements=[schedule.c.name],
            set_={k: stmt.excluded[k] for k in values if k != "name"})
        with translated("put_schedule"), self.engine.begin() as conn:
            conn.execute(stmt)

    def remove_schedule(self, name: str) -> bool:
        with translated("remove_schedule"), self.engine.begin() as conn:
            return conn.execute(sa.delete(schedule).where(schedule.c.name == name)).rowcount > 0

    def set_schedule_enabled(self, name: str, enabled: bool) -> bool:
        stmt = (sa.update(schedule).where(schedule.c.name == name)
                .values(enabled=enabled, updated_at=self._now))
        with translated("set_schedule_enabled"), self.engine.begin() as conn:
            return conn.execute(stmt).rowcount > 0


def store_on(engine: sa.Engine) -> SqlStore:
    """The store implementation for ``engine``'s dialect."""
    if Dialect(engine.dialect.name).is_mysql:
        from celery_pulse.store.sql.mysql import MySqlStore

        return MySqlStore(engine)
    return SqlStore(engine)


def open_store(url: str, connect_timeout: float = 0.0, check_schema: bool = True) -> SqlStore:
    """Open the store at ``url``, waiting up to ``connect_timeout`` for it to answer.

    Raises InvalidConfig (naming ``pulse_store_url``, password masked) when it never
    answers, at once when no retry can help (no such database, bad credentials, an
    unknown host: :func:`refused_for_good`), and SchemaMissing when the schema is
    absent or old. A refused connection is retried: a store starting after its workers
    is normal.
    """
    store = store_on(make_engine(url))
    deadline = time.monotonic() + connect_timeout
    delay = 0.2
    while True:
        try:
            store.now()
            break
        except StoreUnavailable as exc:
            if (reason := refused_for_good(exc)) is not None:
                store.close()
                raise InvalidConfig(f"pulse_store_url: cannot open the store at "
                                    f"{mask_url(url)}: {reason}",
                                    setting="pulse_store_url") from exc
            if time.monotonic() + delay > deadline:
                store.close()
                raise InvalidConfig(
                    f"pulse_store_url: cannot reach the store at {mask_url(url)} "
                    f"after {connect_timeout:g}s: {driver_message(exc)}",
                    setting="pulse_store_url") from exc
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    if check_schema:
        store.check_schema()
    return store


class PipelinedExchange:
    """An exchange in flight on the PostgreSQL pipeline (:meth:`SqlStore.begin_exchange`).

    Drive :attr:`flight` to its end (``step`` on an event loop, or ``wait``), then
    :meth:`finish` gives the answers. Most exchanges need nothing more than their rows;
    one with a stale completion or a refused reservation reads why in a query of its
    own, which ``finish(blocking=False)`` leaves to a caller that may block (None).
    """

    def __init__(self, store: SqlStore, holder: str, flight: InFlight,
                 completions: Sequence[Completion], reserves: Sequence[ReserveRequest],
                 starts: bool) -> None:
        self.store, self.holder, self.flight = store, holder, flight
        self.completions, self.reserves, self.starts = completions, reserves, starts
        self._rows: list[list[tuple[Any, ...]]] | None = None

    def finish(self, *, blocking: bool) -> Exchanged | None:
        """The answers (raises the store's error if the exchange failed)."""
        if self._rows is None:
            self._rows = self.flight.rows()
        rows = self._rows
        if not blocking and self._needs_reads(rows):
            return None
        return self.store._exchanged(self.holder, self.completions, self.reserves,
                                     self.starts, iter(rows))

    def _needs_reads(self, rows: list[list[tuple[Any, ...]]]) -> bool:
        at = 0
        if self.completions:
            if len(rows[at]) < len(self.completions):
                return True
            at += 1
        return bool(self.reserves) and len(rows[at]) < len(self.reserves)
