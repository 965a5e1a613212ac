"""The worker's hot path on PostgreSQL: one psycopg connection in pipeline mode.

Completions, reservations and starts of one group commit go out together: one round
trip, one ``Sync``, one implicit transaction (all or nothing), prepared statements, and
no SQLAlchemy between the worker and the driver (its per-statement work cost more CPU
than the statements themselves on short tasks). The rest of the store keeps SQLAlchemy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa

from celery_pulse.store.sql.errors import driver_translated, translated


class Pipeline:
    """A dedicated connection (out of the engine's pool), used by one thread at a time."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self._raw: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()

    def _connection(self) -> psycopg.Connection[Any]:
        if self._raw is None:
            raw = self.engine.raw_connection()  # the engine's connect arguments and events
            conn: Any = raw.driver_connection
            raw.detach()  # ours for good: it never goes back to the pool
            conn.autocommit = True
            self._raw, self._conn = raw, conn
        driver: psycopg.Connection[Any] = self._conn
        return driver

    def run(self, where: str, statements: Sequence[tuple[str, Sequence[Any]]]
            ) -> list[list[tuple[Any, ...]]]:
        """Execute ``statements`` in one round trip; the rows each one returned."""
        with self._lock:
            try:
                # SQLAlchemy's errors while connecting, psycopg's after
                with translated(where), driver_translated(where):
                    conn = self._connection()
                    with conn.pipeline():
                        cursors = self._send(conn, statements)
                    return [cursor.fetchall() for cursor in cursors]
            except BaseException:
                self.close()  # a failed pipeline leaves the connection unusable
                raise

    def transaction(self, where: str, first: Sequence[tuple[str, Sequence[Any]]],
                    then: Callable[[list[list[tuple[Any, ...]]]],
                                   Sequence[tuple[str, Sequence[Any]]]]
                    ) -> list[list[tuple[Any, ...]]]:
        """One transaction in two round trips: ``first``'s rows decide the statements
        ``then`` returns, which go out with the ``COMMIT``. Their rows."""
        with self._lock:
            try:
                with translated(where), driver_translated(where):
                    conn = self._connection()
                    with conn.pipeline() as pipe, conn.transaction():
                        cursors = self._send(conn, first)
                        pipe.sync()
                        cursors = self._send(conn, then([_rows(c) for c in cursors]))
                    return [_rows(cursor) for cursor in cursors]
            except BaseException:
                self.close()
                raise

    @staticmethod
    def _send(conn: psycopg.Connection[Any], statements: Sequence[tuple[str, Sequence[Any]]]
              ) -> list[psycopg.Cursor[Any]]:
        cursors = []
        for sql, params in statements:
            cursor = conn.cursor()
            cursor.execute(sql, params, prepare=True)
            cursors.append(cursor)
        return cursors

    def close(self) -> None:
        conn, self._raw, self._conn = self._conn, None, None
        if conn is not None:
            # The driver's own close: the detached pool wrapper would first try a
            # rollback, and log a traceback when the server is already gone.
            with contextlib.suppress(Exception):
                conn.close()


def _rows(cursor: psycopg.Cursor[Any]) -> list[tuple[Any, ...]]:
    """A statement's rows; none for one that returns none (an INSERT, a DELETE)."""
    return cursor.fetchall() if cursor.description is not None else []
