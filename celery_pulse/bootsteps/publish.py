"""Import shim: republishing moved to :mod:`celery_pulse.worker.publish`. This path keeps its
old names; ``celery_pulse.bootsteps`` holds only the worker's steps.
"""

from __future__ import annotations

from celery_pulse.worker.publish import republish

__all__ = [
    "republish",
]
