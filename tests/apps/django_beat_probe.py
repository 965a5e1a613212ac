"""django-celery-beat's rows as pulse's beat entries (tests/acceptance/test_django.py), in
the example project's environment: one row of each kind saved through the ORM, then the
entries pulse's beat reads, printed one ``name next-due`` line each (seconds after a
fixed time, to the millisecond; ``never`` for none)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import django

django.setup()

from django_celery_beat.models import (  # noqa: E402
    ClockedSchedule,
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
)

from celery_pulse.contrib.django.beat import DatabaseEntries  # noqa: E402
from celery_pulse.worker.schedules import next_due_function, payload  # noqa: E402

T0 = datetime(2030, 1, 1, 10, 0, 30, tzinfo=timezone.utc)  # a Tuesday
task = "example_django.orders.tasks.tick"
every = IntervalSchedule.objects.create(every=90, period="seconds")
PeriodicTask.objects.create(name="interval", task=task, interval=every, queue="q1",
                            headers='{"x": "1"}')
PeriodicTask.objects.create(name="crontab", task=task, crontab=CrontabSchedule.objects.create(
    minute="15", hour="*", timezone="UTC"))
PeriodicTask.objects.create(name="clocked", task=task, one_off=True,
                            clocked=ClockedSchedule.objects.create(
                                clocked_time=T0 + timedelta(seconds=100)))
PeriodicTask.objects.create(name="disabled", task=task, interval=every, enabled=False)
PeriodicTask.objects.create(name="one-off-done", task=task, interval=every, one_off=True,
                            total_run_count=1)
PeriodicTask.objects.create(name="later", task=task, interval=every,
                            start_time=T0 + timedelta(hours=1))

start = T0.timestamp()
for entry in DatabaseEntries(payload, next_due_function)():
    due = entry.next_due(start)
    print(entry.name, "never" if math.isinf(due) else f"{due - start:.3f}",
          "q1" in entry.payload and '"x": "1"' in entry.payload
          and '"periodic_task_name": "interval"' in entry.payload)
