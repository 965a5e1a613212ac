"""App module template for :class:`PulseWorkerContainer` (pytest-celery fills its placeholders).

pytest-celery replaces the ``imports = None``, ``app = Celery(...)`` and
``config = None`` lines with the test's task modules, app name and configuration, and
copies this file into the container as ``app.py``.
"""

from __future__ import annotations

from celery import Celery

import celery_pulse

imports = None

app = Celery("celery_test_app")
config = None

if config:
    app.config_from_object(config)

celery_pulse.install(app)

if __name__ == "__main__":
    app.start()
