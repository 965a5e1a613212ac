"""Who holds a task now: one primary-key read of its claim, for log lines only.

A stale attempt's log says which worker and epoch took the task over (the attempt
itself knows only its own). Nothing decides anything on this answer: by the time it is
printed it may have changed again.
"""

from __future__ import annotations

import dataclasses

import sqlalchemy as sa

from celery_pulse.store.sql.errors import translated
from celery_pulse.store.sql.tables import claims


@dataclasses.dataclass(frozen=True, slots=True)
class Holding:
    holder: str | None
    epoch: int
    state: str


def holding_of(engine: sa.Engine, task_id: str) -> Holding | None:
    """The claim's holder, epoch and state now; None when there is no claim row."""
    stmt = sa.select(claims.c.holder, claims.c.epoch, claims.c.state).where(
        claims.c.task_id == task_id)
    with translated("holding_of"), engine.connect() as conn:
        row = conn.execute(stmt).first()
    return None if row is None else Holding(row.holder, int(row.epoch), row.state)
