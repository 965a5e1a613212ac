"""The class ``-P pulse`` names: the pulse pool, refusing an app without pulse's steps.

Its own module for two readers of the pool class's module path: Celery's banner shows
the last part (``concurrency: 2 (pulse_prefork)``, not a plain ``(prefork)`` that
looks like a worker without pulse), and Django's fixup looks for "prefork" anywhere
in it to close database connections in pool children as it does for prefork.
"""

from __future__ import annotations

import sys
from typing import Any

from celery_pulse.install import NOT_INSTALLED, installed
from celery_pulse.pool import prefork
from celery_pulse.worker.exit_codes import EXIT_CONFIG


class TaskPool(prefork.TaskPool):
    """The pulse pool (:class:`celery_pulse.pool.prefork.TaskPool`), built only for an
    app that ran ``celery_pulse.install(app)``.

    Without the steps ``install`` adds, nothing would reserve, lease or register:
    the worker would run plain prefork under a pulse name and say nothing. Celery builds
    the pool before any step of ours could notice, so the pool refuses: one line on
    stderr and exit code 78 (EX_CONFIG), like any other configuration error.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = kwargs.get("app")
        if app is not None and not installed(app):
            # Logging may not be set up yet: one plain line, no traceback.
            print(f"celery-pulse: cannot start: {NOT_INSTALLED}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_CONFIG)
        super().__init__(*args, **kwargs)
