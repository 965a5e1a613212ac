"""Import shim: the delivery screen moved to :mod:`celery_pulse.worker.screen`. This path keeps its
old names; ``celery_pulse.bootsteps`` holds only the worker's steps.
"""

from __future__ import annotations

from celery_pulse.worker.screen import (
    MAX_ID,
    MAX_NAME,
    name_problem,
    problem,
    reject,
    shown_id,
)

__all__ = [
    "MAX_ID",
    "MAX_NAME",
    "name_problem",
    "problem",
    "reject",
    "shown_id",
]
