"""celery-pulse: lease-based Celery workers, judged by the store's clock.

``install(app)`` is the whole integration; see ``DESIGN.md`` for the contract.
"""

from __future__ import annotations

from celery_pulse.errors import (
    Contended,
    InvalidConfig,
    LeaseLost,
    Moved,
    NeedsReview,
    NotFound,
    NotRegistered,
    PulseError,
    SchemaMissing,
    StoreUnavailable,
    Taken,
    Terminal,
)
from celery_pulse.inprocess import InProcessLease, current_lease
from celery_pulse.install import install
from celery_pulse.lease import Lease
from celery_pulse.settings import Settings
from celery_pulse.store.checkpoints import Checkpoint, CheckpointTooLarge

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointTooLarge",
    "Contended",
    "InProcessLease",
    "InvalidConfig",
    "Lease",
    "LeaseLost",
    "Moved",
    "NeedsReview",
    "NotFound",
    "NotRegistered",
    "PulseError",
    "SchemaMissing",
    "Settings",
    "StoreUnavailable",
    "Taken",
    "Terminal",
    "__version__",
    "current_lease",
    "install",
]
