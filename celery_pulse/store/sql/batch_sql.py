"""The hot path's hand-written SQL on PostgreSQL and SQLite: one multi-row statement per
batch (``WITH v(..) AS (VALUES ..)``), built once per batch size.

Plain SQL text, not SQLAlchemy: every delivered task goes through these statements, and
one statement per batch is what keeps the cost per task low. Rows are sent in task id
order, so concurrent batches lock their rows in one order and two workers reserving the
same ids (redeliveries) never deadlock each other. MySQL/MariaDB, which has neither
``ON CONFLICT .. WHERE`` nor ``UPDATE .. FROM .. RETURNING``, decides under row locks
instead (:mod:`.mysql`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_pulse.store.base import (
    OPEN,
    RESERVED,
    RESTARTABLE_STATES,
    RUNNING,
    Completion,
    LeaseKey,
    ReserveRequest,
)
from celery_pulse.store.checkpoints import CheckpointWrite
from celery_pulse.store.rules import OUTCOME_STATE, queue_of
from celery_pulse.store.sql.claim_rows import LIVE_SQL, claimable_sql, dumps, task_id_of
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.tables import CHECKPOINT_COLUMNS

#: A reservation's values, in the order of its CTE's columns.
RESERVE_COLUMNS = ("task_id", "task_name", "max_attempts", "policy", "retries", "body",
                   "headers", "properties", "delivery_info", "content_type",
                   "content_encoding", "publication", "queue", "state")
#: PostgreSQL types the VALUES of a reservation, by column (the others are text).
_PG_CASTS = ("", "", "::integer", "", "::integer", "::bytea", "", "", "", "", "", "", "", "")

Statement = tuple[str, tuple[Any, ...]]


class BatchSql:
    """The batch statements of one dialect, each text built once per (kind, rows)."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._cache: dict[tuple[str, int], str] = {}

    def cached(self, kind: str, rows: int) -> str | None:
        """The text built before for ``(kind, rows)``, if any."""
        return self._cache.get((kind, rows))

    def keep(self, kind: str, rows: int, sql: str) -> str:
        """Remember ``sql`` as the text for ``(kind, rows)``."""
        self._cache[(kind, rows)] = sql
        return sql

    # -- reservations ---------------------------------------------------------------------
    def reserve_statement(self, holder: str, requests: Sequence[ReserveRequest], ttl: float
                          ) -> Statement:
        params: list[Any] = []
        for r in sorted(requests, key=task_id_of):  # one lock order (see the module doc)
            params += [r.task_id, r.task_name, r.max_attempts, r.policy, r.retries,
                       r.message.body, dumps(r.message.headers),
                       dumps(r.message.properties), dumps(r.message.delivery_info),
                       r.message.content_type, r.message.content_encoding, r.publication,
                       queue_of(r.message), RUNNING if r.starts_now else RESERVED]
        params += [holder, ttl]  # the CTE's rows come first in the statement
        return self.reserve_sql(len(requests)), tuple(params)

    def reserve_sql(self, rows: int) -> str:
        """One multi-row ``INSERT .. ON CONFLICT DO UPDATE .. RETURNING`` for ``rows`` tasks."""
        cached = self.cached("reserve", rows)
        if cached is not None:
            return cached
        mark = self.dialect.mark
        casts = _PG_CASTS if self.dialect.typed_values else ("",) * len(RESERVE_COLUMNS)
        row = "(" + ", ".join(f"{mark}{cast}" for cast in casts) + ")"
        now = self.dialect.clock
        token = self.dialect.token
        cols = ", ".join(RESERVE_COLUMNS)
        expired = f"pulse_claims.lease_until <= {now}"
        # A new publication of the task id (not a redelivery of the claim's own).
        new_pub = ("(excluded.publication IS NOT NULL AND (pulse_claims.publication IS NULL "
                   "OR pulse_claims.publication <> excluded.publication))")
        restartable = ", ".join(f"'{state}'" for state in RESTARTABLE_STATES)
        sql = (
            f"WITH v({cols}) AS (VALUES {', '.join([row] * rows)}) "
            f"INSERT INTO pulse_claims (task_id, task_name, state, holder, token, epoch, "
            f"lease_until, attempts, max_attempts, policy, retries, body, headers, properties, "
            f"delivery_info, content_type, content_encoding, publication, queue, created_at, "
            f"reserved_at, started_at) "
            f"SELECT v.task_id, v.task_name, v.state, {mark}, {token}, 1, {now} + {mark}, 1, "
            f"v.max_attempts, v.policy, v.retries, v.body, v.headers, v.properties, "
            f"v.delivery_info, v.content_type, v.content_encoding, v.publication, v.queue, "
            f"{now}, {now}, "
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
            f"publication = excluded.publication, queue = excluded.queue, "
            f"started_at = excluded.started_at, finished_at = NULL, outcome = NULL, error = NULL, "
            # A new run of a finished task: no earlier run's checkpoint (rules.restarts).
            + ", ".join(f"{column} = CASE WHEN {new_pub} AND pulse_claims.state IN "
                        f"({restartable}) THEN NULL ELSE pulse_claims.{column} END"
                        for column in CHECKPOINT_COLUMNS) + " "
            # A live lease is never granted again, not even to its own holder: one holder
            # must never hold two live grants of one task.
            f"WHERE (({new_pub} OR pulse_claims.attempts < pulse_claims.max_attempts) AND ("
            f"{claimable_sql(expired)})) "
            f"OR ({new_pub} AND pulse_claims.state IN ({restartable})) "
            f"RETURNING task_id, epoch, token, lease_until, attempts, state")
        return self.keep("reserve", rows, sql)

    # -- starts and completions -----------------------------------------------------------
    def start_statement(self, holder: str, leases: Sequence[LeaseKey], ttl: float
                        ) -> Statement:
        params: list[Any] = []
        for lease in sorted(leases):  # one lock order
            params += lease
        params += [ttl, holder]
        return self.start_sql(len(leases)), tuple(params)

    def start_sql(self, rows: int) -> str:
        now = self.dialect.clock
        return self.batch_update(
            "start", rows, ("task_id", "epoch", "token"),
            f"state = '{RUNNING}', started_at = {now}, lease_until = {now} + {{mark}}",
            f"pulse_claims.holder = {{mark}} AND pulse_claims.state = '{RESERVED}' "
            f"AND pulse_claims.lease_until > {now}", "pulse_claims.lease_until")

    def complete_params(self, chunk: Sequence[Completion]) -> list[Any]:
        """The completions' rows, in one lock order."""
        params: list[Any] = []
        for c in sorted(chunk, key=task_id_of):
            params += [c.task_id, c.epoch, c.token, OUTCOME_STATE[c.outcome], c.outcome,
                       c.error]
        return params

    def complete_sql(self, rows: int) -> str:
        """Outcomes of any mix of kinds in one statement. A retry reopens the claim for its
        next delivery: no ``finished_at``."""
        return self.batch_update(
            "complete", rows, ("task_id", "epoch", "token", "state", "outcome", "error"),
            f"state = v.state, outcome = v.outcome, error = v.error, token = NULL, "
            f"lease_until = NULL, finished_at = CASE WHEN v.state = '{OPEN}' THEN NULL "
            f"ELSE {self.dialect.clock} END",
            f"pulse_claims.state IN ({LIVE_SQL})")

    # -- checkpoints (issue 40) -------------------------------------------------------------
    def checkpoint_statement(self, holder: str, writes: Sequence[CheckpointWrite]
                             ) -> Statement:
        """Every write of a batch in one statement, each fenced by its lease and kept only
        if newer than the row's checkpoint (a later epoch, or a later write of this one)."""
        params: list[Any] = []
        for w in sorted(writes, key=task_id_of):  # one lock order
            params += [w.task_id, w.epoch, w.token, w.seq, w.value]
        params.append(holder)
        now = self.dialect.clock
        return self.batch_update(
            "checkpoint", len(writes), ("task_id", "epoch", "token", "seq", "value"),
            f"checkpoint = v.value, checkpoint_epoch = v.epoch, checkpoint_seq = v.seq, "
            f"checkpoint_at = {now}",
            f"pulse_claims.holder = {{mark}} AND pulse_claims.state IN ({LIVE_SQL}) "
            f"AND pulse_claims.lease_until > {now} AND (pulse_claims.checkpoint_epoch IS NULL "
            f"OR pulse_claims.checkpoint_epoch < v.epoch OR (pulse_claims.checkpoint_epoch = "
            f"v.epoch AND pulse_claims.checkpoint_seq < v.seq))"), tuple(params)

    def batch_update(self, kind: str, rows: int, columns: tuple[str, ...], assign: str,
                     where: str, returning: str = "") -> str:
        """``WITH v(columns) AS (VALUES ..) UPDATE pulse_claims .. FROM v`` for ``rows`` leases.

        ``v`` starts with the lease key (task_id, epoch, token); ``{mark}`` in
        ``assign``/``where`` is a parameter placed after the rows'.
        """
        cached = self.cached(kind, rows)
        if cached is not None:
            return cached
        mark = self.dialect.mark
        row = f"({', '.join([mark] * len(columns))})"
        sql = (f"WITH v({', '.join(columns)}) AS (VALUES {', '.join([row] * rows)}) "
               f"UPDATE pulse_claims SET {assign.format(mark=mark)} FROM v "
               f"WHERE pulse_claims.task_id = v.task_id AND pulse_claims.epoch = v.epoch "
               f"AND pulse_claims.token = v.token AND {where.format(mark=mark)} "
               f"RETURNING pulse_claims.task_id{', ' + returning if returning else ''}")
        return self.keep(kind, rows, sql)
