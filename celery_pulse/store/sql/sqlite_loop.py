"""SQLite's exchange made on the worker's event loop, never waiting for a lock.

On SQLite the exchange is SQLite's own work in the worker's process; done on the commit
thread it also cost the thread hand-offs and the interpreter lock going back and forth
between that thread and the consumer loop (measured: 0.33 ms of the commit thread's CPU
per no-op task, with the loop's own CPU up by as much again). Made on the loop, the
usual exchange (:func:`.claim_rows.usual`) costs what SQLite's statements cost.

The loop must never wait for another writer, so the loop has a connection of its own
whose busy timeout is 0: when another connection holds the write lock (a renewal, the
Recover scan, another worker on the same file), ``BEGIN IMMEDIATE`` fails at once and
the exchange goes to the commit thread, which waits for the lock as before.

The exchange is made when it is sent: its answer is ready at once. The loop answers an
exchange when its socket is readable (:mod:`celery_pulse.leases.loop`), so a made one
hands it a pipe that is always readable: the answer is given while the loop handles
events, as PostgreSQL's is, and what its callbacks schedule runs on the next turn.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import weakref
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.records import Exchanged

#: SQLite's result code for a lock held by another connection.
SQLITE_BUSY = 5


def busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says another connection holds the lock."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    return code == SQLITE_BUSY if code is not None else "locked" in str(exc)


class ReadyFlight:
    """The socket side of an exchange made already: an always-readable pipe."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @property
    def fileno(self) -> int:
        return self._fd

    @property
    def writing(self) -> bool:
        return False

    @property
    def done(self) -> bool:
        return True

    def step(self) -> bool:
        return True

    def send_more(self) -> bool:
        return False

    def wait(self, timeout: float | None) -> None:
        """Nothing to wait for."""

    def abandon(self) -> None:
        """Nothing in flight."""


class MadeExchange:
    """An exchange made on the loop, its answers ready (a ``PendingExchange``)."""

    def __init__(self, flight: ReadyFlight, answers: Exchanged) -> None:
        self.flight = flight
        self.answers = answers

    def finish(self, *, blocking: bool) -> Exchanged:
        return self.answers


class LoopConnection:
    """The event loop's own driver connection (busy timeout 0) and its ready pipe.

    Used from the loop's thread only. Checked out of the engine's pool once and kept, so
    it is set up as every connection is (WAL, ``synchronous``, foreign keys).
    """

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self._raw: Any = None
        self._ready: ReadyFlight | None = None

    def driver(self) -> sqlite3.Connection:
        """The connection (made on first use); raises the driver's error."""
        if self._raw is None:
            raw = self.engine.raw_connection()
            db: sqlite3.Connection = raw.driver_connection  # type: ignore[assignment]
            try:
                db.execute("PRAGMA busy_timeout=0").fetchall()
            except BaseException:
                raw.invalidate()
                raise
            self._raw = raw
        return self._raw.driver_connection  # type: ignore[no-any-return]

    @property
    def ready(self) -> ReadyFlight:
        """A flight whose socket is always readable (one pipe, made on first use)."""
        if self._ready is None:
            read, write = os.pipe()
            os.write(write, b"!")  # never read: the pipe stays readable
            weakref.finalize(self, _close_fds, (read, write))
            self._ready = ReadyFlight(read)
        return self._ready

    def rolled_back(self) -> None:
        """After an error: roll back what the connection holds, or drop it."""
        raw = self._raw
        if raw is None:
            return
        try:
            if raw.driver_connection.in_transaction:
                raw.driver_connection.execute("ROLLBACK")
        except sqlite3.Error:
            self._raw = None
            with contextlib.suppress(Exception):
                raw.invalidate()

    def close(self) -> None:
        """Close the connection (never back to the pool: its busy timeout is 0)."""
        raw, self._raw = self._raw, None
        if raw is not None:
            with contextlib.suppress(Exception):
                raw.invalidate()


def _close_fds(fds: tuple[int, int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
