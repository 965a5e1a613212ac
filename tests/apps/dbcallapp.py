"""Tasks that keep a database connection at module level, as applications do.

For ``tests/acceptance/test_lost_in_db_call.py``: a body whose lease is lost while it
waits in a database call (``pg_sleep``, ``SLEEP``), then tasks on the same pool slot
that use the same module-level connection. The connection is opened lazily, in the
pool process, on first use, and kept. Each task writes one line per event into the
test's file ("start <pid> <server session id>", "raised <exception class>", "ok <pid>").
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa

from tests.apps.pulseapp import app, mark

__all__ = ["app"]

#: The module-level connections (one per process, opened on first use).
_kept: dict[str, Any] = {}


def _url() -> sa.URL:
    return sa.make_url(os.environ["PULSE_TEST_STORE"])


def _connection(via: str) -> Any:
    """This process's connection (or engine) for ``via``, opened once and kept."""
    if via not in _kept:
        url = _url()
        if via == "psycopg":
            import psycopg

            conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
            _kept[via] = psycopg.connect(conninfo)
        elif via == "sqlalchemy":
            _kept[via] = sa.create_engine(url)
        elif via == "pymysql":
            import pymysql

            _kept[via] = pymysql.connect(host=url.host, port=url.port or 3306,
                                         user=url.username, password=url.password or "",
                                         database=url.database)
        else:
            raise ValueError(via)
    return _kept[via]


def _on_mysql() -> bool:
    return _url().get_backend_name() in ("mysql", "mariadb")


def _sleep_sql() -> str:
    return "SELECT SLEEP(%d)" if _on_mysql() else "SELECT pg_sleep(%d)"


def _run(via: str, sql: str, session_id: bool = False) -> Any:
    """Run ``sql`` on the kept connection; with ``session_id``, name the server session
    first (``mark`` it), before the statement."""
    conn = _connection(via)
    if via == "sqlalchemy":
        with conn.begin() as c:
            return c.execute(sa.text(sql)).scalar()
    if via == "psycopg":
        value = conn.execute(sql).fetchone()[0]
        conn.commit()
        return value
    with conn.cursor() as cur:
        cur.execute(sql)
        value = cur.fetchone()[0]
    conn.commit()
    return value


def _session_id(via: str) -> int:
    return int(_run(via, "SELECT CONNECTION_ID()" if _on_mysql()
                    else "SELECT pg_backend_pid()"))


@app.task(name="dbcall.sleep_in_db")
def sleep_in_db(path: str, via: str, seconds: int) -> Any:
    """Wait ``seconds`` inside one database statement; record what interrupted it."""
    mark(path, "start", os.getpid(), _session_id(via))
    try:
        value = _run(via, _sleep_sql() % seconds)
    except BaseException as exc:
        mark(path, "raised", type(exc).__module__ + "." + type(exc).__qualname__)
        raise
    mark(path, "end", value)
    return value


@app.task(name="dbcall.query")
def query(path: str, via: str) -> int:
    """One short statement on the kept connection."""
    value = int(_run(via, "SELECT 1"))
    mark(path, "ok", os.getpid(), value)
    return value
