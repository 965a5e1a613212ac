"""Translate driver errors into pulse errors (the only place that does)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy.exc as sa_exc

from celery_pulse.errors import Contended, SchemaMissing, StoreUnavailable, Unstorable

_MISSING_MARKERS = ("no such table", "undefinedtable", "does not exist")
#: A store that answers but cannot take writes is as good as down for leases.
_UNWRITABLE_MARKERS = ("read-only", "readonly", "read only", "disk full", "diskfull",
                       "no space left", "database or disk is full", "readonlysqltransaction",
                       "is full")
#: MySQL/MariaDB: a deadlock victim and a lock-wait timeout. The transaction was rolled
#: back and may be run again; PyMySQL reports both as OperationalError, like an outage.
CONTENTION_CODES = (1213, 1205)
#: PostgreSQL: deadlock detected, serialization failure. Rolled back, safe to run again.
_PG_CONTENTION = ("40P01", "40001")
#: SQLSTATEs that say this server is no longer the read-write primary, or is going
#: away: read-only (a demoted primary, a standby), admin shutdown, crash shutdown,
#: cannot connect now (starting up, or in recovery).
FAILOVER_SQLSTATES = ("25006", "57P01", "57P02", "57P03")


def failover_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or the driver error behind it) is one of
    :data:`FAILOVER_SQLSTATES`: this server is no longer the one to write to."""
    seen = 0
    while exc is not None and seen < 8:
        if getattr(exc, "sqlstate", None) in FAILOVER_SQLSTATES:
            return True
        exc, seen = getattr(exc, "orig", None) or exc.__cause__, seen + 1
    return False


#: MySQL/MariaDB: no such table.
_NO_TABLE_CODE = 1146
#: MySQL/MariaDB errors about the values sent, not the store: a statement over
#: ``max_allowed_packet`` (the server then drops the connection, so the driver reports it
#: like an outage), data too long, an incorrect string value, out of range, truncated.
_MYSQL_DATA_CODES = (1153, 1301, 1406, 1366, 1264, 1292)
#: PostgreSQL SQLSTATE classes about the values sent: data exception (22: too long, bad
#: encoding, a NUL), program limit exceeded (54: a row too big for an index).
_PG_DATA_CLASSES = ("22", "54")


#: The MySQL/MariaDB drivers' modules: PyMySQL and mysqlclient put the error number first
#: in ``args``; MariaDB Connector/Python keeps it in ``errno``.
_MYSQL_DRIVERS = ("pymysql", "MySQLdb", "mariadb")


def mysql_code(orig: BaseException | None) -> int | None:
    """The MySQL/MariaDB error number of a driver error (None for other drivers)."""
    if orig is None or not type(orig).__module__.startswith(_MYSQL_DRIVERS):
        return None
    code = getattr(orig, "errno", None)
    if code is None:
        args = getattr(orig, "args", ())
        code = args[0] if args else None
    return code if isinstance(code, int) else None


def _about_the_values(orig: BaseException, code: int | None) -> bool:
    """Whether the store refused what was sent (one row's values), not the operation:
    the DB-API's ``DataError``, and the codes above."""
    if code in _MYSQL_DATA_CODES:
        return True
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate[:2] in _PG_DATA_CLASSES:
        return True
    return any(cls.__name__ == "DataError" for cls in type(orig).__mro__)


def translate(orig: BaseException, where: str, lost_connection: bool) -> Exception | None:
    """The pulse error for a driver error ``orig``; None: re-raise it as it is (a bug).

    ``lost_connection``: the driver says the connection failed (SQLAlchemy's
    ``OperationalError``/``InterfaceError`` or an invalidated connection, or the same
    classes of psycopg used directly on the hot path).
    """
    text = f"{type(orig).__name__} {orig}".lower()
    code = mysql_code(orig)
    if code == _NO_TABLE_CODE:
        return SchemaMissing()
    if _about_the_values(orig, code):
        first = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
        return Unstorable(f"the store refused it ({type(orig).__name__}: {first[:200]})")
    if code in CONTENTION_CODES or getattr(orig, "sqlstate", None) in _PG_CONTENTION:
        return Contended(f"store contended during {where}: {orig}")
    if (any(marker in text for marker in _MISSING_MARKERS) and "relation" in text) or (
            "no such table" in text):
        return SchemaMissing()
    first_line = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    if "syntax error" in text or "no such column" in text:
        return None  # SQLite reports these as OperationalError: a bug, not an outage
    if lost_connection or getattr(orig, "sqlstate", None) in FAILOVER_SQLSTATES or any(
            m in text for m in _UNWRITABLE_MARKERS):
        return StoreUnavailable(f"store unavailable during {where}: {first_line}")
    return None


#: MySQL/MariaDB errors a connection attempt meets that no retry can fix: unknown
#: database, access denied (to the server, to the database), unknown host (mysqlclient).
_MYSQL_PERMANENT = (1049, 1045, 1044, 2005)
#: PostgreSQL's connection failures that no retry can fix, by libpq's FATAL text (a
#: failed connection carries no SQLSTATE): 3D000 (database "x" does not exist; also
#: role "x"), 28P01 (password authentication failed), 28000 (no pg_hba.conf entry).
_PG_PERMANENT = ("does not exist", "password authentication failed", "no pg_hba.conf entry")
#: A host name the resolver says does not exist (EAI_NONAME, EAI_NODATA), in the words
#: of libc (psycopg resolves names itself); "Temporary failure in name resolution"
#: (EAI_AGAIN) is left to the retries.
_UNKNOWN_NAME = ("name or service not known", "nodename nor servname",
                 "no address associated with hostname")


def refused_for_good(exc: BaseException) -> str | None:
    """Why a failed connection attempt can never succeed (a missing database, bad
    credentials, an unknown host), or None when retrying may help (connection refused,
    the server starting up, a timeout). ``exc``: the driver error or SQLAlchemy's
    wrapper of it, or a pulse error raised from one. The answer is the driver's own
    first line (it names the database, user or host; it never carries the password)."""
    orig = _driver_error(exc)
    if orig is None:
        return None
    text = str(orig).lower()
    unknown_name = any(marker in text for marker in _UNKNOWN_NAME)
    code = mysql_code(orig)
    if code is not None:
        permanent = code in _MYSQL_PERMANENT or (code == 2003 and unknown_name)
    else:  # psycopg
        permanent = unknown_name or any(marker in text for marker in _PG_PERMANENT)
    return driver_message(orig) if permanent else None


def driver_message(exc: BaseException) -> str:
    """The driver's own words for ``exc`` (or the error that caused it), without its
    framing: PyMySQL's ``(1049, "...")`` tuple, libpq's "connection to server at ...
    failed: FATAL:" (the URL, masked, says which server)."""
    orig = _driver_error(exc) or exc
    args: tuple[Any, ...] = getattr(orig, "args", ())
    text = str(args[1]) if len(args) >= 2 and isinstance(args[0], int) else str(orig)
    text = text.strip().splitlines()[0] if text.strip() else type(orig).__name__
    return text.rpartition("failed: ")[2].replace("FATAL:  ", "").strip() or text


def _driver_error(exc: BaseException) -> BaseException | None:
    """The DB-API driver's exception behind ``exc`` (itself, SQLAlchemy's ``orig``, or a
    ``__cause__`` down the chain); None if no driver error is behind it."""
    orig: BaseException | None = exc
    while orig is not None and not type(orig).__module__.startswith(("psycopg",
                                                                    *_MYSQL_DRIVERS)):
        orig = getattr(orig, "orig", None) or orig.__cause__
    return orig


@contextmanager
def translated(where: str) -> Iterator[None]:
    """Re-raise connection failures as StoreUnavailable, missing tables as SchemaMissing."""
    try:
        yield
    except sa_exc.DBAPIError as exc:
        lost = isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)) or bool(
            exc.connection_invalidated)
        error = translate(exc.orig or exc, where, lost)
        if error is None:
            raise
        raise error from exc
    except sa_exc.TimeoutError as exc:  # connection pool exhausted / connect timeout
        raise StoreUnavailable(f"store unavailable during {where}: {exc}") from exc


@contextmanager
def driver_translated(where: str) -> Iterator[None]:
    """:func:`translated` for psycopg used directly (the pipelined hot path, LISTEN):
    a dropped connection is the store being unavailable, not a bug."""
    import psycopg  # only PostgreSQL stores get here

    try:
        yield
    except psycopg.Error as exc:
        lost = isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError))
        error = translate(exc, where, lost)
        if error is None:
            raise
        raise error from exc
