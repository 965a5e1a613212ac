"""The app module of a local pytest-celery worker (``celery -A`` this module).

The test process writes a spec (``PULSE_PYTEST_WORKER_SPEC``: a pickle file) with the
app to run and its configuration as the test's app has it; this module rebuilds that
app in the worker process. Either the test's app is importable by name (a module-level
app of the user's project: that module is imported, so its ``@app.task`` tasks are
registered) or a fresh app of the same name is made. Then the test's configuration is
applied over it, the task and signal modules are imported, and pulse is installed.
"""

from __future__ import annotations

import importlib
import os
import pickle
from typing import Any

from celery import Celery
from celery.utils.imports import symbol_by_name

import celery_pulse

SPEC_ENV = "PULSE_PYTEST_WORKER_SPEC"


def build(spec: dict[str, Any]) -> Celery:
    app: Celery
    if spec.get("app_ref"):
        app = symbol_by_name(spec["app_ref"])
    else:
        app = Celery(spec["main"], set_as_current=True)
    app.conf.update(spec["config"])
    for module in spec.get("modules", ()):
        importlib.import_module(module)
    celery_pulse.install(app)
    return app


def _load() -> Celery:
    path = os.environ.get(SPEC_ENV)
    if not path:
        raise RuntimeError(f"{SPEC_ENV} is not set: this module is started by "
                           "celery_pulse.contrib.pytest_celery, not by hand")
    with open(path, "rb") as f:
        spec = pickle.load(f)
    return build(spec)


_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """``app`` is built on first use (``celery -A``), so importing this module is free."""
    global _app
    if name == "app":
        if _app is None:
            _app = _load()
        return _app
    raise AttributeError(name)
