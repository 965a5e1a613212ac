"""Engine construction: SQLite gets WAL + busy timeout; PostgreSQL and MySQL/MariaDB get
bounded connects (and MySQL a session fit for lease decisions).

SQLite under several processes: every write transaction starts ``BEGIN IMMEDIATE`` (it
takes the write lock up front and waits for it up to the busy timeout; a deferred
transaction that read first and then writes would fail at once with SQLITE_BUSY when
another writer got in between, whatever the timeout). A connection marked
:data:`READ_ONLY` starts no transaction at all: each of its statements reads a WAL
snapshot on its own, which no writer blocks, so a process frozen inside a write
transaction (SIGSTOP, a GC pause) stalls the other writers, never the reads.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_pulse.errors import InvalidConfig
from celery_pulse.settings import Settings
from celery_pulse.store.sql import sizing
from celery_pulse.store.sql.errors import failover_error
from celery_pulse.store.sql.pooler import OPTION as POOLER_OPTION
from celery_pulse.store.sql.pooler import Pooler, pooled_transactions
from celery_pulse.store_urls import canonical_store_url

#: How long a SQLite writer waits for the lock held by another process.
SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_CONNECT_TIMEOUT_S = 5
#: How long a session of the store may sit idle inside a transaction before the server
#: ends it. pulse's own transactions never idle (a few statements back to back), so
#: only a process paused mid-transaction (SIGSTOP, a frozen VM) meets it: its row locks
#: (a beat slot, the leader's row, claims) are freed in seconds, not when it wakes.
IDLE_IN_TRANSACTION_S = 2
#: The gateway's limit on one store operation (seed 003 §6: 8 s). Its own deadline
#: answers the worker UNAVAILABLE then; this makes the server cancel the statement too,
#: so nothing of it runs (or waits on a lock) after its answer was given up.
GATEWAY_STATEMENT_S = 8
#: The execution option of a connection that only reads, each statement on its own
#: (``engine.connect().execution_options(**{READ_ONLY: True})``): on SQLite it begins no
#: transaction, so it never waits for the write lock (see the module doc).
READ_ONLY = "pulse_read_only"
#: What to install for ``postgresql+psycopg://`` (psycopg 3 is an extra, not a dependency).
PG_INSTALL = 'pip install "celery-pulse-leases[postgres]"'


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How a process opens its engine beyond the URL: what the connections are for (the
    role: ``worker`` the worker's parent, ``child`` a pool process, ``cli``, ``beat``, ``flower``,
    ``backend``, ``gateway``: :data:`.sizing.ROLES`), and the settings that shape its connections."""

    role: str = "worker"
    #: The most pooled connections (``pulse_store_pool_size``; see :mod:`.sizing`).
    pool_size: int = sizing.DEFAULT_POOL_SIZE
    #: How long a thread waits for a pooled connection before StoreUnavailable.
    pool_timeout: float = sizing.POOL_TIMEOUT_S
    #: ``pulse_store_pooler`` and ``pulse_store_listen_url`` (see :mod:`.pooler`).
    pooler: str = "auto"
    listen_url: str | None = None

    @classmethod
    def of(cls, settings: Settings, role: str) -> EngineOptions:
        """The options ``settings`` give the engine of a process in ``role``."""
        return cls(role=role, pool_size=settings.store_pool_size,
                   pool_timeout=sizing.pool_timeout(settings.renew_interval),
                   pooler=settings.store_pooler, listen_url=settings.store_listen_url)

    def pool(self) -> dict[str, Any]:
        """The pool arguments of a server's engine (:func:`.sizing.pool_arguments`)."""
        return sizing.pool_arguments(self.role, self.pool_size, self.pool_timeout)


def make_engine(url: str, options: EngineOptions | None = None) -> sa.Engine:
    """An engine for ``url``, configured for several worker processes sharing the store."""
    options = options or EngineOptions()
    parsed = make_url(canonical_store_url(url))
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed)
    if parsed.get_backend_name() in ("mysql", "mariadb"):
        return _named(_mysql_engine(parsed, options), options.role)
    _require("psycopg", "psycopg", PG_INSTALL)
    connect_args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    pooler = Pooler(options.pooler, options.listen_url, options.role)
    engine = _named(sa.create_engine(parsed, connect_args=connect_args,
                                     execution_options={POOLER_OPTION: pooler},
                                     **options.pool()), options.role)
    pooled_transactions(engine, pooler, IDLE_IN_TRANSACTION_S)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        if pooler.transaction:  # a session setting would stay on the server connection
            return
        # A session setting, not the URL's ``options`` (which may carry search_path).
        with dbapi_conn.cursor() as cur:
            cur.execute(f"SET idle_in_transaction_session_timeout = "
                        f"{IDLE_IN_TRANSACTION_S * 1000}")
            if options.role == "gateway":
                cur.execute(f"SET statement_timeout = {GATEWAY_STATEMENT_S * 1000}")
        dbapi_conn.commit()

    drop_on_failover(engine)
    return engine


def drop_on_failover(engine: sa.Engine) -> None:
    """Treat an error that says "not the primary" as a lost connection: the engine's
    pooled connections are closed (they reach the same server), so the next checkout
    connects afresh and libpq's ``target_session_attrs=read-write`` finds the new
    primary of a multi-host URL. A read-only server's sessions would otherwise stay in
    the pool, every write refused, for as long as it lives. A connection another thread
    had checked out then is closed when it is checked in (a disposed pool would keep it,
    idle on the old primary, until the garbage collector found the pool).
    Idempotent: ``lease.fenced()`` also installs it on the application's engine."""
    if not sa.event.contains(engine, "handle_error", _failover_is_disconnect):
        sa.event.listen(engine, "handle_error", _failover_is_disconnect)
        sa.event.listen(engine, "connect", _stamp)
        sa.event.listen(engine, "checkin", _drop_if_older_than_failover)


def failed_over(engine: sa.Engine) -> None:
    """The server said it is no longer the primary: every connection made before now is
    closed, the idle ones at once, the checked-out ones when they are checked in."""
    global _FAILED_OVER_AT
    _FAILED_OVER_AT = time.monotonic()
    engine.dispose()


#: When this process last heard "not the primary" (monotonic; 0: never). Process-wide:
#: a connection made before it may reach the old primary, whichever engine holds it.
_FAILED_OVER_AT = 0.0
_BORN = "pulse_connected_at"


def _failover_is_disconnect(context: Any) -> None:
    if failover_error(context.original_exception):
        context.is_disconnect = True
        failed_over(context.engine)


def _stamp(dbapi_conn: Any, record: Any) -> None:
    record.info[_BORN] = time.monotonic()


def _drop_if_older_than_failover(dbapi_conn: Any, record: Any) -> None:
    if dbapi_conn is not None and record.info.get(_BORN, 0.0) < _FAILED_OVER_AT:
        record.invalidate()


#: MySQL/MariaDB drivers pulse accepts, by SQLAlchemy driver name: the module each needs
#: and what to install. A URL that names none (``mysql://``, ``mariadb://``) gets PyMySQL,
#: which installs everywhere (SQLAlchemy alone would pick mysqlclient).
MYSQL_DRIVERS = {
    "pymysql": ("pymysql", "pip install 'celery-pulse-leases[mysql]'"),
    "mysqldb": ("MySQLdb", "pip install mysqlclient (needs libmariadb-dev or "
                           "libmysqlclient-dev and a compiler)"),
    "mariadbconnector": ("mariadb", "pip install mariadb (needs libmariadb-dev)"),
}


def _require(driver: str, module: str, install: str) -> None:
    """Raise InvalidConfig (with what to install) unless ``module`` imports: one line,
    not the ImportError's traceback from deep inside SQLAlchemy."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise InvalidConfig(f"pulse_store_url: the {driver} driver is not installed: {install}",
                            setting="pulse_store_url") from None


def _mysql_driver(parsed: sa.URL) -> str:
    """The driver a MySQL/MariaDB URL names, checked to be importable."""
    driver = parsed.get_driver_name() if "+" in parsed.drivername else "pymysql"
    if driver not in MYSQL_DRIVERS:
        raise InvalidConfig(f"pulse_store_url: unsupported MySQL/MariaDB driver {driver!r}; "
                            f"use one of {', '.join(MYSQL_DRIVERS)}", setting="pulse_store_url")
    module, install = MYSQL_DRIVERS[driver]
    _require(driver, module, install)
    return driver


def _named(engine: sa.Engine, role: str) -> sa.Engine:
    """Each new connection of ``engine`` says it is pulse's, in ``role`` (:mod:`.sizing`)."""

    @sa.event.listens_for(engine, "do_connect")
    def _on_do_connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]
                       ) -> None:
        sizing.name_connection(engine.dialect.name, engine.dialect.driver, role, cparams)

    return engine


def _mysql_engine(parsed: sa.URL, options: EngineOptions) -> sa.Engine:
    """READ COMMITTED: a locking read takes no gap locks, and every lease decision reads
    under a lock or runs in one statement, so REPEATABLE READ's snapshot never decides.
    """
    driver = _mysql_driver(parsed)
    parsed = parsed.set(drivername=f"{parsed.get_backend_name()}+{driver}")
    connect_args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    if driver != "mariadbconnector":  # that one speaks utf8mb4 already, and has no charset
        connect_args["charset"] = "utf8mb4"
    # The server closes idle connections after wait_timeout (8 h by default).
    # The pool would roll back every returned connection, and PyMySQL sends that
    # ROLLBACK even right after a COMMIT (measured: a fifth of the hot path's round
    # trips). Instead the connection's own transaction events say whether one is open.
    engine = sa.create_engine(parsed, pool_recycle=3600, isolation_level="READ COMMITTED",
                              connect_args=connect_args, pool_reset_on_return=None,
                              **options.pool())
    _track_transactions(engine)
    if driver in MULTI_STATEMENT_DRIVERS:

        @sa.event.listens_for(engine, "do_connect")
        def _multi_statements(_dialect: Any, _record: Any, _cargs: Any,
                              cparams: dict[str, Any]) -> None:
            cparams["client_flag"] = cparams.get("client_flag", 0) | _CLIENT_MULTI_STATEMENTS

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # The server's version comes with the handshake: no query to tell them apart.
        if "mariadb" in _server_info(dbapi_conn).lower():  # MySQL has no equivalent
            cur = dbapi_conn.cursor()
            try:
                cur.execute(f"SET SESSION idle_transaction_timeout = {IDLE_IN_TRANSACTION_S}")
                if options.role == "gateway":
                    cur.execute(f"SET SESSION max_statement_time = {GATEWAY_STATEMENT_S}")
            finally:
                cur.close()

    return engine


def _server_info(dbapi_conn: Any) -> str:
    """The server's version string from the handshake (each driver names it its own way)."""
    info = getattr(dbapi_conn, "server_info", None)  # MariaDB Connector/Python
    if isinstance(info, str):
        return info
    return str(dbapi_conn.get_server_info())  # PyMySQL, mysqlclient


#: In a pooled connection's ``info``: whether a transaction may be open on it (a
#: returned connection is rolled back only then).
TRANSACTION_OPEN = "pulse_transaction_open"
#: The drivers that interpolate parameters into the statement's text themselves, so one
#: call may carry several statements (:mod:`.mysql_packet`); their connections are
#: opened with ``CLIENT_MULTI_STATEMENTS``.
MULTI_STATEMENT_DRIVERS = ("pymysql", "mysqldb")
#: The MySQL protocol's capability flag for several statements in one query.
_CLIENT_MULTI_STATEMENTS = 1 << 16


def _track_transactions(engine: sa.Engine) -> None:
    """Roll a returned connection back only if a transaction may still be open on it."""

    @sa.event.listens_for(engine, "begin")
    def _began(conn: sa.Connection) -> None:
        conn.connection.info[TRANSACTION_OPEN] = True

    @sa.event.listens_for(engine, "commit")
    @sa.event.listens_for(engine, "rollback")
    def _ended(conn: sa.Connection) -> None:
        conn.connection.info[TRANSACTION_OPEN] = False

    @sa.event.listens_for(engine, "reset")
    def _on_reset(dbapi_conn: Any, record: Any, _state: Any) -> None:
        info = getattr(record, "info", None)
        if info is None or info.get(TRANSACTION_OPEN, True):  # unknown (e.g. garbage-collected): roll back
            dbapi_conn.rollback()
            if info is not None:
                info[TRANSACTION_OPEN] = False


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
        if not conn.get_execution_options().get(READ_ONLY):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
