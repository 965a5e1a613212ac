"""django-celery-beat's schedules under pulse's leader-elected beat.

With ``beat_scheduler`` set to django-celery-beat's ``DatabaseScheduler`` (Django:
``CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"``), the
leader reads its ``PeriodicTask`` rows on every tick, so an edit in Django's admin is
picked up within one tick. Each enabled row becomes one of the beat's entries
(:class:`celery_pulse.beat.Entry`), so it fires under the same rules as
``beat_schedule``: every slot once, whichever worker leads, and across a failover.
Slots are recorded in pulse's store, not in the row.

* **Schedules**: interval, crontab (in its own time zone), solar and clocked, each
  through the model's own Celery schedule. A clocked task fires once at its time.
  ``start_time`` holds slots back until it; a row past its ``expires`` is disabled,
  as django-celery-beat does.
* **Options** as django-celery-beat sends them: ``queue``, ``exchange``,
  ``routing_key``, ``priority``, ``expire_seconds``, and its ``headers`` with
  ``periodic_task_name``.
* **Bookkeeping** after each publish, for the admin to show: ``last_run_at`` and
  ``total_run_count`` are updated, and a ``one_off`` row is disabled. This is best
  effort: the slot itself is pulse's. A one-off row that has run (``total_run_count``
  above 0) never fires again.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery_pulse.beat import Entry
from celery_pulse.store.base import Slot

logger = logging.getLogger("celery_pulse.bootsteps.schedules")

#: The scheduler names that mean django-celery-beat's database (Celery's ``-S django``).
DATABASE_SCHEDULERS = frozenset({"django", "django_celery_beat.schedulers:DatabaseScheduler",
                                 "django_celery_beat.schedulers.DatabaseScheduler"})


def uses_database_scheduler(app: Any) -> bool:
    return str(app.conf.beat_scheduler or "") in DATABASE_SCHEDULERS


class DatabaseEntries:
    """The enabled ``PeriodicTask`` rows as beat entries (one query per call)."""

    def __init__(self, payload: Callable[[Any, Any, Any], str],
                 next_due: Callable[[Any], Callable[[float], float]]) -> None:
        self.payload, self.next_due = payload, next_due

    def __call__(self) -> list[Entry]:
        import django
        from django.apps import apps
        from django.db import close_old_connections

        if not apps.ready:  # `celery pulse beat`: Celery's Django fixup may not have run
            django.setup()
        from django_celery_beat.models import PeriodicTask

        close_old_connections()  # the beat's thread: a connection the server dropped
        rows = PeriodicTask.objects.filter(enabled=True).select_related(
            "interval", "crontab", "solar", "clocked")
        out = []
        for row in rows:
            try:
                entry = self._entry(row)
            except Exception as exc:  # a bad row never takes the scheduler down
                logger.error("pulse: skipping django-celery-beat task %r: %s", row.name, exc)
                continue
            if entry is not None:
                out.append(entry)
        return out

    def _entry(self, row: Any) -> Entry | None:
        if row.one_off and row.total_run_count:
            return None
        if row.expires is not None and _now() >= row.expires:
            type(row).objects.filter(pk=row.pk).update(enabled=False)
            return None
        if row.clocked is not None:
            next_due = _once_at(row.clocked.clocked_time.timestamp())
        else:
            next_due = self.next_due(row.schedule)
        if row.start_time is not None:
            next_due = _not_before(row.start_time.timestamp(), next_due,
                                   at_start=row.interval is not None)
        options: dict[str, Any] = {k: getattr(row, k) for k in
                                   ("queue", "exchange", "routing_key", "priority")
                                   if getattr(row, k) is not None}
        if row.expire_seconds is not None:
            options["expires"] = row.expire_seconds
        options["headers"] = {**json.loads(row.headers or "{}"), "periodic_task_name": row.name}
        return Entry(row.name, row.task, self.payload(json.loads(row.args or "[]"),
                                                      json.loads(row.kwargs or "{}"), options),
                     next_due)

    def published(self, slot: Slot) -> None:
        """The row's bookkeeping after a slot of it went out (best effort)."""
        from django.db import DatabaseError
        from django.db.models import F
        from django_celery_beat.models import PeriodicTask, PeriodicTasks

        try:
            changes: dict[str, Any] = {"last_run_at": datetime.fromtimestamp(
                slot.due_at, timezone.utc), "total_run_count": F("total_run_count") + 1}
            rows = PeriodicTask.objects.filter(name=slot.entry)
            if rows.filter(one_off=True).exists():
                changes["enabled"] = False
            # .update(): no save() signal, so django-celery-beat's change counter (which
            # its own scheduler watches) is not bumped for bookkeeping; bumped for a
            # one-off disabled, as its scheduler does.
            rows.update(**changes)
            if "enabled" in changes:
                PeriodicTasks.update_changed()
        except DatabaseError as exc:
            logger.warning("pulse: django-celery-beat bookkeeping of %s failed: %s",
                           slot.entry, exc)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _once_at(at: float) -> Callable[[float], float]:
    """A clocked schedule: due at ``at``, then never."""
    def next_due(after: float) -> float:
        return at if after < at else math.inf
    return next_due


def _not_before(start: float, every: Callable[[float], float], *, at_start: bool
                ) -> Callable[[float], float]:
    """Slots from ``start`` on (django-celery-beat's ``start_time``): an interval's first
    at ``start`` itself, as django-celery-beat runs it; another schedule's first match at
    or after it."""
    def next_due(after: float) -> float:
        if after < start:
            return round(start, 3) if at_start else every(start - 1e-3)
        return every(after)
    return next_due
