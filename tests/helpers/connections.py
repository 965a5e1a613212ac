"""Count a worker's store connections on the server, by the name each one gives
(``pulse:<role>:<pid>@<host>``, :mod:`celery_pulse.store.sql.sizing`)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import sqlalchemy as sa

from tests.helpers import services
from tests.helpers.mariadb import PrivateMariaDB
from tests.helpers.services import PG_ADMIN_URL

__all__ = ["MARIADB_NAMES", "PG_NAMES", "Peaks", "mariadb_with_connect_attrs", "process_tree",
           "pulse_connections"]

#: Every session's name, on PostgreSQL and on MariaDB (with performance_schema on).
PG_NAMES = ("SELECT application_name FROM pg_stat_activity "
            "WHERE application_name LIKE 'pulse:%'")
MARIADB_NAMES = ("SELECT ATTR_VALUE FROM performance_schema.session_connect_attrs "
                 "WHERE ATTR_NAME = 'program_name' AND ATTR_VALUE LIKE 'pulse:%'")


@contextmanager
def mariadb_with_connect_attrs() -> Iterator[PrivateMariaDB]:
    """A MariaDB of our own with performance_schema on: the shared server has it off
    (MariaDB's default), so it shows no connect attributes."""
    services.require("mariadb")
    server = PrivateMariaDB({**PrivateMariaDB.FAST, "performance-schema": "ON"}).init()
    try:
        yield server
    finally:
        server.destroy()


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants (Linux ``/proc``)."""
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            todo.extend(int(c) for c in children)
    return found


def pulse_connections(engine: sa.Engine, pids: set[int], names_sql: str = PG_NAMES
                      ) -> collections.Counter[tuple[str, int]]:
    """The sessions named ``pulse:<role>:<pid>@...`` of the processes ``pids``, counted by
    (role, pid)."""
    with engine.connect() as conn:
        names = conn.execute(sa.text(names_sql)).scalars().all()
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    for name in names:
        _, role, rest = name.split(":", 2)
        pid = int(rest.partition("@")[0])
        if pid in pids:
            counts[(role, pid)] += 1
    return counts


class Peaks:
    """Samples a worker's connections every ``interval`` on a thread of its own, and keeps
    the most each process had at once (by role and pid) and the most the worker had in
    all: a bound is a peak, never a count at one moment."""

    def __init__(self, worker_pid: int, interval: float = 0.05, admin_url: str = PG_ADMIN_URL,
                 names_sql: str = PG_NAMES) -> None:
        self.worker_pid = worker_pid
        self.interval = interval
        self.names_sql = names_sql
        self.by_process: dict[tuple[str, int], int] = {}
        self.total = 0
        self.samples = 0
        self._engine = sa.create_engine(admin_url, pool_size=1, max_overflow=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conn-peaks", daemon=True)

    def sample(self) -> None:
        counts = pulse_connections(self._engine, process_tree(self.worker_pid), self.names_sql)
        for key, n in counts.items():
            self.by_process[key] = max(self.by_process.get(key, 0), n)
        self.total = max(self.total, sum(counts.values()))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def role_peak(self, role: str) -> int:
        """The most connections one process of ``role`` had at once."""
        return max((n for (r, _), n in self.by_process.items() if r == role), default=0)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(10)
        self._engine.dispose()
