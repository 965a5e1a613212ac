"""The app the external worker loads: Celery's t/integration session app, plus pulse.

It mirrors what ``celery.contrib.pytest``'s ``celery_session_app`` builds from
t/integration/conftest.py, so the worker and the test process agree on every
setting a test can observe:

* ``TestApp``'s defaults (``DEFAULT_TEST_CONFIG``: json only, UTC, no heartbeat, ...);
* the conftest's ``celery_config`` (broker/backend from TEST_BROKER / TEST_BACKEND,
  ``result_extended``, the cassandra keys, ``task_create_missing_queues=False``);
* its ``celery_includes`` (``t.integration.tasks``) and ``celery_class_tasks``
  (``ClassBasedAutoRetryTask``), and ``celery.contrib.testing.tasks`` (``celery.ping``).

``python -m celery_suite run`` sets the environment (TEST_BROKER, TEST_BACKEND,
CELERY_SUITE_STORE_URL, PYTHONPATH with the extracted ``t/``) for both processes.
"""

from __future__ import annotations

import os
from copy import deepcopy
from typing import Any

from celery import Celery
from celery.contrib.testing.app import DEFAULT_TEST_CONFIG

import celery_pulse
from celery_suite import CACHE_DIR

DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672//"
DEFAULT_BACKEND = "redis://127.0.0.1:6379/9"
DEFAULT_STORE = f"sqlite:///{CACHE_DIR}/pulse-store.sqlite3"  # only when run by hand


def integration_config() -> dict[str, Any]:
    """t/integration/conftest.py's ``celery_config`` on top of TestApp's defaults."""
    config: dict[str, Any] = deepcopy(DEFAULT_TEST_CONFIG)
    config.update({
        "broker_url": os.environ.get("TEST_BROKER", DEFAULT_BROKER),
        "result_backend": os.environ.get("TEST_BACKEND", DEFAULT_BACKEND),
        "result_extended": True,
        "cassandra_servers": ["localhost"],
        "cassandra_keyspace": "tests",
        "cassandra_table": "tests",
        "cassandra_read_consistency": "ONE",
        "cassandra_write_consistency": "ONE",
    })
    config["task_create_missing_queues"] = False
    return config


def create_app() -> Celery:
    """Build the worker's app; the name is TestApp's, so every default matches."""
    import celery.contrib.testing.tasks  # noqa: F401  (celery.ping, as TestApp registers it)

    app = Celery("celery.tests", set_as_current=False)
    app.add_defaults(integration_config())
    app.conf.pulse_store_url = os.environ.get("CELERY_SUITE_STORE_URL", DEFAULT_STORE)

    from t.integration import tasks  # the conftest's celery_includes: every shared task

    app.register_task(tasks.ClassBasedAutoRetryTask)  # the conftest's celery_class_tasks
    celery_pulse.install(app)  # only switches on under -P pulse
    return app


app = create_app()
