"""Import shim: the loop caller moved to :mod:`celery_pulse.worker.loop`. This path keeps its
old names; ``celery_pulse.bootsteps`` holds only the worker's steps.
"""

from __future__ import annotations

from celery_pulse.worker.loop import STALE, LoopCaller

__all__ = [
    "STALE",
    "LoopCaller",
]
