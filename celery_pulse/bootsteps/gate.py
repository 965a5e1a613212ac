"""Import shim: the consume gate moved to :mod:`celery_pulse.worker.gate`. This path keeps its
old names; ``celery_pulse.bootsteps`` holds only the worker's steps.
"""

from __future__ import annotations

from celery_pulse.worker.gate import ConsumeGate

__all__ = [
    "ConsumeGate",
]
