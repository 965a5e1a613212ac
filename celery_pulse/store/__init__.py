"""The store: its contracts (:mod:`.contracts`), their records (:mod:`.records`), the
I/O shapes a store hands back (:mod:`.channels`) and the claim rules stores decide in
Python (:mod:`.rules`); :mod:`.base` gathers the first three under their old name. The
implementations: SQL (:mod:`.sql`) and memory (:mod:`.memory`)."""

from __future__ import annotations

from celery_pulse.store.base import Heartbeat, Registration, Store, WorkerInfo

__all__ = ["Heartbeat", "Registration", "Store", "WorkerInfo"]
