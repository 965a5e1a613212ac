"""Celery schedules -> beat :class:`~celery_pulse.beat.Entry` objects.

Static entries come from ``app.conf.beat_schedule``; dynamic ones from the
``pulse_schedule`` table (``celery pulse schedule add``); with django-celery-beat's
``DatabaseScheduler`` as ``beat_scheduler``, its ``PeriodicTask`` rows too
(:mod:`celery_pulse.contrib.django.beat`). Any Celery schedule
(``schedule``, ``crontab``, ``solar``) works: its own arithmetic decides the next
due time, evaluated with "now" pinned to the previous due time, so every leader
computes the same slot from the same ``last_run_at``.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import schedules

from celery_pulse.beat import Entry
from celery_pulse.errors import InvalidConfig
from celery_pulse.messages import FIXED_PUBLICATION_HEADER
from celery_pulse.store.base import ScheduleRow, Slot

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.schedules")

SCHEDULE_KINDS = ("interval", "crontab")
#: Due times are stored to the millisecond: the shortest period that still advances.
MIN_PERIOD = 0.001


def next_due_function(schedule: Any) -> Any:
    def next_due(after: float) -> float:
        if isinstance(schedule, schedules.schedule) and not isinstance(
                schedule, (schedules.crontab, schedules.solar)) and not schedule.relative:
            # Due times are kept to the millisecond: never round back onto ``after``.
            return float(round(after + max(schedule.run_every.total_seconds(), MIN_PERIOD), 3))
        after_dt = datetime.fromtimestamp(after, tz=timezone.utc)
        saved = schedule.nowfun
        schedule.nowfun = lambda: after_dt
        try:
            remaining = schedule.remaining_estimate(after_dt)
        finally:
            schedule.nowfun = saved
        if remaining <= timedelta(0):  # never return a time at or before ``after``
            remaining = timedelta(seconds=1)
        return float(round(after + remaining.total_seconds(), 3))
    return next_due


def _as_schedule(value: Any) -> Any:
    if isinstance(value, (int, float)):
        return schedules.schedule(timedelta(seconds=value))
    if isinstance(value, timedelta):
        return schedules.schedule(value)
    return value


def payload(args: Any, kwargs: Any, options: Any) -> str:
    return json.dumps({"args": list(args or ()), "kwargs": dict(kwargs or {}),
                       "options": dict(options or {})}, sort_keys=True, default=str)


def static_entries(app: Any) -> list[Entry]:
    out = []
    for name, spec in (app.conf.beat_schedule or {}).items():
        schedule = _as_schedule(spec["schedule"])
        out.append(Entry(name, spec["task"], payload(spec.get("args"), spec.get("kwargs"),
                                                     spec.get("options")),
                         next_due_function(schedule)))
    return out


def schedule_from_row(kind: str, spec: dict[str, Any]) -> Any:
    """Build (and so validate) a dynamic entry's schedule."""
    if kind == "interval":
        every = float(spec["every"])
        if not math.isfinite(every) or every < MIN_PERIOD:
            raise InvalidConfig(f"interval schedule: 'every' must be a finite number of "
                                f"seconds >= {MIN_PERIOD:g}, got {every!r}")
        return schedules.schedule(timedelta(seconds=every))
    if kind == "crontab":
        return schedules.crontab(**spec)
    raise InvalidConfig(f"unknown schedule kind {kind!r}; use one of {SCHEDULE_KINDS}")


def dynamic_entries(rows: list[ScheduleRow]) -> list[Entry]:
    out = []
    for row in rows:
        if not row.enabled:
            continue
        try:
            schedule = schedule_from_row(row.kind, json.loads(row.spec))
            spec = payload(json.loads(row.args), json.loads(row.kwargs),
                           json.loads(row.options))
        except Exception as exc:  # a bad row never takes the scheduler down
            logger.error("pulse: skipping malformed schedule entry %r: %s", row.name, exc)
            continue
        out.append(Entry(row.name, row.task, spec, next_due_function(schedule)))
    return out


class EntrySource:
    """Static, dynamic and django-celery-beat entries (a name appears once, in that
    order of precedence); all but the static ones re-read on every call."""

    def __init__(self, app: Any, store: Any) -> None:
        self.static = static_entries(app)
        self.store = store
        self.database: Any = None
        if uses_database_scheduler(app):
            from celery_pulse.contrib.django.beat import DatabaseEntries

            self.database = DatabaseEntries(payload, next_due_function)

    def __call__(self) -> list[Entry]:
        entries = list(self.static)
        names = {e.name for e in entries}
        more = dynamic_entries(self.store.list_schedule())
        if self.database is not None:
            more += self.database()
        for entry in more:
            if entry.name not in names:
                names.add(entry.name)
                entries.append(entry)
        return entries

    def published(self, slot: Slot) -> None:
        """After a slot went out: its source's bookkeeping (django-celery-beat's row)."""
        if self.database is not None:
            self.database.published(slot)


def uses_database_scheduler(app: Any) -> bool:
    """Whether ``beat_scheduler`` is django-celery-beat's ``DatabaseScheduler``."""
    from celery_pulse.contrib.django.beat import uses_database_scheduler as uses

    return uses(app)


def publisher(app: Any, after: Any = None) -> Any:
    """Publish a slot under its own task id and publication: a slot re-published by the
    next leader (its first publish not marked) is a duplicate of the first, not a new run.
    ``after(slot)``: called once it went out (a source's bookkeeping)."""
    def publish(slot: Slot) -> None:
        spec = json.loads(slot.payload)
        options = dict(spec["options"])
        options["headers"] = {**(options.get("headers") or {}),
                              FIXED_PUBLICATION_HEADER: f"slot:{slot.task_id}"[:64]}
        app.send_task(slot.task, args=spec["args"], kwargs=spec["kwargs"], task_id=slot.task_id,
                      **options)
        if after is not None:
            after(slot)
    return publish
