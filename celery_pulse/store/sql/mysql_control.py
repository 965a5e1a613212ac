"""The control plane's statements that MySQL/MariaDB writes its own way.

Elsewhere a registration, a heartbeat, a leader's term or a beat slot is decided by one
statement (``INSERT .. ON CONFLICT .. DO UPDATE .. WHERE .. RETURNING``, ``UPDATE ..
RETURNING``). MySQL has neither the guarded upsert nor ``RETURNING``: each is one
transaction (:meth:`~.connections.Connections.atomic`, run again after a deadlock) that
reads the row ``FOR UPDATE`` with the store clock's verdict, decides, writes, and reads
back what it wrote under the same lock. The parts of the store call these when their
dialect has no ``returning`` (:attr:`~.dialect.Dialect.returning`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.base import FINISHED_STATES, Heartbeat, Slot
from celery_pulse.store.sql import permits as permits_sql
from celery_pulse.store.sql.claim_rows import dumps
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.tables import beat_slots, beat_state, claims, drains, evidence, leaders, workers


# -- worker registry ------------------------------------------------------------------------
def register(conns: Connections, worker_id: str, labels: Mapping[str, Any], ttl: float,
             replace_live: bool) -> Any:
    """The registration's (token, expires_at, draining), or None: a live one holds the name."""
    now = conns.now
    drained = sa.exists().where(drains.c.worker_id == worker_id)
    values = dict(token=conns.dialect.new_token(),
                  labels=dumps(labels), registered_at=now, last_heartbeat=now,
                  expires_at=now + ttl, draining=drained)

    def body(conn: sa.Connection) -> Any:
        current = conn.execute(
            sa.select(workers.c.token, (workers.c.expires_at <= now).label("expired"))
            .where(workers.c.worker_id == worker_id).with_for_update()).one_or_none()
        if current is None:
            conn.execute(sa.insert(workers).values(worker_id=worker_id, **values))
        elif replace_live or current.expired:
            conn.execute(sa.update(workers).where(workers.c.worker_id == worker_id)
                         .values(**values))
        else:
            return None
        return conn.execute(sa.select(workers.c.token, workers.c.expires_at,
                                      workers.c.draining)
                            .where(workers.c.worker_id == worker_id)).one()

    return conns.atomic("register", body)


def heartbeat(conns: Connections, worker_id: str, token: str, ttl: float) -> Any:
    """A :class:`Heartbeat`, or the row's (token, alive) that says why not (None: no row)."""
    now = conns.now

    def body(conn: sa.Connection) -> Any:
        # One statement decides (the row is locked by it); read back under that lock.
        if conn.execute(sa.update(workers).where(
                workers.c.worker_id == worker_id, workers.c.token == token,
                workers.c.expires_at > now).values(
                expires_at=now + ttl, last_heartbeat=now)).rowcount:
            row = conn.execute(sa.select(workers.c.expires_at, workers.c.draining).where(
                workers.c.worker_id == worker_id)).one()
            return Heartbeat(float(row.expires_at), bool(row.draining))
        return conn.execute(
            sa.select(workers.c.token, (workers.c.expires_at > now).label("alive"))
            .where(workers.c.worker_id == worker_id)).one_or_none()

    return conns.atomic("heartbeat", body)


# -- retention ------------------------------------------------------------------------------
def purge(conns: Connections, older_than: float, limit: int) -> tuple[int, int, int]:
    """Finished claims, old evidence and past permit holds, ``limit`` of each, each in a
    transaction of its own."""
    now = conns.now

    def old_claims(conn: sa.Connection) -> int:
        # MySQL takes no LIMIT in an IN subquery; a single-table DELETE takes one.
        return int(conn.execute(
            sa.delete(claims).where(claims.c.state.in_(FINISHED_STATES),
                                    claims.c.finished_at < now - older_than)
            .with_dialect_options(mysql_limit=limit)).rowcount)

    def old_evidence(conn: sa.Connection) -> int:
        return int(conn.execute(sa.delete(evidence).where(evidence.c.recorded_at < now - older_than)
                                .with_dialect_options(mysql_limit=limit)).rowcount)

    return (conns.atomic("purge", old_claims), conns.atomic("purge", old_evidence),
            conns.atomic("purge", lambda conn: permits_sql.purge(conn, conns.dialect,
                                                                 older_than, limit)))


# -- leader election and beat ---------------------------------------------------------------
def try_acquire(conns: Connections, key: str, holder: str, ttl: float, token: str | None
                ) -> Any:
    """The term's (holder, token, epoch, lease_until), or None: another holds it."""
    now = conns.now
    new_token = conns.dialect.new_token

    def body(conn: sa.Connection) -> Any:
        row = conn.execute(
            sa.select(leaders.c.token, (leaders.c.lease_until <= now).label("expired"))
            .where(leaders.c.key == key).with_for_update()).one_or_none()
        if row is None:
            conn.execute(sa.insert(leaders).values(
                key=key, holder=holder, token=new_token(), epoch=1,
                lease_until=now + ttl, acquired_at=now))
        elif token is not None and row.token == token:  # our term: extend it
            conn.execute(sa.update(leaders).where(leaders.c.key == key).values(
                holder=holder, lease_until=now + ttl))
        elif row.expired:  # a new term
            conn.execute(sa.update(leaders).where(leaders.c.key == key).values(
                holder=holder, token=new_token(), epoch=leaders.c.epoch + 1,
                lease_until=now + ttl, acquired_at=now))
        else:
            return None
        return conn.execute(sa.select(leaders.c.holder, leaders.c.token, leaders.c.epoch,
                                      leaders.c.lease_until)
                            .where(leaders.c.key == key)).one()

    return conns.atomic("try_acquire", body)


def fire_slot(conns: Connections, key: str, token: str, epoch: int, slot: Slot) -> bool:
    """Record ``slot`` under the term (token, epoch), if it is still live."""
    now = conns.now
    # The term's row stays locked until the slot is decided: a takeover waits.
    term = (sa.select(leaders.c.key)
            .where(leaders.c.key == key, leaders.c.token == token, leaders.c.epoch == epoch,
                   leaders.c.lease_until > now).with_for_update())
    state = conns.dialect.insert(beat_state).values(entry=slot.entry, last_run_at=slot.due_at)
    state = state.on_duplicate_key_update(last_run_at=sa.func.greatest(
        beat_state.c.last_run_at, state.inserted.last_run_at))

    def body(conn: sa.Connection) -> bool:
        if conn.execute(term).first() is None:
            return False
        exists = conn.execute(sa.select(beat_slots.c.entry).where(
            beat_slots.c.entry == slot.entry, beat_slots.c.due_at == slot.due_at
        ).with_for_update()).first()
        if exists is None:
            conn.execute(sa.insert(beat_slots).values(
                entry=slot.entry, due_at=slot.due_at, task_id=slot.task_id,
                task=slot.task, payload=slot.payload, leader_epoch=epoch, created_at=now))
        conn.execute(state)
        return exists is None

    return conns.atomic("fire_slot", body)
