"""Beat's schedule and slots in SQL (``pulse_schedule``, ``pulse_beat_state``,
``pulse_beat_slots``; the contract is :class:`~celery_pulse.store.base.BeatStore`).

A slot is fired only under the leader's live term, checked in the slot's own
transaction with the term's row locked where the database has row locks (a takeover
waits until the slot is decided); the slot's unique (entry, due_at) makes a second
firing a no-op. MySQL/MariaDB's slot is in :mod:`.mysql_control`.
"""

from __future__ import annotations

import sqlalchemy as sa

from celery_pulse.store.base import ScheduleRow, Slot
from celery_pulse.store.sql import mysql_control
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import beat_slots, beat_state, leaders, schedule


class SqlBeat:
    """The beat verbs of :class:`~.store.SqlStore`."""

    conns: Connections

    def last_run(self) -> dict[str, float]:
        with translated("last_run"), self.conns.read() as conn:
            return {r.entry: float(r.last_run_at) for r in conn.execute(sa.select(beat_state))}

    def init_last_run(self, entry: str, at: float) -> float:
        stmt = self.conns.dialect.insert_or_keep(
            beat_state, dict(entry=entry, last_run_at=at), [beat_state.c.entry],
            beat_state.c.last_run_at)

        def body(conn: sa.Connection) -> float:
            conn.execute(stmt)
            return float(conn.execute(sa.select(beat_state.c.last_run_at).where(
                beat_state.c.entry == entry)).scalar_one())

        return self.conns.atomic("init_last_run", body)

    def fire_slot(self, key: str, token: str, epoch: int, slot: Slot) -> bool:
        if not self.conns.dialect.returning:
            return mysql_control.fire_slot(self.conns, key, token, epoch, slot)
        dialect, now = self.conns.dialect, self.conns.now
        term = (sa.select(leaders.c.key)
                .where(leaders.c.key == key, leaders.c.token == token, leaders.c.epoch == epoch,
                       leaders.c.lease_until > now))
        if dialect.locking_reads:
            term = term.with_for_update()  # a takeover waits until this slot is decided
        insert_slot = dialect.insert(beat_slots).values(
            entry=slot.entry, due_at=slot.due_at, task_id=slot.task_id, task=slot.task,
            payload=slot.payload, leader_epoch=epoch, created_at=now,
        ).on_conflict_do_nothing(index_elements=[beat_slots.c.entry, beat_slots.c.due_at]
                                 ).returning(beat_slots.c.entry)
        state = dialect.insert(beat_state).values(entry=slot.entry, last_run_at=slot.due_at)
        state = state.on_conflict_do_update(
            index_elements=[beat_state.c.entry],
            set_={"last_run_at": sa.case(
                (beat_state.c.last_run_at < state.excluded.last_run_at,
                 state.excluded.last_run_at), else_=beat_state.c.last_run_at)})
        with translated("fire_slot"), self.conns.engine.begin() as conn:
            if conn.execute(term).first() is None:
                return False
            inserted = conn.execute(insert_slot).first() is not None
            conn.execute(state)
        return inserted

    def mark_slot_published(self, entry: str, due_at: float) -> None:
        stmt = (sa.update(beat_slots)
                .where(beat_slots.c.entry == entry, beat_slots.c.due_at == due_at)
                .values(published_at=self.conns.now))
        self.conns.statement("mark_slot_published", stmt)  # a pause never holds its lock

    def unpublished_slots(self, limit: int = 100) -> list[Slot]:
        stmt = (sa.select(beat_slots).where(beat_slots.c.published_at.is_(None))
                .order_by(beat_slots.c.due_at).limit(limit))
        with translated("unpublished_slots"), self.conns.read() as conn:
            return [Slot(r.entry, float(r.due_at), r.task_id, r.task, r.payload)
                    for r in conn.execute(stmt)]

    def list_schedule(self) -> list[ScheduleRow]:
        with translated("list_schedule"), self.conns.read() as conn:
            return [ScheduleRow(r.name, r.task, r.kind, r.spec, r.args, r.kwargs, r.options,
                                bool(r.enabled), float(r.updated_at))
                    for r in conn.execute(sa.select(schedule).order_by(schedule.c.name))]

    def put_schedule(self, row: ScheduleRow) -> None:
        values = dict(name=row.name, task=row.task, kind=row.kind, spec=row.spec, args=row.args,
                      kwargs=row.kwargs, options=row.options, enabled=row.enabled,
                      updated_at=self.conns.now)
        stmt = self.conns.dialect.upsert(schedule, values, [schedule.c.name],
                                         [k for k in values if k != "name"])
        self.conns.atomic("put_schedule", lambda conn: conn.execute(stmt))

    def remove_schedule(self, name: str) -> bool:
        with translated("remove_schedule"), self.conns.engine.begin() as conn:
            return conn.execute(sa.delete(schedule).where(schedule.c.name == name)).rowcount > 0

    def set_schedule_enabled(self, name: str, enabled: bool) -> bool:
        stmt = (sa.update(schedule).where(schedule.c.name == name)
                .values(enabled=enabled, updated_at=self.conns.now))
        with translated("set_schedule_enabled"), self.conns.engine.begin() as conn:
            return conn.execute(stmt).rowcount > 0
