"""A real PgBouncer (Debian's ``pgbouncer``) in front of the test PostgreSQL server.

One PgBouncer per pooling mode per test session, on a free port, with a generated ini
(``auth_type = trust``, every database name forwarded to the same name on
127.0.0.1:5432); each test gets an empty database of its own behind it (PgBouncer 1.18
refuses the ``options`` startup parameter that carries a schema's ``search_path``, and a
``SET search_path`` would not survive transaction pooling: a database per test keeps the
URL plain). Every PgBouncer is killed by its fixture.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.helpers import services
from tests.helpers.pg import _free_port

__all__ = ["PgBouncer", "pgb_database", "pgbouncer_binary"]

#: Pool size per (database, user) in the session PgBouncer: a ``-c 2`` worker holds about
#: ten server connections in session mode (docs/production.md#pgbouncer).
SESSION_POOL = 30
TRANSACTION_POOL = 10


def pgbouncer_binary() -> str:
    """The pgbouncer binary; skip (locally) or fail (CI) when it is not installed."""
    found = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer"
                                          if os.path.exists("/usr/sbin/pgbouncer") else None)
    if found is None:
        message = "pgbouncer is not installed (apt-get install -y pgbouncer)"
        if services.IN_CI:
            pytest.fail(message + " (CI=true: .ci/run installs it)", pytrace=False)
        pytest.skip(message)
    return found


class PgBouncer:
    """PgBouncer on a free port in ``mode`` (session, transaction or statement)."""

    def __init__(self, mode: str, pool_size: int | None = None,
                 server: tuple[str, int] = ("127.0.0.1", 5432), **settings: str) -> None:
        self.mode = mode
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix=f"pulse-pgb-{mode}-")
        self.pool_size = pool_size or (SESSION_POOL if mode == "session" else TRANSACTION_POOL)
        self.server = server
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "test") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _ini(self) -> str:
        host, port = self.server
        extra = "".join(f"{k} = {v}\n" for k, v in self.settings.items())
        return (f"[databases]\n* = host={host} port={port}\n\n[pgbouncer]\n"
                f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
                f"auth_type = trust\nauth_file = {self.dir}/users.txt\n"
                f"pool_mode = {self.mode}\ndefault_pool_size = {self.pool_size}\n"
                f"max_client_conn = 2000\nadmin_users = postgres\n"
                # Idle server connections go soon: tests run beside each other (xdist)
                # on one server with a bounded max_connections.
                f"server_idle_timeout = 10\n"
                f"logfile = {self.dir}/pgbouncer.log\npidfile = {self.dir}/pgbouncer.pid\n"
                f"{extra}")

    def start(self) -> PgBouncer:
        binary = pgbouncer_binary()
        with open(os.path.join(self.dir, "pgbouncer.ini"), "w") as fh:
            fh.write(self._ini())
        with open(os.path.join(self.dir, "users.txt"), "w") as fh:
            fh.write('"postgres" ""\n')
        command = [binary, os.path.join(self.dir, "pgbouncer.ini")]
        if os.geteuid() == 0:  # pgbouncer refuses to run as root
            shutil.chown(self.dir, "postgres", "postgres")
            for name in os.listdir(self.dir):
                shutil.chown(os.path.join(self.dir, name), "postgres", "postgres")
            command = ["runuser", "-u", "postgres", "--", *command]
        # Its log goes to the logfile (a pipe nobody reads would block it once full).
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {self.log()}")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.5):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"pgbouncer did not listen on {self.port}: {self.log()}")

    def log(self) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.dir, "pgbouncer.log")) as fh:
            return fh.read()[-4000:]
        return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


#: Databases made for earlier tests, emptied and free to reuse (emptying one costs less
#: than making one, and drops no database under the pooler's feet).
_FREE: list[str] = []


def _reset(name: str) -> None:
    """Empty database ``name``: its ``public`` schema dropped and made again, its
    settings back to the server's."""
    url = sa.make_url(services.PG_ADMIN_URL).set(database=name)
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                                 "AND state <> 'idle'")
            conn.exec_driver_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" RESET ALL')
    finally:
        engine.dispose()


@contextlib.contextmanager
def pgb_database(bouncer: PgBouncer) -> Iterator[str]:
    """An empty database of the test's own on the PostgreSQL server, its URL through
    ``bouncer``; emptied at the end, for a later test."""
    services.require("postgres")
    admin = sa.create_engine(services.PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        if _FREE:
            name = _FREE.pop()
        else:
            name = services.SCHEMA_PREFIX + "pgb_" + uuid.uuid4().hex[:12]
            with admin.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            yield bouncer.url(name)
        finally:
            _reset(name)
            _FREE.append(name)
    finally:
        admin.dispose()


def drop_free_databases() -> None:
    """Drop the databases kept for reuse (at the end of the session)."""
    admin = sa.create_engine(services.PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            while _FREE:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{_FREE.pop()}" WITH (FORCE)')
    finally:
        admin.dispose()


@pytest.fixture(scope="session")
def pgbouncer_session() -> Iterator[PgBouncer]:
    """PgBouncer in session pooling mode, for the whole test session."""
    services.require("postgres")
    bouncer = PgBouncer("session").start()
    try:
        yield bouncer
    finally:
        bouncer.stop()
        drop_free_databases()


@pytest.fixture(scope="session")
def pgbouncer_transaction() -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling mode, for the whole test session."""
    services.require("postgres")
    bouncer = PgBouncer("transaction").start()
    try:
        yield bouncer
    finally:
        bouncer.stop()
        drop_free_databases()


@pytest.fixture
def pgb_session_url(pgbouncer_session: PgBouncer) -> Iterator[str]:
    """A fresh store database behind the session-mode PgBouncer."""
    with pgb_database(pgbouncer_session) as url:
        yield url


@pytest.fixture
def pgb_transaction_url(pgbouncer_transaction: PgBouncer) -> Iterator[str]:
    """A fresh store database behind the transaction-mode PgBouncer."""
    with pgb_database(pgbouncer_transaction) as url:
        yield url
