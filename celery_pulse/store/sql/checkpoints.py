"""Checkpoints on the claim rows (:mod:`celery_pulse.store.checkpoints`), every database.

One transaction per batch, whatever its size: a read of the rows whose lease still
holds, skipping rows a fenced transaction holds locked (where the database has row
locks: a renewal never waits, and neither does the renewal's checkpoint), then the
writes, each still fenced by its own ``WHERE`` and kept only if newer than the row's:
on PostgreSQL and SQLite one multi-row statement for the batch
(:meth:`.batch_sql.BatchSql.checkpoint_statement`), on MySQL/MariaDB, which has no
``UPDATE .. FROM``, one statement per write in the transaction.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.checkpoints import Checkpoint, CheckpointWrite, newest
from celery_pulse.store.records import LIVE_STATES
from celery_pulse.store.sql.batch_sql import BatchSql
from celery_pulse.store.sql.claim_rows import lease_key_in
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.tables import claims

#: Rows per batch (the IN list of the read).
CHUNK = 500

c = claims.c


def write_statement(holder: str, now: Any) -> Any:
    """One fenced checkpoint write (bound as ``cp_*``), kept only if newer than the row's."""
    epoch: Any = sa.bindparam("cp_epoch")
    seq: Any = sa.bindparam("cp_seq")
    newer = sa.or_(c.checkpoint_epoch.is_(None), c.checkpoint_epoch < epoch,
                   sa.and_(c.checkpoint_epoch == epoch, c.checkpoint_seq < seq))
    return (sa.update(claims)
            .where(c.task_id == sa.bindparam("cp_task"), c.epoch == epoch,
                   c.token == sa.bindparam("cp_token"), c.holder == holder,
                   # no IN list: its expanding parameter cannot go in an executemany
                   sa.or_(*(c.state == state for state in LIVE_STATES)),
                   c.lease_until > now, newer)
            .values(checkpoint=sa.bindparam("cp_value"), checkpoint_epoch=epoch,
                    checkpoint_seq=seq, checkpoint_at=now))


def params(write: CheckpointWrite) -> dict[str, Any]:
    """:func:`write_statement`'s parameters for ``write``."""
    return {"cp_task": write.task_id, "cp_epoch": write.epoch, "cp_token": write.token,
            "cp_seq": write.seq, "cp_value": write.value}


class SqlCheckpoints:
    """The checkpoint verbs of :class:`~.store.SqlStore`."""

    conns: Connections
    dialect: Dialect

    @functools.cached_property
    def _batch(self) -> BatchSql | None:
        """The multi-row statements, where the database has ``UPDATE .. FROM``."""
        return BatchSql(self.dialect) if self.dialect.returning else None

    def checkpoint(self, holder: str, writes: Sequence[CheckpointWrite]
                   ) -> tuple[set[str], set[str]]:
        chosen = newest(writes)
        held: set[str] = set()
        busy: set[str] = set()
        for i in range(0, len(chosen), CHUNK):
            chunk = chosen[i:i + CHUNK]

            def body(conn: sa.Connection, chunk: Sequence[CheckpointWrite] = chunk
                     ) -> tuple[set[str], set[str]]:
                return self._write(conn, holder, chunk)

            got, locked = self.conns.atomic("checkpoint", body)
            held |= got
            busy |= locked
        return held, busy

    def _write(self, conn: sa.Connection, holder: str, chunk: Sequence[CheckpointWrite]
               ) -> tuple[set[str], set[str]]:
        now = self.conns.now

        def live(keys: Sequence[CheckpointWrite]) -> Any:
            return sa.select(c.task_id).where(
                c.holder == holder, lease_key_in([w.key for w in keys]),
                c.state.in_(LIVE_STATES), c.lease_until > now)

        skips = self.dialect.locking_reads
        query = live(chunk).with_for_update(skip_locked=True) if skips else live(chunk)
        got = set(conn.execute(query).scalars())
        missing = [w for w in chunk if w.task_id not in got]
        busy = set(conn.execute(live(missing)).scalars()) if missing and skips else set()
        todo = [w for w in chunk if w.task_id in got]
        if todo and self._batch is not None:
            conn.exec_driver_sql(*self._batch.checkpoint_statement(holder, todo))
        elif todo:
            conn.execute(write_statement(holder, now), [params(w) for w in todo])
        return got, busy

    def last_checkpoint(self, task_id: str) -> Checkpoint | None:
        with self.conns.reading("last_checkpoint") as conn:
            row = conn.execute(
                sa.select(c.checkpoint, c.checkpoint_epoch, c.checkpoint_at)
                .where(c.task_id == task_id)).first()
        if row is None or row.checkpoint is None or row.checkpoint_epoch is None:
            return None
        return Checkpoint.of(row.checkpoint, row.checkpoint_epoch, row.checkpoint_at or 0.0)
