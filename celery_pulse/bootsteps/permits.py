"""Import shim: concurrency limits moved to :mod:`celery_pulse.worker.permits` (the
rules), :mod:`~celery_pulse.worker.permit_waits` and
:mod:`~celery_pulse.worker.permit_signals`. This path keeps its old names;
``celery_pulse.bootsteps`` holds only the worker's steps.
"""

from __future__ import annotations

from celery_pulse.limits import QUEUE_PREFIX
from celery_pulse.worker.permit_signals import SIGNAL_POLL, PermitSignals
from celery_pulse.worker.permit_waits import FIRST_RETRY, MAX_RETRY, PermitWaits
from celery_pulse.worker.permits import MAX_KEY, PermitRules

__all__ = [
    "FIRST_RETRY",
    "MAX_KEY",
    "MAX_RETRY",
    "QUEUE_PREFIX",
    "SIGNAL_POLL",
    "PermitRules",
    "PermitSignals",
    "PermitWaits",
]
