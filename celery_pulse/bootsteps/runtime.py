"""Worker step: read settings and open the store once, failing the start loudly.

It runs when the worker is built (before any message is consumed) and only when
the worker's pool is the pulse pool. A bad setting, an unreachable store or a
missing schema ends the process with one line naming the setting or the command
to run, and exit code 78 (EX_CONFIG).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from celery import bootsteps
from kombu.utils.imports import symbol_by_name

from celery_pulse.errors import PulseError
from celery_pulse.settings import Settings
from celery_pulse.store.sql import open_store

logger = logging.getLogger(__name__)

EXIT_CONFIG = 78
EXIT_IDENTITY_LOST = 3


def uses_pulse_pool(worker: Any) -> bool:
    """True if ``worker`` runs the pulse pool (class or alias)."""
    from celery import concurrency

    from celery_pulse.pool.prefork import TaskPool

    pool_cls = worker.pool_cls
    if isinstance(pool_cls, str):
        try:
            pool_cls = symbol_by_name(pool_cls, concurrency.ALIASES)
        except (ImportError, AttributeError, ValueError):
            return False
    return isinstance(pool_cls, type) and issubclass(pool_cls, TaskPool)


class PulseWorker:
    """What one worker process holds: settings, store, and the services the steps start."""

    def __init__(self, settings: Settings, store: Any) -> None:
        self.settings = settings
        self.store = store
        self.membership: Any = None
        self.gate: Any = None
        self._shut = False

    def shutdown(self) -> None:
        """Called after in-flight tasks have finished (pool stopped): deregister."""
        if self._shut:
            return
        self._shut = True
        if self.membership is not None:
            self.membership.stop(deregister=True)


class Runtime(bootsteps.StartStopStep):
    """Builds ``worker.pulse`` (a :class:`PulseWorker`) or stops the process."""

    label = "pulse"
    requires = ("celery.worker.components:Pool",)

    def include_if(self, w: Any) -> bool:
        return uses_pulse_pool(w)

    def create(self, w: Any) -> Any:
        try:
            settings = Settings.from_conf(w.app.conf)
            store = open_store(settings.store_url, settings.store_connect_timeout)
        except PulseError as exc:
            # Logging may not be set up yet: one plain line on stderr, no traceback.
            print(f"celery-pulse: cannot start: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_CONFIG) from None
        w.pulse = PulseWorker(settings, store)
        return self

    def start(self, w: Any) -> None:
        pass

    def stop(self, w: Any) -> None:
        pulse = getattr(w, "pulse", None)
        if pulse is not None:
            pulse.shutdown()

    def terminate(self, w: Any) -> None:
        self.stop(w)
