"""MariaDB helpers: a database per test, and a private server a test may stop."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any, Protocol

from celery_pulse.contrib.services import Database

__all__ = ["PRIVATE_SERVERS", "Database", "PrivateMariaDB", "PrivateServer"]

#: The fixture (tests/conftest.py) that makes a private server of each kind.
PRIVATE_SERVERS = {"postgres": "private_pg", "mariadb": "private_mariadb"}


class PrivateServer(Protocol):
    """What ``PrivatePostgres`` and :class:`PrivateMariaDB` share: the store URL, and a
    server a test stops at once (no clean shutdown) and starts again (returning once it
    accepts connections)."""

    url: str

    def stop(self) -> None: ...

    def start(self) -> object: ...


def _mariadb_bin(*names: str) -> str:
    for name in names:
        path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
        if path is not None:
            return path
    raise RuntimeError(f"MariaDB binary {names[0]} not found")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateMariaDB:
    """A MariaDB server of our own on a free port, which tests stop and start.

    ``settings`` are passed as ``--name=value``; the default trades durability for speed
    (tests never crash the host): the redo log is written at every commit but flushed to
    disk only once a second, and the doublewrite buffer is off. A commit still survives
    :meth:`stop` (a SIGKILL, the counterpart of PostgreSQL's immediate shutdown);
    ``innodb_flush_log_at_trx_commit=0`` would lose the last second of commits there.
    ``{}`` gives a durable server, as in production. When we are root the server runs as
    the ``mysql`` OS user (``--user``; mariadbd refuses to run as root).
    """

    FAST = {"innodb-flush-log-at-trx-commit": "2", "innodb-doublewrite": "0"}

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="pulse-mariadb-")
        self.data = os.path.join(self.dir, "data")
        self.port = _free_port()
        self.settings = dict(self.FAST if settings is None else settings)
        self.url = f"mysql+pymysql://root@127.0.0.1:{self.port}/test"
        self._proc: subprocess.Popen[bytes] | None = None
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "mysql", "mysql")
            self._as_user = ["--user=mysql"]

    def init(self) -> PrivateMariaDB:
        subprocess.run([_mariadb_bin("mariadb-install-db", "mysql_install_db"), "--no-defaults",
                        f"--datadir={self.data}", "--auth-root-authentication-method=normal",
                        "--skip-test-db", "--skip-name-resolve", *self._as_user],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        self.start()
        with contextlib.closing(self._connect(5.0)) as conn, conn.cursor() as cursor:
            cursor.execute("CREATE DATABASE IF NOT EXISTS test CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
        return self

    def _connect(self, timeout: float) -> Any:
        import pymysql

        return pymysql.connect(host="127.0.0.1", port=self.port, user="root", password="",
                               connect_timeout=timeout, autocommit=True)

    def start(self) -> PrivateMariaDB:
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError("private MariaDB is already running")
        options = [f"--{k}={v}" for k, v in self.settings.items()]
        log = os.path.join(self.dir, "server.log")
        with open(log, "ab") as fh:
            self._proc = subprocess.Popen(
                [_mariadb_bin("mariadbd", "mysqld"), "--no-defaults", f"--datadir={self.data}",
                 f"--port={self.port}", "--bind-address=127.0.0.1",
                 f"--socket={os.path.join(self.dir, 'sock')}",
                 f"--pid-file={os.path.join(self.dir, 'mariadbd.pid')}",
                 "--skip-log-bin", "--skip-name-resolve", "--character-set-server=utf8mb4",
                 *self._as_user, *options],
                stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                with open(log, errors="replace") as fh:
                    tail = fh.read()[-2000:]
                raise RuntimeError(f"private MariaDB exited ({self._proc.returncode}):\n{tail}")
            try:
                self._connect(0.5).close()
                return self
            except Exception:  # not accepting connections yet
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("private MariaDB did not start")

    def server_pid(self) -> int:
        """The pid of mariadbd (the counterpart of ``PrivatePostgres.postmaster_pid``)."""
        if self._proc is None:
            raise RuntimeError("private MariaDB is not running")
        return self._proc.pid

    def stop(self) -> None:
        """Kill the server at once (SIGKILL): no clean shutdown, like ``pg_ctl -m immediate``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
