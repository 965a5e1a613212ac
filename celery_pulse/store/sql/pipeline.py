"""The worker's hot path on PostgreSQL: one psycopg connection in pipeline mode.

Completions, reservations and starts of one group commit go out together: one round
trip, one ``Sync``, one implicit transaction (all or nothing), prepared statements.
:meth:`Pipeline.run` drives libpq's pipeline itself, through psycopg's ``pgconn``: the
parameters and rows go through psycopg's own (compiled) adapters, but not through its
cursors, its query parser or its pipeline generators, whose Python cost per statement
was the largest share of the worker parent's CPU on short tasks (a quarter of it, ahead
of Celery's own AMQP handling). The rest of the store keeps SQLAlchemy.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import select
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import abc, pq
from psycopg.adapt import PyFormat, Transformer

from celery_pulse.errors import StoreUnavailable
from celery_pulse.store.sql import pooler
from celery_pulse.store.sql.engine import failed_over
from celery_pulse.store.sql.errors import driver_translated, failover_error, translated
from celery_pulse.store.sql.libpq_io import SocketCalls

#: Prepared statements kept per connection (psycopg's own default), least recently used
#: first out: a batch's size and its parameters' types make a statement of its own.
PREPARED_MAX = 100

_OK = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)

#: A transaction over more than one round trip (:mod:`.pipeline_tx`) opens and ends
#: with these, sent unprepared.
BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED"
COMMIT = "COMMIT"
_UNPREPARED = frozenset((BEGIN, COMMIT))


class Pipeline:
    """A dedicated connection (out of the engine's pool), used by one thread at a time."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self._raw: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()
        self._tx: abc.Transformer | None = None
        #: (statement, parameter types) -> its prepared name, on this connection.
        self._prepared: collections.OrderedDict[tuple[str, tuple[int, ...]], bytes] = (
            collections.OrderedDict())
        self._named = 0
        self._poll: Any = None
        self._io: SocketCalls | None = None
        #: Unnamed statements only (parse, bind, execute in each exchange): a transaction
        #: pooler hands the server connection to another client after each one.
        self.unnamed = False
        #: Statements that cap the transaction's idle time (a transaction pooler, the
        #: server's default being 0): sent right after the ``BEGIN`` of a flight that
        #: ``opens`` a transaction.
        self._cap: list[tuple[str, Sequence[Any]]] = []

    def _connection(self) -> psycopg.Connection[Any]:
        if self._raw is None:
            raw = self.engine.raw_connection()  # the engine's connect arguments and events
            conn: Any = raw.driver_connection
            raw.detach()  # ours for good: it never goes back to the pool
            conn.autocommit = True
            self._raw, self._conn = raw, conn
            self._tx = Transformer.from_context(conn)
            self._io = SocketCalls(conn.pgconn)
            self._prepared.clear()
            found = pooler.of(self.engine)
            self.unnamed = found is not None and found.transaction
            self._cap = ([(pooler.IDLE_CAP_SQL, (str(found.idle_ms),))]
                         if found is not None and found.per_transaction_timeout else [])
            self._poll = select.poll()
            self._poll.register(conn.pgconn.socket, select.POLLIN)
        driver: psycopg.Connection[Any] = self._conn
        return driver

    def run(self, where: str, statements: Sequence[tuple[str, Sequence[Any]]]
            ) -> list[list[tuple[Any, ...]]]:
        """Execute ``statements`` in one round trip; the rows each one returned."""
        flight = self.begin(where, statements)
        flight.wait(None)
        return flight.rows()

    def begin(self, where: str, statements: Sequence[tuple[str, Sequence[Any]]], *,
              opens: bool = False) -> InFlight:
        """Send ``statements`` (one round trip, one implicit transaction) without waiting
        for the answer: the caller drives the returned :class:`InFlight` to its end, from
        an event loop (:meth:`InFlight.step` when the socket is readable) or blocking
        (:meth:`InFlight.wait`). The connection is the flight's until it ends.

        With ``opens``, the statements open a transaction that later round trips
        continue (:meth:`InFlight.follow`): ``BEGIN`` goes first (and what caps its idle
        time where a transaction pooler needs it)."""
        self._lock.acquire()
        return self._begin(where, statements, opens)

    def begin_now(self, where: str, statements: Sequence[tuple[str, Sequence[Any]]], *,
                  opens: bool = False) -> InFlight | None:
        """:meth:`begin`, or None where that could block: the connection is in use by
        another thread, or not open (connecting waits for the server)."""
        if not self._lock.acquire(blocking=False):
            return None
        if self._raw is None:
            self._lock.release()
            return None
        return self._begin(where, statements, opens)

    def _begin(self, where: str, statements: Sequence[tuple[str, Sequence[Any]]],
               opens: bool = False) -> InFlight:
        try:
            # SQLAlchemy's errors while connecting, psycopg's after
            with translated(where), driver_translated(where):
                conn = self._connection()
                opening = [(BEGIN, ()), *self._cap] if opens else []
                ours, new = self._queue(conn, [*opening, *statements])
                flight = InFlight(self, where, conn, ours, new, len(opening))
        except BaseException as exc:
            self.failed(exc)
            self._lock.release()
            raise
        return flight

    def _queue(self, conn: psycopg.Connection[Any],
               statements: Sequence[tuple[str, Sequence[Any]]]
               ) -> tuple[list[bool], list[tuple[tuple[str, tuple[int, ...]], bytes]]]:
        """Queue every statement (each prepared once per connection) and the ``Sync``."""
        pg, tx = conn.pgconn, self._tx
        assert tx is not None
        prepared = self._prepared
        new: list[tuple[tuple[str, tuple[int, ...]], bytes]] = []
        ours: list[bool] = []  # per command sent: one of ``statements`` (not a PREPARE)
        pg.enter_pipeline_mode()
        for sql, params in statements:
            params = [array_literal(p) if type(p) is list else p for p in params]
            values = tx.dump_sequence(params, [PyFormat.AUTO] * len(params))
            types = tx.types or ()
            if self.unnamed or sql in _UNPREPARED:
                pg.send_query_params(_native(sql), values, param_types=types,
                                     param_formats=tx.formats)
                ours.append(True)
                continue
            key = (sql, types)
            name = prepared.get(key)
            if name is None:
                if prepared and len(prepared) + len(new) >= PREPARED_MAX:
                    _, old = prepared.popitem(last=False)
                    pg.send_query_params(b"DEALLOCATE " + old, None)
                    ours.append(False)
                self._named += 1
                name = b"pulse_%d" % self._named
                pg.send_prepare(name, _native(sql), param_types=types)
                ours.append(False)
                new.append((key, name))
            else:
                prepared.move_to_end(key)
            pg.send_query_prepared(name, values, param_formats=tx.formats)
            ours.append(True)
        assert self._io is not None
        self._io.sync()
        return ours, new

    def failed(self, exc: BaseException | None) -> None:
        """A failed pipeline leaves the connection unusable: close it. If the server
        said it is no longer the primary (read-only, shutting down), the engine's pooled
        connections reach it too: the pool is replaced, so that every connection is
        made afresh, to whichever host of the URL is read-write now."""
        self.close()
        if failover_error(exc):
            failed_over(self.engine)

    def close(self) -> None:
        conn, self._raw, self._conn = self._conn, None, None
        self._tx = self._poll = self._io = None
        if conn is not None:
            # The driver's own close: the detached pool wrapper would first try a
            # rollback, and log a traceback when the server is already gone.
            with contextlib.suppress(Exception):
                conn.close()


class InFlight:
    """One exchange sent on a :class:`Pipeline` and not read back yet.

    Driven by :meth:`step` (never blocks: for an event loop, when :attr:`fileno` is
    readable or :attr:`writing` is still due) or :meth:`wait`. Once :attr:`done`,
    :meth:`rows` gives the statements' rows (or raises the first one's error). Any
    failure closes the connection; either way the pipeline is free again at the end.
    """

    def __init__(self, pipeline: Pipeline, where: str, conn: psycopg.Connection[Any],
                 ours: list[bool], new: list[tuple[tuple[str, tuple[int, ...]], bytes]],
                 skip: int = 0) -> None:
        self.pipeline, self.where, self.conn = pipeline, where, conn
        self._ours, self._new = ours, new
        #: Statements the caller did not send (a transaction's opening): no rows given.
        self._skip = skip
        self._results: list[Any] = []
        self._last: Any = None
        self._ended = False
        pg = conn.pgconn
        self.fileno: int = pg.socket
        self.done = False
        assert pipeline._io is not None
        self._io = pipeline._io
        #: libpq's buffer isn't all sent yet: call :meth:`step` again (socket writable).
        self.writing = self._io.flush()

    def step(self) -> bool:
        """Send what is left, read what arrived; True once every result is in."""
        if not self.done:
            with self._guard():
                self._pump()
        return self.done

    def send_more(self) -> bool:
        """Send what libpq still holds (never blocks, reads nothing); True while some of
        it is still unsent."""
        if self.writing:
            with self._guard():
                self.writing = self._io.flush()
        return self.writing

    def _pump(self) -> None:
        if self.writing:
            self.writing = self._io.flush()
        self._io.consume()
        self._read()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """The store's errors for the driver's; any failure drops the connection."""
        try:
            with translated(self.where), driver_translated(self.where):
                yield
        except BaseException as exc:
            self._fail(exc)
            raise

    def _read(self) -> None:
        """Take what libpq has read already (no system call)."""
        pg = self.conn.pgconn
        while not pg.is_busy():
            res = pg.get_result()
            if res is None:  # the end of one command's results
                if self._last is None:
                    return
                self._results.append(self._last)
                self._last = None
            elif res.status == pq.ExecStatus.PIPELINE_SYNC:
                pg.exit_pipeline_mode()
                self.done = True
                return
            else:
                self._last = res

    def wait(self, timeout: float | None) -> None:
        """Block (the GIL released) until every result is in; StoreUnavailable after
        ``timeout`` seconds (None: no limit but the connection's own)."""
        if self.done:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = self.pipeline._poll
        with self._guard():
            self._read()
            while not self.done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise StoreUnavailable(f"store unavailable during {self.where}: "
                                           f"no answer in {timeout:g}s")
                poll.modify(self.fileno,
                            select.POLLIN | (select.POLLOUT if self.writing else 0))
                poll.poll(None if left is None else max(1, int(left * 1000)))
                self._pump()

    def rows(self, *, keep: bool = False) -> list[list[tuple[Any, ...]]]:
        """The rows of each statement, once :attr:`done`. With ``keep``, the pipeline
        stays this flight's, for :meth:`follow` (unless reading failed: the connection
        is closed then)."""
        assert self.done, "rows() before the exchange ended"
        try:
            with self._guard():
                return self._rows()
        finally:
            if not keep:
                self._end()

    def follow(self, where: str, statements: Sequence[tuple[str, Sequence[Any]]]
               ) -> InFlight:
        """The next round trip of a transaction this flight opened (its rows read with
        ``keep``): the connection passes to the flight returned."""
        assert self.done and not self._ended
        self._ended = True  # the lock passes on, not released
        return self.pipeline._begin(where, statements)

    def _rows(self) -> list[list[tuple[Any, ...]]]:
        conn, tx = self.conn, self.pipeline._tx
        assert tx is not None
        for res in self._results:
            if res.status not in _OK:  # the first error: the others were aborted by it
                raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
        self.pipeline._prepared.update(self._new)
        rows: list[list[tuple[Any, ...]]] = []
        for res, mine in zip(self._results, self._ours, strict=True):
            if not mine:
                continue
            if res.status == pq.ExecStatus.TUPLES_OK and res.nfields:
                tx.set_pgresult(res)
                rows.append(tx.load_rows(0, res.ntuples, tuple))
            else:
                rows.append([])
        return rows[self._skip:]

    def abandon(self) -> None:
        """Give up on the answer (its effect unknown): the connection is closed."""
        if not self._ended:
            self._fail()

    def _fail(self, exc: BaseException | None = None) -> None:
        self.pipeline.failed(exc)  # a failed pipeline leaves the connection unusable
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self.pipeline._lock.release()


def array_literal(items: list[Any]) -> str | list[Any]:
    """A list parameter (the store's SQL casts each one: ``%s::text[]``) as PostgreSQL's
    array literal, sent as text: psycopg's list dumper costs 4-5 times more (a dumper
    looked up per element, in Python), and a batch of limited starts sends about twenty
    arrays. A list of anything but str, int, float, bool or None goes as it is."""
    out = []
    for item in items:
        kind = type(item)
        if kind is str:
            out.append('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"')
        elif item is None:
            out.append("NULL")
        elif kind is bool:
            out.append("t" if item else "f")
        elif kind is int or kind is float:
            out.append(repr(item))
        else:
            return items
    return "{" + ",".join(out) + "}"


@functools.lru_cache(maxsize=256)
def _native(sql: str) -> bytes:
    """``%s`` placeholders (the store's SQL) as PostgreSQL's ``$1, $2, ..``."""
    parts = sql.split("%s")
    out = [parts[0]]
    for i, part in enumerate(parts[1:], 1):
        out += [f"${i}", part]
    return "".join(out).encode()
