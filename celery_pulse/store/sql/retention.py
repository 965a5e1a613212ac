"""Retention in SQL: finished claims, old evidence, past permit holds and expired result
rows are deleted in batches, oldest first by nothing but their age (the contract is
:meth:`~celery_pulse.store.base.ClaimStore.purge_finished`)."""

from __future__ import annotations

import sqlalchemy as sa

from celery_pulse.store.base import FINISHED_STATES
from celery_pulse.store.sql import mysql_control
from celery_pulse.store.sql import permits as permits_sql
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.results import ResultRows
from celery_pulse.store.sql.tables import claims, evidence


class SqlRetention:
    """The retention verb of :class:`~.store.SqlStore`."""

    conns: Connections
    results: ResultRows

    def purge_finished(self, older_than: float, limit: int = 500) -> int:
        if not self.conns.dialect.limited_subqueries:
            deleted = mysql_control.purge(self.conns, older_than, limit)
        else:
            deleted = self._purge_at_once(older_than, limit)
        self.results.purge_expired(limit)
        return deleted

    def _purge_at_once(self, older_than: float, limit: int) -> int:
        now = self.conns.now
        ids = (sa.select(claims.c.task_id)
               .where(claims.c.state.in_(FINISHED_STATES),
                      claims.c.finished_at < now - older_than)
               .limit(limit).scalar_subquery())
        old_evidence = (sa.select(evidence.c.id).where(evidence.c.recorded_at < now - older_than)
                        .limit(limit).scalar_subquery())
        with translated("purge"), self.conns.engine.begin() as conn:
            deleted = conn.execute(sa.delete(claims).where(claims.c.task_id.in_(ids))).rowcount
            conn.execute(sa.delete(evidence).where(evidence.c.id.in_(old_evidence)))
            permits_sql.purge(conn, self.conns.dialect, older_than, limit)
        return int(deleted)
