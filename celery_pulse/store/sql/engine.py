"""Engine construction: SQLite gets WAL + busy timeout; PostgreSQL and MySQL/MariaDB get
bounded connects (and MySQL a session fit for lease decisions)."""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

#: How long a SQLite writer waits for the lock held by another process.
SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_CONNECT_TIMEOUT_S = 5
#: How long a session of the store may sit idle inside a transaction before the server
#: ends it. pulse's own transactions never idle (a few statements back to back), so
#: only a process paused mid-transaction (SIGSTOP, a frozen VM) meets it: its row locks
#: (a beat slot, the leader's row, claims) are freed in seconds, not when it wakes.
IDLE_IN_TRANSACTION_S = 2


def make_engine(url: str) -> sa.Engine:
    """An engine for ``url``, configured for several worker processes sharing the store."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed)
    if parsed.get_backend_name() in ("mysql", "mariadb"):
        return _mysql_engine(parsed)
    connect_args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    engine = sa.create_engine(parsed, pool_size=4, max_overflow=8,
                              connect_args=connect_args)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # A session setting, not the URL's ``options`` (which may carry search_path).
        with dbapi_conn.cursor() as cur:
            cur.execute(f"SET idle_in_transaction_session_timeout = "
                        f"{IDLE_IN_TRANSACTION_S * 1000}")
        dbapi_conn.commit()

    return engine


def _mysql_engine(parsed: sa.URL) -> sa.Engine:
    """READ COMMITTED: a locking read takes no gap locks, and every lease decision reads
    under a lock or runs in one statement, so REPEATABLE READ's snapshot never decides.

    The driver is PyMySQL whatever the URL names (``mysql://`` would mean mysqlclient,
    which needs a compiler and client headers to install).
    """
    try:
        import pymysql  # noqa: F401
    except ImportError:
        from celery_pulse.errors import InvalidConfig

        raise InvalidConfig("pulse_store_url: a MySQL/MariaDB store needs PyMySQL: "
                            "pip install 'celery-pulse-leases[mysql]'",
                            setting="pulse_store_url") from None
    parsed = parsed.set(drivername=f"{parsed.get_backend_name()}+pymysql")
    connect_args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_S,
                                    "charset": "utf8mb4"}
    # The server closes idle connections after wait_timeout (8 h by default).
    # The pool would roll back every returned connection, and PyMySQL sends that
    # ROLLBACK even right after a COMMIT (measured: a fifth of the hot path's round
    # trips). Instead the connection's own transaction events say whether one is open.
    engine = sa.create_engine(parsed, pool_size=4, max_overflow=8, pool_recycle=3600,
                              isolation_level="READ COMMITTED", connect_args=connect_args,
                              pool_reset_on_return=None)
    _track_transactions(engine)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # The server's version comes with the handshake: no query to tell them apart.
        if "mariadb" in dbapi_conn.get_server_info().lower():  # MySQL has no equivalent
            with dbapi_conn.cursor() as cur:
                cur.execute(f"SET SESSION idle_transaction_timeout = {IDLE_IN_TRANSACTION_S}")

    return engine


_OPEN = "pulse_transaction_open"


def _track_transactions(engine: sa.Engine) -> None:
    """Roll a returned connection back only if a transaction may still be open on it."""

    @sa.event.listens_for(engine, "begin")
    def _began(conn: sa.Connection) -> None:
        conn.connection.info[_OPEN] = True

    @sa.event.listens_for(engine, "commit")
    @sa.event.listens_for(engine, "rollback")
    def _ended(conn: sa.Connection) -> None:
        conn.connection.info[_OPEN] = False

    @sa.event.listens_for(engine, "reset")
    def _on_reset(dbapi_conn: Any, record: Any, _state: Any) -> None:
        info = getattr(record, "info", None)
        if info is None or info.get(_OPEN, True):  # unknown (e.g. garbage-collected): roll back
            dbapi_conn.rollback()
            if info is not None:
                info[_OPEN] = False


def _sqlite_engine(parsed: sa.URL) -> sa.Engine:
    database = parsed.database
    if database and database != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(database)) or ".", exist_ok=True)
    engine = sa.create_engine(
        parsed,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False,
                      # We issue BEGIN ourselves (IMMEDIATE: take the write lock up front,
                      # so two writers never deadlock upgrading a read lock).
                      "isolation_level": None},
    )

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
