"""The pulse pool: Celery's prefork pool (billiard) with leases around each task.

Built on prefork so ``-c N``, time limits, ``max_tasks_per_child`` and revoke keep
working. The module path contains "prefork" on purpose: Celery's Django fixup
looks for it to decide how to handle database connections in children.
"""

from __future__ import annotations

from typing import Any

from celery.concurrency import prefork


class TaskPool(prefork.TaskPool):
    """Prefork pool that shuts pulse down only after in-flight tasks are done."""

    #: Set by the registry step once the worker's pulse services exist.
    pulse: Any = None

    def on_stop(self) -> None:
        super().on_stop()  # waits for in-flight tasks (warm shutdown)
        self._shutdown_pulse()

    def on_terminate(self) -> None:
        super().on_terminate()
        self._shutdown_pulse()

    def _shutdown_pulse(self) -> None:
        if self.pulse is not None:
            self.pulse.shutdown()
