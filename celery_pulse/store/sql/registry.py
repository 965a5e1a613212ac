"""The worker registry in SQL (``pulse_workers``, ``pulse_drains``; the contract is
:class:`~celery_pulse.store.base.RegistryStore`).

A registration and a heartbeat are each decided by one statement, token and expiry by
the store clock in its ``WHERE``; on MySQL/MariaDB by one transaction under the row's
lock (:mod:`.mysql_control`). A heartbeat that is refused is diagnosed by a read after
it (missing, replaced or expired), which decides nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from celery_pulse.errors import NotRegistered
from celery_pulse.store.base import Heartbeat, Registration, WorkerInfo
from celery_pulse.store.sql import mysql_control
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import drains, workers


def _replaced(worker_id: str) -> NotRegistered:
    return NotRegistered(f"{worker_id}: another process registered this name",
                         reason=NotRegistered.REPLACED)


class SqlRegistry:
    """The registry verbs of :class:`~.store.SqlStore`."""

    conns: Connections

    def register(self, worker_id: str, labels: Mapping[str, Any], ttl: float, *,
                 replace_live: bool = True) -> Registration:
        if not self.conns.dialect.returning:
            row = mysql_control.register(self.conns, worker_id, labels, ttl, replace_live)
        else:
            row = self._register_at_once(worker_id, labels, ttl, replace_live)
        if row is None:
            raise _replaced(worker_id)
        return Registration(worker_id, row.token, float(row.expires_at), bool(row.draining))

    def _register_at_once(self, worker_id: str, labels: Mapping[str, Any], ttl: float,
                replace_live: bool) -> Any:
        dialect, now = self.conns.dialect, self.conns.now
        drained = sa.exists().where(drains.c.worker_id == worker_id)
        stmt = dialect.insert(workers).values(
            worker_id=worker_id, token=dialect.new_token(),
            labels=json.dumps(dict(labels), sort_keys=True, default=str),
            registered_at=now, last_heartbeat=now, expires_at=now + ttl, draining=drained)
        stmt = stmt.on_conflict_do_update(
            index_elements=[workers.c.worker_id],
            set_={c: stmt.excluded[c] for c in
                  ("token", "labels", "registered_at", "last_heartbeat", "expires_at",
                   "draining")},
            where=None if replace_live else workers.c.expires_at <= now,
        ).returning(workers.c.token, workers.c.expires_at, workers.c.draining)
        with translated("register"), self.conns.single() as conn:
            return conn.execute(stmt).one_or_none()

    def set_drain(self, worker_id: str, draining: bool, who: str) -> None:
        def body(conn: sa.Connection) -> None:
            if draining:
                conn.execute(self.conns.dialect.insert_or_keep(
                    drains, dict(worker_id=worker_id, requested_by=who,
                                 requested_at=self.conns.now),
                    [drains.c.worker_id], drains.c.worker_id))
            else:
                conn.execute(sa.delete(drains).where(drains.c.worker_id == worker_id))
            conn.execute(sa.update(workers).where(workers.c.worker_id == worker_id)
                         .values(draining=draining))
        self.conns.atomic("set_drain", body)

    def heartbeat(self, worker_id: str, token: str, ttl: float) -> Heartbeat:
        if not self.conns.dialect.returning:
            got = mysql_control.heartbeat(self.conns, worker_id, token, ttl)
        else:
            got = self._heartbeat_at_once(worker_id, token, ttl)
        if isinstance(got, Heartbeat):
            return got
        if got is None:
            raise NotRegistered(f"{worker_id}: not registered", reason=NotRegistered.MISSING)
        if got.token != token and got.alive:
            raise _replaced(worker_id)
        raise NotRegistered(f"{worker_id}: registration expired", reason=NotRegistered.EXPIRED)

    def _heartbeat_at_once(self, worker_id: str, token: str, ttl: float) -> Any:
        """A :class:`Heartbeat`, or the row's (token, alive) that says why not."""
        now = self.conns.now
        stmt = (sa.update(workers)
                .where(workers.c.worker_id == worker_id, workers.c.token == token,
                       workers.c.expires_at > now)
                .values(expires_at=now + ttl, last_heartbeat=now)
                .returning(workers.c.expires_at, workers.c.draining))
        with translated("heartbeat"), self.conns.single() as conn:
            row = conn.execute(stmt).one_or_none()
            if row is not None:
                return Heartbeat(float(row.expires_at), bool(row.draining))
            # Diagnose only; the grant itself was decided by the statement above.
            return conn.execute(
                sa.select(workers.c.token, (workers.c.expires_at > now).label("alive"))
                .where(workers.c.worker_id == worker_id)).one_or_none()

    def deregister(self, worker_id: str, token: str) -> bool:
        stmt = sa.delete(workers).where(workers.c.worker_id == worker_id,
                                        workers.c.token == token)
        return self.conns.statement("deregister", stmt) > 0

    def list_workers(self) -> list[WorkerInfo]:
        now = sa.select(self.conns.now).scalar_subquery()
        stmt = sa.select(workers, (workers.c.expires_at - now).label("expires_in")
                         ).order_by(workers.c.worker_id)
        with translated("list_workers"), self.conns.read() as conn:
            rows = conn.execute(stmt).all()
        return [WorkerInfo(r.worker_id, json.loads(r.labels), float(r.registered_at),
                           float(r.last_heartbeat), float(r.expires_at), r.expires_in > 0,
                           float(r.expires_in), bool(r.draining)) for r in rows]
