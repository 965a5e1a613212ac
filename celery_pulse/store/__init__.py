"""Store contract (:mod:`.base`) and its implementations (:mod:`.sql`, :mod:`.memory`)."""

from __future__ import annotations

from celery_pulse.store.base import Heartbeat, Registration, Store, WorkerInfo

__all__ = ["Heartbeat", "Registration", "Store", "WorkerInfo"]
