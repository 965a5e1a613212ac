"""Running services a test may use (PostgreSQL, MariaDB, RabbitMQ, Redis): where, whether up, how to tidy.

Locally a missing service skips the test with a message naming it; with ``CI=true`` it
fails the test instead, so a CI run can't pass by skipping.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from urllib.parse import quote, urlsplit

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"

#: Defaults, each overridden by the environment variable of the same role.
POSTGRES_URL = os.environ.get("PULSE_TEST_PG", "postgresql+psycopg://root@127.0.0.1:5432/test")
MARIADB_URL = os.environ.get("PULSE_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test")
RABBITMQ_URL = os.environ.get("PULSE_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
#: The Redis database the pytest-celery nodes own: emptied after every test that used it.
REDIS_URL = os.environ.get("PULSE_TEST_REDIS_DB_URL", "redis://127.0.0.1:6379/13")


def address(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url.replace("+psycopg", "").replace("+pymysql", ""))
    return parts.hostname or "127.0.0.1", parts.port or default_port


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require(name: str, host: str, port: int) -> None:
    """Skip (locally) or fail (``CI=true``) when service ``name`` does not answer."""
    if reachable(host, port):
        return
    message = f"{name} is not reachable at {host}:{port}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: services are required)", pytrace=False)
    pytest.skip(message)


def schema_url(base: str, schema: str) -> str:
    """``base`` with every connection's search_path set to ``schema``."""
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options={quote(f'-csearch_path={schema}')}"


class Schema:
    """A throwaway PostgreSQL schema in a shared database: the store of one test."""

    def __init__(self, admin_url: str, prefix: str = "t_") -> None:
        import sqlalchemy as sa

        self.admin_url = admin_url
        self.name = prefix + uuid.uuid4().hex[:12]
        self.url = schema_url(admin_url, self.name)
        self._engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")

    def create(self) -> Schema:
        with self._engine.connect() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{self.name}"')
        return self

    def drop(self) -> None:
        with self._engine.connect() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{self.name}" CASCADE')
        self._engine.dispose()


class Database:
    """A throwaway MariaDB/MySQL database on a shared server: the store of one test.

    MariaDB has no schemas inside a database (a schema *is* a database), so where
    :class:`Schema` makes a schema, this makes a database, with a binary collation so that
    strings compare byte for byte (case- and accent-sensitive), as on PostgreSQL and SQLite.
    """

    def __init__(self, admin_url: str, prefix: str = "t_") -> None:
        import sqlalchemy as sa

        self.admin_url = admin_url
        self.name = prefix + uuid.uuid4().hex[:12]
        self.url = sa.make_url(admin_url).set(database=self.name).render_as_string(hide_password=False)
        self._engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")

    def create(self) -> Database:
        with self._engine.connect() as conn:
            conn.exec_driver_sql(
                f"CREATE DATABASE `{self.name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        return self

    def drop(self) -> None:
        try:
            with self._engine.connect() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{self.name}`")
        finally:
            self._engine.dispose()


def delete_amqp_entities(url: str, queues: list[str], exchanges: list[str]) -> None:
    """Delete ``queues`` and ``exchanges`` on the broker at ``url`` (missing ones are fine)."""
    from kombu.connection import Connection

    with Connection(url, connect_timeout=5, transport_options={"max_retries": 1}) as conn:
        conn.ensure_connection(max_retries=1)  # a broker that is down fails fast, never hangs
        channel = conn.channel()
        for name in queues:
            channel.queue_delete(name)
        for name in exchanges:
            channel.exchange_delete(name)


def rabbitmq_names(kind: str, contains: str) -> list[str]:
    """Names of the ``queues``/``exchanges`` on the local RabbitMQ that contain ``contains``.

    Uses ``rabbitmqctl`` (the tests' host runs the server); for leak checks only.
    """
    out = subprocess.run(["rabbitmqctl", "-q", f"list_{kind}", "name"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [line.strip() for line in out.splitlines() if contains in line]


def flush_redis_db(url: str) -> None:
    """Empty the Redis database of ``url`` (the nodes' own database)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
