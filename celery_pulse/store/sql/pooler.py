"""A connection pooler (PgBouncer) between pulse and PostgreSQL: which mode, and what
each mode allows.

``pulse_store_pooler`` names the mode, or ``auto`` (the default) detects it when the
engine opens its first connection (at start: the worker's first statement), with two
short connections of its own, each probe bounded by :data:`PROBE_TIMEOUT_S`:

* both connections report the same ``pg_backend_pid()`` while both are open, or one
  connection's pid changes between two statements: a server connection went from one
  client to another between transactions, so a *transaction* (or statement) pooler;
* the second connection's statement gets no server within the timeout while the first
  is idle: a *session* pooler whose pool the first one holds (a pool of one);
* otherwise each client has a server of its own: direct or *session* pooling, which
  behave the same (``none``).

A pooler that refuses ``BEGIN`` (statement pooling) is refused at start: pulse needs
transactions of several statements. Under transaction pooling nothing may outlive a
transaction: no named prepared statements (the hot path's pipeline sends unnamed ones,
psycopg's auto-prepare is off), no session settings (``idle_in_transaction_session_timeout``
is set per transaction, unless the role or database already sets it), no ``LISTEN``
(a direct ``pulse_store_listen_url`` connection, or polling).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from typing import Any

from celery_pulse.errors import InvalidConfig

logger = logging.getLogger(__name__)

MODES = ("auto", "none", "session", "transaction")
#: The engine's execution option that carries its :class:`Pooler`.
OPTION = "pulse_pooler"
#: The longest one detection probe (a connect, a statement) may take.
PROBE_TIMEOUT_S = 3.0
#: A transaction's own idle cap (``SET LOCAL``), its one parameter in milliseconds: the
#: engine's transactions and the hot path's pipeline both send it.
IDLE_CAP_SQL = "SELECT set_config('idle_in_transaction_session_timeout', %s, true)"


def check_mode(value: str) -> str:
    """``pulse_store_pooler`` checked: one of :data:`MODES`."""
    if value not in MODES:
        raise InvalidConfig(f"pulse_store_pooler must be one of {', '.join(MODES)}, got "
                            f"{value!r}", setting="pulse_store_pooler")
    return value


class Pooler:
    """One engine's pooler mode: named, or detected once at its first connection."""

    def __init__(self, setting: str = "auto", listen_url: str | None = None,
                 role: str = "worker") -> None:
        self.setting = check_mode(setting)
        self.listen_url = listen_url
        self.role = role
        self.mode: str | None = None if setting == "auto" else setting
        #: Set ``idle_in_transaction_session_timeout`` in each transaction: under
        #: transaction pooling, when the server's own default (role, database) is 0.
        self.per_transaction_timeout = False
        #: That cap, in milliseconds.
        self.idle_ms = 0
        self._lock = threading.Lock()
        self._logged = False

    @property
    def transaction(self) -> bool:
        """Whether the pooler hands server connections out per transaction."""
        return self.mode == "transaction"

    def resolve(self, cparams: dict[str, Any]) -> str:
        """The mode, detected with ``cparams`` (psycopg's connect arguments) if not known."""
        if self.mode is None:
            with self._lock:
                if self.mode is None:
                    self.mode = detect(cparams)
        if not self._logged:
            self._logged = True
            how = "detected" if self.setting == "auto" else "pulse_store_pooler"
            wakes = ("LISTEN on pulse_store_listen_url" if self.listen_url
                     else "waiters poll, no LISTEN")
            (logger.info if self.role in ("worker", "cli") else logger.debug)(
                "pulse: store pooler mode %s (%s)%s", self.mode, how,
                f"; per-transaction state only, {wakes}" if self.transaction else "")
        return self.mode


def of(engine: Any) -> Pooler | None:
    """The :class:`Pooler` of a pulse engine (None: not one of pulse's, or not PostgreSQL)."""
    pooler = engine.get_execution_options().get(OPTION)
    return pooler if isinstance(pooler, Pooler) else None


def mode_of(engine: Any) -> str:
    """The pooler mode of ``engine``, connecting once if it is not known yet.

    That connection is closed, not pooled: a pool child asks only for ``lease.fenced()``
    and may never use its store again, and an idle session it kept would stay on a
    demoted primary after a failover (no error ever reaches it to drop it)."""
    pooler = of(engine)
    if pooler is None:
        return "none"
    if pooler.mode is None:
        with engine.connect() as conn:
            conn.invalidate()
    return pooler.mode or "none"


def detect(cparams: dict[str, Any]) -> str:
    """``transaction``, ``session`` or ``none`` (see the module doc); InvalidConfig for
    statement pooling. A connection error propagates (the caller's retry decides)."""
    import psycopg

    params = dict(cparams, connect_timeout=max(1, int(PROBE_TIMEOUT_S)), autocommit=True)
    params.pop("prepare_threshold", None)
    first = psycopg.Connection.connect(**params)
    try:
        second = psycopg.Connection.connect(**params)
        try:
            return _probe(first, second)
        finally:
            second.close()
    finally:
        first.close()


def _probe(first: Any, second: Any) -> str:
    try:
        with first.transaction():
            first.execute("SELECT 1")
    except Exception as exc:
        if "statement pooling" in str(exc).lower() or "transaction blocks" in str(exc).lower():
            raise InvalidConfig(
                "pulse_store_pooler: the store's pooler runs in statement pooling mode; pulse "
                "needs transactions of several statements: use transaction or session pooling",
                setting="pulse_store_pooler") from exc
        raise
    for _ in range(3):
        a = _pid(first)
        b = _pid(second)
        a2 = _pid(first)
        if b is None:  # no server for the second client while the first is idle
            return "session" if a == a2 else "transaction"
        if a == b or a2 != a or a2 == b:
            return "transaction"
    return "none"


def _pid(conn: Any) -> Any:
    """``pg_backend_pid()`` on ``conn``; None when no answer came in time (the query is
    cancelled, so the connection is usable, or closed)."""
    from psycopg import pq

    pg = conn.pgconn
    pg.send_query(b"SELECT pg_backend_pid()")
    while pg.flush():
        select.select([], [pg.socket], [], PROBE_TIMEOUT_S)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    value = None
    while True:
        while pg.is_busy():
            left = deadline - time.monotonic()
            if left <= 0:
                conn.close()  # a waiting client: dropping it gives its place back
                return None
            select.select([pg.socket], [], [], left)
            pg.consume_input()
        res = pg.get_result()
        if res is None:
            return value
        if res.status == pq.ExecStatus.TUPLES_OK:
            value = int(res.get_value(0, 0))
        else:
            raise InvalidConfig(
                f"pulse_store_pooler: detecting the store's pooler failed "
                f"({res.error_message.decode(errors='replace').strip()}); set it "
                f"(none, session or transaction)", setting="pulse_store_pooler")


def pooled_transactions(engine: Any, pooler: Pooler, idle_s: int) -> None:
    """Fit ``engine``'s connections to the pooler: the mode resolved before the first
    connection; under transaction pooling psycopg never prepares, and each transaction
    caps its own idle time (``SET LOCAL``) unless the server's default does already."""
    import sqlalchemy as sa

    pooler.idle_ms = idle_s * 1000

    @sa.event.listens_for(engine, "do_connect")
    def _resolve(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        if pooler.resolve(cparams) == "transaction":
            cparams["prepare_threshold"] = None

    @sa.event.listens_for(engine, "connect")
    def _server_default(dbapi_conn: Any, _record: Any) -> None:
        if pooler.transaction and not pooler.per_transaction_timeout:
            with dbapi_conn.cursor() as cur:
                cur.execute("SELECT current_setting('idle_in_transaction_session_timeout')")
                row = cur.fetchone()
            dbapi_conn.rollback()
            pooler.per_transaction_timeout = row is None or str(row[0]) in ("0", "0ms")

    @sa.event.listens_for(engine, "begin")
    def _per_transaction(conn: Any) -> None:
        if not pooler.per_transaction_timeout:
            return
        driver = conn.connection.driver_connection
        if not driver.autocommit:  # AUTOCOMMIT connections have no transaction to cap
            driver.execute(IDLE_CAP_SQL, (str(pooler.idle_ms),), prepare=False)



def listens(engine: Any) -> bool:
    """Whether ``engine``'s waiters can LISTEN: not through a transaction pooler, unless
    ``pulse_store_listen_url`` gives a direct connection."""
    pooler = of(engine)
    return pooler is None or pooler.listen_url is not None or mode_of(engine) != "transaction"


def direct_listener(engine: Any, channel: str) -> Any:
    """A direct connection (psycopg, autocommit) to ``pulse_store_listen_url``, LISTENing
    on ``channel``, the caller's to close; None when the setting is not given."""
    pooler = of(engine)
    if pooler is None or pooler.listen_url is None:
        return None
    import psycopg
    from sqlalchemy.engine import make_url

    from celery_pulse.store_urls import canonical_store_url

    url = make_url(canonical_store_url(pooler.listen_url)).set(drivername="postgresql")
    conn = psycopg.Connection.connect(url.render_as_string(hide_password=False),
                                      autocommit=True, connect_timeout=5)
    try:
        conn.execute(f"LISTEN {channel}")
    except BaseException:
        conn.close()
        raise
    return conn
