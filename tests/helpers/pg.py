"""PostgreSQL helpers: a schema per test, and a private server a test may stop."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time

from celery_pulse.contrib.services import Schema, schema_url

__all__ = ["PrivatePostgres", "Schema", "pg_bin", "schema_url"]


def pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"PostgreSQL binary {name} not found")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivatePostgres:
    """A PostgreSQL server of our own on a free port, which tests stop and start.

    ``settings`` are passed as ``-c``; the default trades durability for speed (tests
    never crash the host). The benchmarks pass ``{}`` for a durable server, as in
    production. Run as the ``postgres`` OS user when we are root (the server refuses
    root).
    """

    FAST = {"fsync": "off", "full_page_writes": "off"}

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="pulse-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = _free_port()
        self.settings = dict(self.FAST if settings is None else settings)
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            self._as_user = ["runuser", "-u", "postgres", "--"]

    def run(self, *args: str) -> None:
        subprocess.run([*self._as_user, *args], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=60)

    def init(self) -> PrivatePostgres:
        self.run(pg_bin("initdb"), "-D", self.data, "-A", "trust", "-U", "postgres",
                  "--no-sync", "-E", "UTF8")
        return self.start()

    def start(self) -> PrivatePostgres:
        options = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        self.run(pg_bin("pg_ctl"), "-D", self.data, "-w", "-t", "30", "-l",
                  os.path.join(self.dir, "server.log"), "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 {options}",
                  "start")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("private PostgreSQL did not start")

    def postmaster_pid(self) -> int:
        with open(os.path.join(self.data, "postmaster.pid")) as fh:
            return int(fh.readline())

    def stop(self) -> None:
        self.run(pg_bin("pg_ctl"), "-D", self.data, "-w", "-m", "immediate", "stop")

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
