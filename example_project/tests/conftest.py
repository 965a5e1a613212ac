"""The example's tests run on pytest-celery, with pulse's local worker nodes.

``celery_pulse.contrib.pytest_celery`` gives pytest-celery's fixtures
(``celery_setup``, ``celery_worker`` ...) workers that are local
``celery worker -P pulse`` processes: no Docker. See docs/testing.md.
"""

from __future__ import annotations

import pytest
from celery import Celery

pytest_plugins = ["celery_pulse.contrib.pytest_celery"]


@pytest.fixture
def default_worker_app() -> Celery:
    """The workers run the example's own app (its tasks, its startup hook), with the test's
    broker, result backend, store and queue applied over its settings."""
    from example_project.app import app

    return app
