"""pytest-celery on local ``-P pulse`` workers: no Docker, no images.

Opt in from your top-level ``conftest.py`` (it overrides some of pytest-celery's
fixtures, so it is never switched on by merely being installed)::

    pytest_plugins = ["celery_pulse.contrib.pytest_celery"]

Then pytest-celery's own names run on pulse: ``celery_setup`` starts a real
``celery worker -P pulse`` subprocess on the test's own queue, a SQLite store under
``tmp_path`` (``--pulse-store=postgres``/``mariadb`` for a server store), kombu's ``filesystem://``
broker and a ``file://`` result backend. ``--pulse-brokers=filesystem,redis,rabbitmq``
and ``--pulse-backends=file,redis`` widen the matrix to the running servers. See
docs/testing.md, "With pytest-celery".
"""

from __future__ import annotations

from celery_pulse.contrib.pytest_celery.docker import PulseWorkerContainer
from celery_pulse.contrib.pytest_celery.fixtures import (
    celery_backend,
    celery_broker,
    celery_setup_cls,
    celery_setup_config,
    celery_setup_worker,
    pulse_file_backend,
    pulse_filesystem_broker,
    pulse_mariadb_store_url,
    pulse_postgres_store_url,
    pulse_rabbitmq_broker,
    pulse_redis_backend,
    pulse_redis_broker,
    pulse_settings,
    pulse_store_url,
    pulse_worker_concurrency,
    pulse_worker_node_factory,
    pulse_worker_queue,
    pytest_addoption,
    pytest_configure,
    pytest_generate_tests,
)
from celery_pulse.contrib.pytest_celery.nodes import (
    PulseTestBackend,
    PulseTestBroker,
    PulseWorkerNode,
)
from celery_pulse.contrib.pytest_celery.process import LocalProcess
from celery_pulse.contrib.pytest_celery.setup import PulseTestSetup

__all__ = [
    "LocalProcess",
    "PulseTestBackend",
    "PulseTestBroker",
    "PulseTestSetup",
    "PulseWorkerContainer",
    "PulseWorkerNode",
    "celery_backend",
    "celery_broker",
    "celery_setup_cls",
    "celery_setup_config",
    "celery_setup_worker",
    "pulse_file_backend",
    "pulse_filesystem_broker",
    "pulse_mariadb_store_url",
    "pulse_postgres_store_url",
    "pulse_rabbitmq_broker",
    "pulse_redis_backend",
    "pulse_redis_broker",
    "pulse_settings",
    "pulse_store_url",
    "pulse_worker_concurrency",
    "pulse_worker_node_factory",
    "pulse_worker_queue",
    "pytest_addoption",
    "pytest_configure",
    "pytest_generate_tests",
]
