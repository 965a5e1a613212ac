"""Import shim: beat's Celery schedules moved to :mod:`celery_pulse.worker.schedules`.
This path keeps its old names; ``celery_pulse.bootsteps`` holds only the worker's steps.
"""

from __future__ import annotations

from celery_pulse.worker.schedules import (
    MIN_PERIOD,
    SCHEDULE_KINDS,
    EntrySource,
    dynamic_entries,
    next_due_function,
    publisher,
    schedule_from_row,
    static_entries,
)

__all__ = [
    "MIN_PERIOD",
    "SCHEDULE_KINDS",
    "EntrySource",
    "dynamic_entries",
    "next_due_function",
    "publisher",
    "schedule_from_row",
    "static_entries",
]
