"""Keys and values of the ``pulse://`` result backend, in the store's ``pulse_results``.

A key-value table with the few operations Celery's key-value backends need (get, mget,
set, delete, incr, expire), judged by the store clock: a row past ``expires_at`` reads as
absent at once and is deleted later, with the finished claims (retention). Knows nothing
of Celery: the backend (:mod:`celery_pulse.backend`) names the keys and encodes values.

Two rules are decided by the statement itself, never by a read before it:

* ``set(..., final=...)``: a row whose state is ``final`` (Celery's ``SUCCESS``) is never
  overwritten: a duplicate or stale attempt cannot replace a success.
* ``incr``: one atomic upsert per call, so concurrent chord parts each count once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.base import ResultRecord
from celery_pulse.store.sql import pooler
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.errors import driver_translated, translated
from celery_pulse.store.sql.tables import results

#: Rows deleted per statement by :meth:`ResultRows.purge_expired`.
PURGE_BATCH = 500
#: PostgreSQL: the channel a trigger announces every value written on (migration 0008),
#: the key as the payload.
CHANNEL = "pulse_results"
#: Elsewhere a waiter polls, first after this long, doubling up to its interval.
FIRST_POLL = 0.005


class Watch:
    """Waits for a write to one of ``keys`` (see :meth:`ResultRows.watch`)."""

    def __init__(self, keys: set[str], conn: Any = None) -> None:
        self.keys = keys
        self._conn = conn
        self._step = FIRST_POLL

    def wait(self, seconds: float) -> None:
        """Until one of the keys is written (PostgreSQL), or a poll's time (else); never
        longer than ``seconds``."""
        if self._conn is None:
            nap = min(self._step, max(0.0, seconds))
            self._step = min(self._step * 2, max(seconds, FIRST_POLL))
            time.sleep(nap)
            return
        end = time.monotonic() + max(0.0, seconds)
        while (left := end - time.monotonic()) > 0:
            for note in self._conn.notifies(timeout=left, stop_after=1):
                if note.payload in self.keys:
                    return


def fenced_upsert_cte(records: int, clock: str, done: str = "done") -> str:
    """PostgreSQL: CTEs that write ``records`` results, each only if its task id is in
    ``done`` (the completion's ``RETURNING``), in the completion's own statement.

    Parameters, after the completion's: task_id, key, value, state, expires per record,
    then the ``final`` state they share (a live row in it is kept, as by ``set``).
    """
    row = "(%s, %s, %s::bytea, %s, %s::float8)"
    return (f"r(task_id, key, value, state, expires) AS (VALUES "
            f"{', '.join([row] * records)}), "
            f"w AS (INSERT INTO pulse_results AS p "
            f"(key, value, counter, state, updated_at, expires_at) "
            f"SELECT r.key, r.value, NULL, r.state, {clock}, "
            f"CASE WHEN r.expires > 0 THEN {clock} + r.expires END "
            f"FROM r JOIN {done} ON {done}.task_id = r.task_id "
            f"ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, counter = NULL, "
            f"state = EXCLUDED.state, updated_at = EXCLUDED.updated_at, "
            f"expires_at = EXCLUDED.expires_at "
            f"WHERE p.state IS DISTINCT FROM %s OR p.expires_at <= {clock})")


def fenced_upsert_params(records: Sequence[tuple[str, ResultRecord]]) -> list[Any]:
    """The parameters of :func:`fenced_upsert_cte` for ``(task_id, record)`` pairs."""
    finals = {record.final for _, record in records}
    if len(finals) != 1:
        raise ValueError(f"one statement writes results of one final state, not {finals}")
    params: list[Any] = []
    for task_id, record in records:
        params += [task_id, record.key, record.value, record.state, record.expires or 0.0]
    return [*params, finals.pop()]


class ResultRows:
    """The ``pulse_results`` table on one engine."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.conns = Connections(engine)
        self.dialect = self.conns.dialect
        self._now = self.conns.now
        #: The connection a :meth:`watch` of this thread listens on: its reads use it too,
        #: so a waiter holds one pooled connection, not two (a pool of N serves N waiters).
        self._watching = threading.local()

    def _write(self, where: str) -> AbstractContextManager[sa.Connection]:
        """One atomic write: autocommit on PostgreSQL (one round trip), a transaction
        elsewhere (SQLite's takes the write lock at BEGIN)."""
        return self.conns.writing(where)

    def _read(self, where: str) -> AbstractContextManager[sa.Connection]:
        listening: sa.Connection | None = getattr(self._watching, "conn", None)
        if listening is not None:
            return _translated_on(where, listening)
        return self.conns.reading(where, outside_transaction=False)

    def _live(self) -> sa.ColumnElement[bool]:
        return sa.or_(results.c.expires_at.is_(None), results.c.expires_at > self._now)

    def _until(self, seconds: float | None) -> Any:
        return None if not seconds else self._now + float(seconds)

    # -- reads ------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        with self._read("result get") as conn:
            value = conn.execute(sa.select(results.c.value).where(
                results.c.key == key, self._live())).scalar_one_or_none()
        return None if value is None else bytes(value)

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        with self._read("result mget") as conn:
            rows = dict(conn.execute(sa.select(results.c.key, results.c.value).where(
                results.c.key.in_(list(keys)), self._live())).tuples().all())
        return [None if rows.get(k) is None else bytes(rows[k]) for k in keys]

    @contextmanager
    def watch(self, keys: Sequence[str]) -> Iterator[Watch]:
        """Watch ``keys`` for writes. Enter it before reading them: on PostgreSQL it
        listens first, so a write committed between the read and the wait still wakes it."""
        with translated("result watch"):
            polls = not self.dialect.notifies or not pooler.listens(self.engine)
        if polls:
            yield Watch(set(keys))  # polls (docs/production.md#pgbouncer)
            return
        with translated("result watch"), driver_translated("result watch"):
            direct = pooler.direct_listener(self.engine, CHANNEL)
        if direct is not None:
            try:
                yield Watch(set(keys), direct)
            finally:
                direct.close()
            return
        with translated("result watch"):
            # Autocommit: the LISTEN takes effect at once, and each read sees the latest.
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            try:
                conn.exec_driver_sql(f"LISTEN {CHANNEL}")
            except BaseException:
                conn.invalidate()
                conn.close()
                raise
        self._watching.conn = conn
        try:
            yield Watch(set(keys), conn.connection.driver_connection)
        finally:
            self._watching.conn = None
            try:
                conn.exec_driver_sql(f"UNLISTEN {CHANNEL}")
            except Exception:  # broken: the pool must not have it back
                conn.invalidate()
            conn.close()

    def counter(self, key: str) -> int | None:
        with self._read("result counter") as conn:
            value = conn.execute(sa.select(results.c.counter).where(
                results.c.key == key, self._live())).scalar_one_or_none()
        return None if value is None else int(value)

    # -- writes -----------------------------------------------------------------------
    def set(self, key: str, value: bytes, *, state: str | None = None,
            expires: float | None = None, final: str | None = None) -> bool:
        """Store ``value`` under ``key`` (expiring in ``expires`` seconds; none if falsy).

        ``final``: keep a live row already in that state as it is. Returns False when it did.
        """
        with self._write("result set") as conn:
            return self._upsert(conn, key, value, state, expires, final)

    def _upsert(self, conn: sa.Connection, key: str, value: bytes, state: str | None,
                expires: float | None, final: str | None) -> bool:
        now, until = self._now, self._until(expires)
        values = {"key": key, "value": value, "state": state, "counter": None,
                  "updated_at": now, "expires_at": until}
        if not self.dialect.returning:  # MySQL
            # MySQL assigns an upsert's columns left to right, each seeing the ones
            # before: a guard on two old columns cannot be written there. The row lock
            # taken by the read decides instead.
            if final is not None:
                old = conn.execute(sa.select(results.c.state, self._live().label("live"))
                                   .where(results.c.key == key).with_for_update()).first()
                if old is not None and old.state == final and old.live:
                    return False
            stmt = self.dialect.insert(results).values(**values)
            conn.execute(stmt.on_duplicate_key_update(
                {c: stmt.inserted[c.name] for c in results.c if c.name != "key"}))
            return True
        stmt = self.dialect.insert(results).values(**values)
        excluded = stmt.excluded
        where = (None if final is None else
                 sa.or_(results.c.state.is_(None), results.c.state != final,
                        sa.not_(self._live())))
        stmt = stmt.on_conflict_do_update(
            index_elements=[results.c.key],
            set_={"value": excluded.value, "state": excluded.state, "counter": None,
                  "updated_at": excluded.updated_at, "expires_at": excluded.expires_at},
            where=where).returning(results.c.key)
        return conn.execute(stmt).first() is not None

    def write_fenced(self, conn: sa.Connection, records: Sequence[ResultRecord]) -> None:
        """In a completion's transaction (SQLite, MySQL/MariaDB): the results of the
        completions it applied. PostgreSQL writes them in the completion's statement
        (:func:`fenced_upsert_cte`)."""
        for record in sorted(records, key=lambda r: r.key):  # one lock order
            if record.value is not None:
                self._upsert(conn, record.key, record.value, record.state, record.expires,
                             record.final)

    def count_parts(self, conn: sa.Connection, parts: Sequence[tuple[str, ResultRecord]]
                    ) -> dict[str, tuple[int, str]]:
        """In a completion's transaction: add one to each applied part's counter.

        Returns ``task_id -> (count, nonce)``: parts of one counter in one call count in
        task id order (so exactly one of them makes any given count). A counter created
        here, or found expired, starts again with a new nonce.
        """
        by_key: dict[str, list[tuple[str, ResultRecord]]] = {}
        for task_id, record in parts:
            if record.counter is not None:
                by_key.setdefault(record.counter, []).append((task_id, record))
        out: dict[str, tuple[int, str]] = {}
        for key in sorted(by_key):  # one lock order
            members = sorted(by_key[key], key=lambda part: part[0])
            after, nonce = self._add(conn, key, len(members), members[0][1].expires,
                                     members[0][1].counter_note)
            for offset, (task_id, _) in enumerate(members):
                out[task_id] = (after - len(members) + 1 + offset, nonce)
        return out

    def _add(self, conn: sa.Connection, key: str, amount: int, expires: float | None,
             note: bytes | None) -> tuple[int, str]:
        """Add ``amount`` to the counter at ``key``; its new value and its nonce. ``note``
        is kept as the counter's value if it has none."""
        now, until = self._now, self._until(expires)
        stmt = self.dialect.insert(results).values(
            key=key, value=note, counter=amount, state=self.dialect.new_token(),
            updated_at=now, expires_at=until)
        restart = sa.not_(self._live())
        if not self.dialect.returning:  # MySQL
            # Left to right: the counter, nonce and note read the old expiry, so they go
            # first.
            conn.execute(stmt.on_duplicate_key_update({
                results.c.value: sa.case((sa.or_(restart, results.c.value.is_(None)),
                                          stmt.inserted.value), else_=results.c.value),
                results.c.state: sa.case((sa.or_(restart, results.c.state.is_(None)),
                                          stmt.inserted.state), else_=results.c.state),
                results.c.counter: sa.case(
                    (restart, amount), else_=sa.func.coalesce(results.c.counter, 0) + amount),
                results.c.updated_at: stmt.inserted.updated_at,
                results.c.expires_at: stmt.inserted.expires_at,
            }))
            row = conn.execute(sa.select(results.c.counter, results.c.state).where(
                results.c.key == key)).one()
        else:
            row = conn.execute(stmt.on_conflict_do_update(
                index_elements=[results.c.key],
                set_={"counter": sa.case((restart, amount),
                                         else_=sa.func.coalesce(results.c.counter, 0) + amount),
                      "state": sa.case((sa.or_(restart, results.c.state.is_(None)),
                                        stmt.excluded.state), else_=results.c.state),
                      "value": sa.case((sa.or_(restart, results.c.value.is_(None)),
                                        stmt.excluded.value), else_=results.c.value),
                      "updated_at": stmt.excluded.updated_at,
                      "expires_at": stmt.excluded.expires_at},
            ).returning(results.c.counter, results.c.state)).one()
        return int(row[0]), str(row[1])

    def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        with self._write("result delete") as conn:
            return int(conn.execute(sa.delete(results).where(
                results.c.key.in_(list(keys)))).rowcount)

    def incr(self, key: str, expires: float | None = None) -> int:
        """Add one to the counter at ``key`` (a missing or expired one starts at 0)."""
        now, until = self._now, self._until(expires)
        stmt = self.dialect.insert(results).values(
            key=key, value=None, state=None, counter=1, updated_at=now, expires_at=until)
        restart = sa.not_(self._live())
        bumped = sa.case((restart, 1), else_=sa.func.coalesce(results.c.counter, 0) + 1)
        with self._write("result incr") as conn:
            if not self.dialect.returning:  # MySQL
                conn.execute(stmt.on_duplicate_key_update({
                    # Left to right: the counter reads the old expiry, so it goes first.
                    results.c.counter: bumped,
                    results.c.updated_at: stmt.inserted.updated_at,
                    results.c.expires_at: stmt.inserted.expires_at,
                }))
                value = conn.execute(sa.select(results.c.counter).where(
                    results.c.key == key)).scalar_one()
            else:
                value = conn.execute(stmt.on_conflict_do_update(
                    index_elements=[results.c.key],
                    set_={"counter": bumped, "updated_at": stmt.excluded.updated_at,
                          "expires_at": stmt.excluded.expires_at},
                ).returning(results.c.counter)).scalar_one()
        return int(value)

    def expire(self, key: str, seconds: float | None) -> None:
        """Let ``key`` live ``seconds`` from now (falsy: for ever)."""
        with self._write("result expire") as conn:
            conn.execute(sa.update(results).where(results.c.key == key, self._live())
                         .values(expires_at=self._until(seconds)))

    def stale_counters(self, prefix: str, older_than: float, limit: int = 100
                       ) -> list[tuple[str, int, str, bytes | None]]:
        """Live counters created by fenced completions (they have a nonce), not touched
        for ``older_than`` seconds: ``(key, count, nonce, note)``. What a worker that died
        between counting and finishing left behind (or a count still in progress)."""
        with self._read("result counters") as conn:
            rows = conn.execute(
                sa.select(results.c.key, results.c.counter, results.c.state, results.c.value)
                .where(results.c.key.startswith(prefix, autoescape=True),
                       results.c.counter.is_not(None), results.c.state.is_not(None),
                       results.c.updated_at < self._now - older_than, self._live())
                .order_by(results.c.updated_at).limit(limit)).all()
        return [(str(r[0]), int(r[1]), str(r[2]), None if r[3] is None else bytes(r[3]))
                for r in rows]

    def purge_expired(self, limit: int = PURGE_BATCH) -> int:
        """Delete up to ``limit`` rows past their expiry."""
        expired = results.c.expires_at < self._now
        with self._write("result purge") as conn:
            if not self.dialect.limited_subqueries:  # MySQL
                stmt = sa.delete(results).where(expired).with_dialect_options(mysql_limit=limit)
            else:
                stmt = sa.delete(results).where(results.c.key.in_(
                    sa.select(results.c.key).where(expired).limit(limit).scalar_subquery()))
            return int(conn.execute(stmt).rowcount)


@contextmanager
def _translated_on(where: str, conn: sa.Connection) -> Iterator[sa.Connection]:
    """``conn`` (already open, not ours to close) with its driver errors translated."""
    with translated(where):
        yield conn
