"""Gateway sessions and attempts in SQL (``pulse_gateway_instances``'s session columns and
``pulse_gateway_attempts``; the contract and its rules are in
:mod:`celery_pulse.store.gateway_state`).

Portable SQLAlchemy Core: none of it is on a task's hot path (a hello, a capacity change,
one insert per assignment, a lookup only on a gateway that never saw the attempt). Times
are the store clock's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.gateway_state import AttemptRecord, GatewayState, IdentityChanged, Opened
from celery_pulse.store.records import LIVE_STATES
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.tables import claims, gateway_attempts, gateway_instances

_ATTEMPT = [gateway_attempts.c[f.name] for f in dataclasses.fields(AttemptRecord)]


def _record(row: Any) -> AttemptRecord:
    return AttemptRecord(row.attempt_id, row.instance_id, row.task_id, row.wire_task_id,
                         int(row.epoch), row.token_digest, row.task_name)


class SqlGatewayState(GatewayState):
    """The gateway's session and attempt rows on one engine."""

    def __init__(self, engine: sa.Engine) -> None:
        self.conns = Connections(engine)
        #: The attempt insert as the driver's SQL, and its parameters' order (None: by
        #: name), compiled once for the engine's dialect.
        self._insert: tuple[str, Sequence[str] | None] | None = None

    def open_session(self, instance_id: str, session_id: str, gateway: str,
                     identity: str) -> Opened:
        table = gateway_instances

        def body(conn: sa.Connection) -> Opened:
            # The first hello's identity is kept; the next generation only for the same.
            moved = conn.execute(sa.update(table).where(
                table.c.instance_id == instance_id,
                sa.or_(table.c.identity_digest.is_(None), table.c.identity_digest == identity))
                .values(identity_digest=identity, generation=table.c.generation + 1,
                        session_id=session_id, gateway=gateway[:255], seen_at=self.conns.now))
            if moved.rowcount != 1:
                raise IdentityChanged()
            row = conn.execute(sa.select(
                table.c.generation, table.c.capacity_sequence, table.c.capacity,
                table.c.drain).where(table.c.instance_id == instance_id)).one()
            return Opened(int(row.generation), int(row.capacity_sequence), int(row.capacity),
                          bool(row.drain))

        return self.conns.atomic("open gateway session", body)

    def generations(self, instance_ids: Sequence[str]) -> dict[str, int]:
        if not instance_ids:
            return {}
        table = gateway_instances
        with self.conns.reading("gateway generations") as conn:
            rows = conn.execute(sa.select(table.c.instance_id, table.c.generation).where(
                table.c.instance_id.in_(list(instance_ids))))
            return {row.instance_id: int(row.generation) for row in rows}

    def declare(self, instance_id: str, generation: int, sequence: int, capacity: int,
                drain: bool) -> bool:
        table = gateway_instances
        return self.conns.statement("declare gateway capacity", sa.update(table).where(
            table.c.instance_id == instance_id, table.c.generation == generation)
            .values(capacity_sequence=sequence, capacity=capacity, drain=drain)) == 1

    def record_attempts(self, records: Sequence[AttemptRecord]) -> None:
        if not records:
            return
        sql, order = self._insert_sql()
        named = [{c.name: getattr(r, c.name) for c in _ATTEMPT} for r in records]
        rows: list[Any] = named if order is None else [tuple(n[k] for k in order)
                                                       for n in named]
        with self.conns.writing("record gateway attempts") as conn:
            # One statement compiled once, run by the driver's executemany (psycopg
            # pipelines it): one insert per assignment batch was a tenth of the gateway's
            # CPU on short tasks through SQLAlchemy's execution path.
            cursor = conn.connection.cursor()
            try:
                cursor.executemany(sql, rows)
            finally:
                cursor.close()

    def _insert_sql(self) -> tuple[str, Sequence[str] | None]:
        if self._insert is None:
            stmt = sa.insert(gateway_attempts).values(
                created_at=self.conns.now, **{c.name: sa.bindparam(c.name) for c in _ATTEMPT})
            compiled = stmt.compile(dialect=self.conns.engine.dialect)
            self._insert = (str(compiled), compiled.positiontup)
        return self._insert

    def find_attempt(self, attempt_id: str) -> AttemptRecord | None:
        with self.conns.reading("find gateway attempt") as conn:
            row = conn.execute(sa.select(*_ATTEMPT).where(
                gateway_attempts.c.attempt_id == attempt_id)).one_or_none()
        return None if row is None else _record(row)

    def live_attempts(self, instance_id: str, holder: str
                      ) -> list[tuple[AttemptRecord, str]]:
        a = gateway_attempts
        stmt = (sa.select(*_ATTEMPT, claims.c.state).join(claims, sa.and_(
            claims.c.task_id == a.c.task_id, claims.c.epoch == a.c.epoch))
            .where(a.c.instance_id == instance_id, claims.c.holder == holder,
                   claims.c.state.in_(LIVE_STATES), claims.c.lease_until > self.conns.now))
        with self.conns.reading("live gateway attempts") as conn:
            return [(_record(row), str(row.state)) for row in conn.execute(stmt)]

    def attempts_of(self, task_id: str) -> list[tuple[AttemptRecord, float]]:
        a = gateway_attempts
        with self.conns.reading("gateway attempts of a task") as conn:
            rows = conn.execute(sa.select(*_ATTEMPT, a.c.created_at).where(
                a.c.task_id == task_id).order_by(a.c.created_at, a.c.epoch))
            return [(_record(row), float(row.created_at)) for row in rows]

    def purge_attempts(self, older_than: float) -> int:
        a = gateway_attempts
        running = sa.exists().where(claims.c.task_id == a.c.task_id,
                                    claims.c.epoch == a.c.epoch,
                                    claims.c.state.in_(LIVE_STATES))
        return self.conns.statement("purge gateway attempts", sa.delete(a).where(
            a.c.created_at < older_than, ~running))
