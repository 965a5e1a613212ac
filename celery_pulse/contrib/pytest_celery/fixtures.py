"""The plugin's fixtures: pytest-celery's names, local processes and running services.

Overridden from pytest-celery: ``celery_broker``, ``celery_backend`` (parametrized
over the selected brokers and backends), ``celery_setup_cls``,
``celery_setup_config`` and ``celery_setup_worker``. Everything else of pytest-celery
(``celery_setup``, ``celery_worker``, ``celery_worker_cluster``,
``default_worker_tasks``, ``default_worker_app`` ...) works as documented there.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pytest_celery import CeleryBackendCluster, CeleryBrokerCluster, CeleryTestSetup

from celery_pulse.contrib import services
from celery_pulse.contrib.pytest_celery import nodes
from celery_pulse.contrib.pytest_celery.setup import PulseTestSetup
from celery_pulse.testing import FAST_SETTINGS

BROKERS = ("filesystem", "redis", "rabbitmq")
BACKENDS = ("file", "redis")
STORES = ("sqlite", "postgres", "mariadb")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-pulse", "celery-pulse's pytest-celery nodes")
    group.addoption("--pulse-brokers", default=os.environ.get("PULSE_PYTEST_BROKERS", "filesystem"),
                    help="comma-separated brokers to run celery_setup tests on: "
                         f"{', '.join(BROKERS)} or all (env PULSE_PYTEST_BROKERS; "
                         "default filesystem)")
    group.addoption("--pulse-backends", default=os.environ.get("PULSE_PYTEST_BACKENDS", "file"),
                    help=f"comma-separated result backends: {', '.join(BACKENDS)} or all "
                         "(env PULSE_PYTEST_BACKENDS; default file)")
    group.addoption("--pulse-store", default=os.environ.get("PULSE_PYTEST_STORE", "sqlite"),
                    choices=STORES, help="the pulse store of the workers: sqlite (a file of "
                    "the test's own), postgres (a schema of the test's own in "
                    "$PULSE_TEST_PG) or mariadb (a database of the test's own in "
                    "$PULSE_TEST_MARIADB) (env PULSE_PYTEST_STORE)")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a load order in which pytest-celery's fixtures would shadow ours.

    Fixtures of a plugin registered later win. pytest-celery registers itself from its
    entry point; ``-p`` loads us before that, ``pytest_plugins`` in a conftest after.
    """
    import sys

    plugins = [plugin for _, plugin in config.pluginmanager.list_name_plugin()]
    ours = sys.modules["celery_pulse.contrib.pytest_celery"]
    theirs = sys.modules.get("pytest_celery.plugin")
    if ours in plugins and theirs in plugins and plugins.index(ours) < plugins.index(theirs):
        raise pytest.UsageError(
            "celery_pulse.contrib.pytest_celery was loaded before pytest-celery's own plugin, "
            "so pytest-celery's fixtures would shadow it: load it with "
            'pytest_plugins = ["celery_pulse.contrib.pytest_celery"] in your top-level '
            "conftest.py (or -p celery -p celery_pulse.contrib.pytest_celery)")


def selected(config: pytest.Config, option: str, known: tuple[str, ...]) -> list[str]:
    raw = str(config.getoption(option))
    names = list(known) if raw.strip() == "all" else [n.strip() for n in raw.split(",") if n.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise pytest.UsageError(f"--{option.replace('_', '-')}: {', '.join(unknown) or 'empty'} "
                                f"is not one of {', '.join(known)}, all")
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The matrix: each selected broker (and backend) is one run of a celery_setup test."""
    for fixture, option, known, template in (
            ("celery_broker", "pulse_brokers", BROKERS, "pulse_{}_broker"),
            ("celery_backend", "pulse_backends", BACKENDS, "pulse_{}_backend")):
        if fixture in metafunc.fixturenames and not _parametrized(metafunc, fixture):
            names = selected(metafunc.config, option, known)
            metafunc.parametrize(fixture, [template.format(n) for n in names], indirect=True,
                                 ids=names)


def _parametrized(metafunc: pytest.Metafunc, name: str) -> bool:
    """The test parametrizes ``name`` itself (``@pytest.mark.parametrize(..., indirect=True)``)."""
    for marker in metafunc.definition.iter_markers("parametrize"):
        argnames = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(argnames, str):
            argnames = [part.strip() for part in argnames.split(",")]
        if name in argnames:
            return True
    return False


# -- queue, store and pulse settings ------------------------------------------------------
@pytest.fixture
def pulse_worker_queue() -> str:
    """The test's own queue: its workers consume it, its app sends there by default."""
    return "pulse-test-" + uuid.uuid4().hex[:10]


@pytest.fixture
def pulse_postgres_store_url() -> Iterator[str]:
    """A pulse store in a PostgreSQL schema of the test's own ($PULSE_TEST_PG), dropped after."""
    services.require("PostgreSQL", *services.address(services.POSTGRES_URL, 5432))
    schema = services.Schema(services.POSTGRES_URL).create()
    try:
        yield schema.url
    finally:
        schema.drop()


@pytest.fixture
def pulse_mariadb_store_url() -> Iterator[str]:
    """A pulse store in a MariaDB/MySQL database of the test's own ($PULSE_TEST_MARIADB),
    dropped after."""
    services.require("MariaDB", *services.address(services.MARIADB_URL, 3306))
    database = services.Database(services.MARIADB_URL).create()
    try:
        yield database.url
    finally:
        database.drop()


@pytest.fixture
def pulse_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The workers' store: SQLite under ``tmp_path``, or PostgreSQL/MariaDB with
    --pulse-store=postgres/mariadb.

    Override it to point the store elsewhere, e.g. ``return pulse_postgres_store_url``.
    """
    kind = request.config.getoption("pulse_store")
    if kind in ("postgres", "mariadb"):
        url: str = request.getfixturevalue(f"pulse_{kind}_store_url")
        return url
    return f"sqlite:///{tmp_path / 'pulse.sqlite3'}"


@pytest.fixture
def pulse_settings() -> dict[str, Any]:
    """pulse settings of the test's app and workers: short TTLs, the beat off. Override freely."""
    return dict(FAST_SETTINGS)


@pytest.fixture
def pulse_worker_concurrency() -> int:
    """Pool processes of each worker node (``-c``)."""
    return 2


# -- brokers and backends -----------------------------------------------------------------
@pytest.fixture
def pulse_filesystem_broker(tmp_path: Path) -> nodes.PulseTestBroker:
    return nodes.filesystem_broker(tmp_path / "broker")


@pytest.fixture
def pulse_redis_broker() -> nodes.PulseTestBroker:
    services.require("Redis", *services.address(services.REDIS_URL, 6379))
    return nodes.redis_broker(services.REDIS_URL)


@pytest.fixture
def pulse_rabbitmq_broker(pulse_worker_queue: str) -> nodes.PulseTestBroker:
    services.require("RabbitMQ", *services.address(services.RABBITMQ_URL, 5672))
    return nodes.rabbitmq_broker(services.RABBITMQ_URL, pulse_worker_queue)


@pytest.fixture
def pulse_file_backend(tmp_path: Path) -> nodes.PulseTestBackend:
    return nodes.file_backend(tmp_path / "results")


@pytest.fixture
def pulse_redis_backend() -> nodes.PulseTestBackend:
    services.require("Redis", *services.address(services.REDIS_URL, 6379))
    return nodes.redis_backend(services.REDIS_URL)


@pytest.fixture
def celery_broker(request: pytest.FixtureRequest) -> Iterator[nodes.PulseTestBroker]:
    """The broker node of this run of the matrix (--pulse-brokers)."""
    broker: nodes.PulseTestBroker = request.getfixturevalue(
        getattr(request, "param", "pulse_filesystem_broker"))
    yield broker
    broker.teardown()


@pytest.fixture
def celery_backend(request: pytest.FixtureRequest) -> Iterator[nodes.PulseTestBackend]:
    """The result backend node of this run of the matrix (--pulse-backends)."""
    backend: nodes.PulseTestBackend = request.getfixturevalue(
        getattr(request, "param", "pulse_file_backend"))
    yield backend
    backend.teardown()


# -- the setup ----------------------------------------------------------------------------
@pytest.fixture
def celery_setup_cls() -> type[CeleryTestSetup]:
    return PulseTestSetup


@pytest.fixture
def celery_setup_config(celery_broker_cluster: CeleryBrokerCluster | None,
                        celery_backend_cluster: CeleryBackendCluster | None,
                        pulse_worker_queue: str, pulse_store_url: str,
                        pulse_settings: dict[str, Any]) -> dict[str, Any]:
    """The test app's settings: the nodes' URLs and options, the test's queue, the store."""
    config: dict[str, Any] = {"task_default_queue": pulse_worker_queue,
                              "pulse_store_url": pulse_store_url,
                              "broker_connection_retry_on_startup": True, **pulse_settings}
    for cluster, key in ((celery_broker_cluster, "broker_url"),
                         (celery_backend_cluster, "result_backend")):
        if not cluster:
            continue
        config[key] = ";".join(node.config()["host_url"] for node in cluster)
        for node in cluster:
            if isinstance(node, nodes.PulseTestBroker | nodes.PulseTestBackend):
                config.update(node.celery_conf())
    return config


@pytest.fixture
def pulse_worker_node_factory(tmp_path: Path, pulse_worker_queue: str, celery_setup_config: dict[str, Any],
                               default_worker_app: Celery, default_worker_tasks: set[Any],
                               default_worker_signals: set[Any], pulse_worker_concurrency: int,
                               ) -> Iterator[Callable[..., nodes.PulseWorkerNode]]:
    """``start(**options)`` -> one more ``-P pulse`` worker node on the test's queue.

    The node runs ``default_worker_app`` with the test's settings
    (``celery_setup_config``) over its own: return your project's module-level app from
    ``default_worker_app`` and the worker imports its module and runs it. Options:
    ``concurrency``, ``log_level``, ``extra_args`` (more ``celery worker`` arguments),
    ``env``, ``app``, ``queue``. Every node it started is killed at teardown.
    """
    started: list[nodes.PulseWorkerNode] = []
    prefix = pulse_worker_queue

    def start(**options: Any) -> nodes.PulseWorkerNode:
        index = len(started) + 1
        node = nodes.start_worker(
            options.pop("app", default_worker_app), folder=tmp_path / "workers",
            queue=options.pop("queue", pulse_worker_queue), worker_name=f"{prefix}-w{index}",
            overrides=celery_setup_config,
            modules=[*default_worker_tasks, *default_worker_signals],
            concurrency=options.pop("concurrency", pulse_worker_concurrency), **options)
        started.append(node)
        return node

    yield start
    for node in started:
        node.teardown()


@pytest.fixture
def celery_setup_worker(pulse_worker_node_factory: Callable[..., nodes.PulseWorkerNode]
                        ) -> nodes.PulseWorkerNode:
    """The first worker node: ``celery_worker`` (and ``celery_setup.worker``)."""
    return pulse_worker_node_factory()
