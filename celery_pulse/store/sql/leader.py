"""Leader election in SQL (``pulse_leaders``; the contract is
:class:`~celery_pulse.store.base.LeaderStore`).

A term is taken or extended by one upsert whose ``WHERE`` carries the rule: the lease
expired by the store clock, or the caller presents the term's own token (a renewal
keeps token, epoch and ``acquired_at``; a new term gets a fresh token and epoch + 1).
On MySQL/MariaDB the same rule is decided under the row's lock (:mod:`.mysql_control`).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_pulse.store.base import LeaderGrant, LeaderInfo
from celery_pulse.store.sql import mysql_control
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import leaders


class SqlLeader:
    """The leader verbs of :class:`~.store.SqlStore`."""

    conns: Connections

    def try_acquire(self, key: str, holder: str, ttl: float, token: str | None = None
                    ) -> LeaderGrant | None:
        if not self.conns.dialect.returning:
            row = mysql_control.try_acquire(self.conns, key, holder, ttl, token)
        else:
            row = self._acquire_at_once(key, holder, ttl, token)
        if row is None:
            return None
        return LeaderGrant(key, row.holder, row.token, int(row.epoch), float(row.lease_until))

    def _acquire_at_once(self, key: str, holder: str, ttl: float, token: str | None) -> Any:
        dialect, now = self.conns.dialect, self.conns.now
        stmt = dialect.insert(leaders).values(
            key=key, holder=holder, token=dialect.new_token(), epoch=1,
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
        with translated("try_acquire"), self.conns.single() as conn:
            return conn.execute(stmt).one_or_none()

    def release_leader(self, key: str, token: str) -> bool:
        stmt = (sa.update(leaders).where(leaders.c.key == key, leaders.c.token == token)
                .values(lease_until=self.conns.now))
        return self.conns.statement("release_leader", stmt) > 0

    def get_leader(self, key: str) -> LeaderInfo | None:
        now = sa.select(self.conns.now).scalar_subquery()
        stmt = sa.select(leaders, (leaders.c.lease_until - now).label("remaining")).where(
            leaders.c.key == key)
        with translated("get_leader"), self.conns.read() as conn:
            r = conn.execute(stmt).one_or_none()
        if r is None:
            return None
        return LeaderInfo(key, r.holder, int(r.epoch), r.remaining > 0, float(r.remaining),
                          float(r.acquired_at))
