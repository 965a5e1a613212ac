"""Count a worker's store connections on the server, by the name each one gives
(``pulse:<role>:<pid>@<host>``, :mod:`celery_pulse.store.sql.sizing`)."""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from types import TracebackType

import sqlalchemy as sa

from tests.helpers.services import PG_ADMIN_URL

__all__ = ["Peaks", "process_tree", "pulse_connections"]


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


def pulse_connections(engine: sa.Engine, pids: set[int]) -> collections.Counter[tuple[str, int]]:
    """The PostgreSQL sessions named ``pulse:<role>:<pid>@...`` of the processes ``pids``,
    counted by (role, pid)."""
    with engine.connect() as conn:
        names = conn.execute(sa.text(
            "SELECT application_name FROM pg_stat_activity "
            "WHERE application_name LIKE 'pulse:%'")).scalars().all()
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

    def __init__(self, worker_pid: int, interval: float = 0.05) -> None:
        self.worker_pid = worker_pid
        self.interval = interval
        self.by_process: dict[tuple[str, int], int] = {}
        self.total = 0
        self.samples = 0
        self._engine = sa.create_engine(PG_ADMIN_URL, pool_size=1, max_overflow=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conn-peaks", daemon=True)

    def sample(self) -> None:
        counts = pulse_connections(self._engine, process_tree(self.worker_pid))
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
