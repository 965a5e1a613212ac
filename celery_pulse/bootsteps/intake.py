"""Import shim: the intake moved to :mod:`celery_pulse.worker.intake`, the message
helpers the gateway shares to :mod:`celery_pulse.messages`. This path keeps its old
names (``install()`` reads the publication headers here); ``celery_pulse.bootsteps``
holds only the worker's steps.
"""

from __future__ import annotations

from celery_pulse.messages import (
    FIXED_PUBLICATION_HEADER,
    PUBLICATION_HEADER,
    capture,
    policy_for,
    publication_of,
)
from celery_pulse.worker.end_waiters import WAIT_POLL
from celery_pulse.worker.intake import PREFETCH_LIMIT, Intake
from celery_pulse.worker.store_health import CONTENDED_RETRY
from celery_pulse.worker.verdict import CeleryVerdict, bound_claim

__all__ = [
    "CONTENDED_RETRY",
    "FIXED_PUBLICATION_HEADER",
    "PREFETCH_LIMIT",
    "PUBLICATION_HEADER",
    "WAIT_POLL",
    "CeleryVerdict",
    "Intake",
    "bound_claim",
    "capture",
    "policy_for",
    "publication_of",
]
