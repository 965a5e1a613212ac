"""Retention in SQL: finished claims, old evidence, past permit holds and expired result
rows are deleted in batches, oldest first by nothing but their age (the contract is
:meth:`~celery_pulse.store.base.ClaimStore.purge_finished`; the loop over batches is
:func:`celery_pulse.store.retention.drain`).

Each kind is deleted by its own statement in its own transaction, so a batch never holds
a lock for long, and each is found through an index: claims by the partial
``ix_pulse_claims_finished`` (``finished_at``), evidence by its primary key (``id``
grows with ``recorded_at``), results by ``ix_pulse_results_expires``. On PostgreSQL a
batch skips claim rows another transaction has locked (``SKIP LOCKED``: a reservation
of the same task id) instead of waiting for it; the next batch takes them.
"""

from __future__ import annotations

import sqlalchemy as sa

from celery_pulse.store.base import FINISHED_STATES
from celery_pulse.store.retention import Batch, drain
from celery_pulse.store.sql import mysql_control
from celery_pulse.store.sql import permits as permits_sql
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.results import ResultRows
from celery_pulse.store.sql.tables import claims, evidence


class SqlRetention:
    """The retention verbs of :class:`~.store.SqlStore`."""

    conns: Connections
    results: ResultRows

    def purge_finished(self, older_than: float, limit: int = 500,
                       budget: float | None = None) -> int:
        return drain(lambda: self._purge_batch(older_than, limit), budget)

    def retention_lag(self, older_than: float) -> float:
        now = self.conns.now
        # The first row of ``ix_pulse_claims_finished`` in a finished state (MIN() would
        # make MariaDB read every row past retention).
        oldest = (sa.select(claims.c.finished_at)
                  .where(claims.c.state.in_(FINISHED_STATES),
                         claims.c.finished_at < now - older_than)
                  .order_by(claims.c.finished_at).limit(1).scalar_subquery())
        with translated("retention_lag"), self.conns.read() as conn:
            lag = conn.execute(sa.select(now - older_than - oldest)).scalar_one()
        return 0.0 if lag is None else max(0.0, float(lag))

    def _purge_batch(self, older_than: float, limit: int) -> Batch:
        if not self.conns.dialect.limited_subqueries:
            counts = mysql_control.purge(self.conns, older_than, limit)
        else:
            counts = self._purge_at_once(older_than, limit)
        results = self.results.purge_expired(limit)
        return counts[0], max(*counts, results) >= limit

    def _purge_at_once(self, older_than: float, limit: int) -> tuple[int, int, int]:
        now = self.conns.now
        ids = (sa.select(claims.c.task_id)
               .where(claims.c.state.in_(FINISHED_STATES),
                      claims.c.finished_at < now - older_than)
               .order_by(claims.c.finished_at).limit(limit))
        if self.conns.dialect.is_postgres:
            ids = ids.with_for_update(skip_locked=True)
        old_evidence = (sa.select(evidence.c.id).where(evidence.c.recorded_at < now - older_than)
                        .order_by(evidence.c.id).limit(limit))
        engine = self.conns.engine
        with translated("purge"):
            with engine.begin() as conn:
                deleted = conn.execute(sa.delete(claims).where(
                    claims.c.task_id.in_(ids.scalar_subquery()))).rowcount
            with engine.begin() as conn:
                stale = conn.execute(sa.delete(evidence).where(
                    evidence.c.id.in_(old_evidence.scalar_subquery()))).rowcount
            with engine.begin() as conn:
                holds = permits_sql.purge(conn, self.conns.dialect, older_than, limit)
        return int(deleted), int(stale), holds
