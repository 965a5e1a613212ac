"""A user's pytest-celery suite, run as a user runs it: the worked example of docs/testing.md.

The example uses only pytest-celery's names (plus ``celery_setup``'s pulse helpers),
loads the plugin from its ``conftest.py`` and runs in a pytest process of its own, on
every broker (filesystem, Redis, RabbitMQ), with ``--pulse-store=postgres``. Afterwards
nothing of it may be left on the shared servers: no queue or exchange of its tests on
RabbitMQ, no key in the plugin's Redis database, no store schema in PostgreSQL.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from celery_pulse.contrib import services
from celery_pulse.testing import wait_for
from tests.helpers import services as project_services
from tests.integration.test_testing_helpers import TESTING_DOC, doc_files, run_bounded

FOLDER = "pytest-celery"
BROKERS = ("filesystem", "redis", "rabbitmq")


def write_example(tmp_path: Path) -> int:
    """The example's files in ``tmp_path``; returns how many tests its module defines."""
    files = doc_files(TESTING_DOC, FOLDER)
    assert {"conftest.py", "test_orders.py"} <= files.keys(), files.keys()
    for name, (_, code) in files.items():
        (tmp_path / name).write_text(code)
    return len(re.findall(r"^def test_", files["test_orders.py"][1], re.M))


def test_the_example_runs_on_every_broker_and_leaves_nothing_behind(tmp_path: Path) -> None:
    for name in ("rabbitmq", "redis", "postgres"):
        project_services.require(name)
    queues_before = set(services.rabbitmq_names("queues", "pulse-test-"))
    exchanges_before = set(services.rabbitmq_names("exchanges", "pulse-test-"))
    schemas_before = schemas()
    tests = write_example(tmp_path)

    result = run_bounded([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                          "-o", "addopts=", "--pulse-brokers=all", "--pulse-store=postgres",
                          "test_orders.py"], tmp_path,
                         env={"CI": "true"})  # a missing server fails the example, not skips it
    assert result.returncode == 0, result.stdout[-6000:]
    assert f"{tests * len(BROKERS)} passed" in result.stdout, result.stdout[-6000:]
    for broker in BROKERS:
        assert len(re.findall(rf"\[celery_setup_worker-{broker}-file\] PASSED", result.stdout)) == tests

    # Auto-delete queues (the workers' pidbox) go when the broker notices the closed
    # connection: poll with a deadline.
    def leftovers() -> tuple[set[str], set[str], int, set[str]]:
        queues = set(services.rabbitmq_names("queues", "pulse-test-")) - queues_before
        exchanges = set(services.rabbitmq_names("exchanges", "pulse-test-")) - exchanges_before
        return queues, exchanges, redis_keys(), schemas() - schemas_before

    try:
        wait_for(lambda: leftovers() == (set(), set(), 0, set()), 15,
                 "the example's leftovers to go")
    except AssertionError:
        pytest.fail(f"left behind (queues, exchanges, Redis keys, schemas): {leftovers()}")


def schemas() -> set[str]:
    import sqlalchemy as sa

    engine = sa.create_engine(services.POSTGRES_URL, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return set(conn.execute(sa.text("SELECT schema_name FROM information_schema.schemata "
                                            "WHERE schema_name LIKE 't\\_%'")).scalars())
    finally:
        engine.dispose()


def redis_keys() -> int:
    import redis

    client = redis.Redis.from_url(services.REDIS_URL)
    try:
        return int(client.dbsize())
    finally:
        client.close()
