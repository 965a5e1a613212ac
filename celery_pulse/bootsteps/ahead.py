"""Import shim: starts ahead of the pool moved to :mod:`celery_pulse.worker.ahead`. This path keeps its
old names; ``celery_pulse.bootsteps`` holds only the worker's steps.
"""

from __future__ import annotations

from celery_pulse.worker.ahead import (
    ALPHA,
    MAX_AHEAD,
    WINDOW,
    StartAhead,
)

__all__ = [
    "ALPHA",
    "MAX_AHEAD",
    "WINDOW",
    "StartAhead",
]
