"""Shared fixtures: a store per test on SQLite, PostgreSQL or MariaDB, brokers, worker processes."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_pulse.store.sql import SqlStore
from tests.helpers import services
from tests.helpers.mariadb import PRIVATE_SERVERS, Database, PrivateMariaDB, PrivateServer
from tests.helpers.pg import PrivatePostgres, Schema
from tests.helpers.pg_ha import ReplicatedPostgres
from tests.helpers.stores import migrated
from tests.helpers.workers import Env, Worker

#: pytest-celery's fixtures on local -P pulse workers (tests/acceptance/test_pytest_celery.py).
pytest_plugins = ["celery_pulse.contrib.pytest_celery", "tests.helpers.gateway",
                  "tests.helpers.pgbouncer"]

#: Tests that must not run beside each other under pytest-xdist (``--dist loadgroup``):
#: pytest-celery's nodes share one Redis database, which each test empties at its end, and
#: the user-suite test checks that the broker and PostgreSQL hold nothing of its afterwards.
SERIAL_GROUPS = {"tests/plugin/": "pytest-celery", "example_project/tests/": "pytest-celery"}


def pytest_sessionstart(session: pytest.Session) -> None:
    services.make_process_vhost()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    services.drop_process_vhost()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = str(config.rootpath) + "/"
    for item in items:
        where = str(item.path).removeprefix(root)
        for prefix, group in SERIAL_GROUPS.items():
            if where.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))


STORES = ["sqlite", "postgres", "mariadb"]
#: The fixture that makes a fresh store of each kind.
STORE_FIXTURES = {"sqlite": "sqlite_url", "postgres": "pg_url", "mariadb": "mariadb_url"}


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'pulse.sqlite3'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    services.require("postgres")
    schema = Schema(services.PG_ADMIN_URL, prefix=services.SCHEMA_PREFIX).create()
    try:
        yield schema.url
    finally:
        schema.drop()


@pytest.fixture
def mariadb_url() -> Iterator[str]:
    services.require("mariadb")
    database = Database(services.MARIADB_ADMIN_URL, prefix=services.SCHEMA_PREFIX).create()
    try:
        yield database.url
    finally:
        database.drop()


#: The server stores, for acceptance scenarios that run on each (``indirect`` params).
SERVERS = ["postgres", "mariadb"]


@pytest.fixture
def server_url(request: pytest.FixtureRequest) -> str:
    """A fresh PostgreSQL store; with ``parametrize("server_url", SERVERS, indirect=True)``
    one of each server store."""
    url: str = request.getfixturevalue(STORE_FIXTURES[getattr(request, "param", "postgres")])
    return url


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest) -> str:
    """The store URL, once per store implementation (SQLite, PostgreSQL, MariaDB)."""
    url: str = request.getfixturevalue(STORE_FIXTURES[request.param])
    return url


@pytest.fixture
def sql_store(store_url: str) -> Iterator[SqlStore]:
    """The SQL store, once per SQL implementation, for tests about SQL itself (row locks,
    driver errors, the ``pulse://`` backend's table, ``lease.fenced`` on a connection).
    Contract tests take ``store`` (tests/contract/conftest.py): memory and every SQL store."""
    store = migrated(store_url)
    yield store
    store.close()


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[SqlStore]:
    """The SQL store on PostgreSQL only (for behaviour SQLite has no equivalent of)."""
    store = migrated(pg_url)
    yield store
    store.close()


@pytest.fixture(params=SERVERS)
def server_store(request: pytest.FixtureRequest) -> Iterator[SqlStore]:
    """The SQL store on each server (PostgreSQL, MariaDB): row locks, session timeouts."""
    store = migrated(request.getfixturevalue(STORE_FIXTURES[request.param]))
    yield store
    store.close()


@pytest.fixture
def private_server(request: pytest.FixtureRequest) -> PrivateServer:
    """A private store server a test stops and starts: PostgreSQL, or the kind named by
    ``parametrize("private_server", list(PRIVATE_SERVERS), indirect=True)``."""
    server: PrivateServer = request.getfixturevalue(
        PRIVATE_SERVERS[getattr(request, "param", "postgres")])
    return server


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of this test's own, which the test may stop and start."""
    services.require("postgres")
    server = PrivatePostgres().init()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def replicated_pg() -> Iterator[ReplicatedPostgres]:
    """A private primary streaming to a synchronous standby; both destroyed after."""
    services.require("postgres")
    pair = ReplicatedPostgres()
    try:
        yield pair.start()
    finally:
        pair.destroy()


@pytest.fixture
def private_mariadb() -> Iterator[PrivateMariaDB]:
    """A MariaDB server of this test's own, which the test may stop and start."""
    services.require("mariadb")
    server = PrivateMariaDB().init()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture
def rabbitmq_url() -> str:
    services.require("rabbitmq")
    return services.RABBIT_URL


@pytest.fixture
def rabbitmq_vhost_url() -> Iterator[str]:
    """RabbitMQ on a vhost of the test's own, for a test that cuts broker connections."""
    services.require("rabbitmq")
    with services.private_vhost(services.RABBIT_URL) as url:
        yield url


@pytest.fixture
def redis_url() -> str:
    services.require("redis")
    return services.REDIS_URL


@pytest.fixture
def queue_name() -> str:
    # Not the pytest-celery plugin's "pulse-test-": its leftover check (tests/plugin/
    # test_user_suite.py) then sees only its own queues, whatever runs beside it.
    return "pulse-case-" + uuid.uuid4().hex[:10]


@pytest.fixture
def make_env(tmp_path: Path, queue_name: str) -> Iterator[Callable[..., Env]]:
    """``factory(store_url, broker_url, conf)`` -> an Env on the test's queue.

    At teardown (after the test's workers are killed: ``workers`` depends on this
    fixture) the test's queue is deleted from the shared broker it used.
    """
    brokers: set[str] = set()

    def factory(store_url: str, broker_url: str, conf: dict[str, Any] | None = None,
                migrate: bool = True) -> Env:
        env = Env(store_url, broker_url, queue_name, tmp_path, conf)
        brokers.add(broker_url)
        if migrate:
            migrated(store_url).close()
        return env
    yield factory
    for broker_url in brokers:
        services.tidy_queue(broker_url, queue_name)


@pytest.fixture
def workers(make_env: Callable[..., Env]) -> Iterator[Callable[..., Worker]]:
    """Start real worker processes; every one is SIGKILLed at teardown."""
    started: list[Worker] = []

    def start(env: Env, name: str, **kwargs: Any) -> Worker:
        worker = Worker(env, name, **kwargs)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()


def filesystem_broker(tmp: Path) -> tuple[str, dict[str, Any]]:
    """kombu's ``filesystem://`` broker in a folder of the test's own (the embedded default)."""
    folder = tmp / "broker"
    for sub in ("in", "processed", "control"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    opts = {"data_folder_in": str(folder / "in"), "data_folder_out": str(folder / "in"),
            "processed_folder": str(folder / "processed"),
            "control_folder": str(folder / "control"), "store_processed": False}
    return "filesystem://", {"broker_transport_options": opts}


@pytest.fixture(params=["embedded", "postgres-rabbitmq"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str, dict[str, Any]]:
    """(store_url, broker_url, extra conf): the embedded default, then the production pair."""
    if request.param == "embedded":
        broker, conf = filesystem_broker(tmp_path)
        return request.getfixturevalue("sqlite_url"), broker, conf
    return request.getfixturevalue("pg_url"), request.getfixturevalue("rabbitmq_url"), {}
