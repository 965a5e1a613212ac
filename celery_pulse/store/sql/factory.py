"""Opening the SQL store: the claim engine for the URL's database, and the wait for a
store that starts after its workers."""

from __future__ import annotations

import time

import sqlalchemy as sa

from celery_pulse.errors import InvalidConfig, StoreUnavailable
from celery_pulse.store.sql.claim_engine import ClaimEngine
from celery_pulse.store.sql.claims import BatchClaims
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.engine import EngineOptions, make_engine
from celery_pulse.store.sql.errors import driver_message, refused_for_good
from celery_pulse.store.sql.mysql import MySqlClaims
from celery_pulse.store.sql.results import ResultRows
from celery_pulse.store.sql.sqlite import SqliteClaims
from celery_pulse.store.sql.store import SqlStore
from celery_pulse.store_urls import mask_url


def claim_engine(conns: Connections, results: ResultRows) -> ClaimEngine:
    """The hot path for ``conns``' database (see :mod:`.claim_engine`)."""
    family = conns.dialect.family
    if family == "postgresql":
        # Imported here: psycopg is an extra, and only PostgreSQL needs it.
        from celery_pulse.store.sql.postgres import PostgresClaims

        return PostgresClaims(conns, results)
    if family == "mysql":
        return MySqlClaims(conns, results)
    if family == "sqlite":
        return SqliteClaims(conns, results)
    return BatchClaims(conns, results)


def store_on(engine: sa.Engine) -> SqlStore:
    """The store on ``engine``, with its dialect's claim engine."""
    conns = Connections(engine)
    results = ResultRows(engine)
    return SqlStore(conns, results, claim_engine(conns, results))


def open_store(url: str, connect_timeout: float = 0.0, check_schema: bool = True,
               options: EngineOptions | None = None) -> SqlStore:
    """Open the store at ``url``, waiting up to ``connect_timeout`` for it to answer.

    Raises InvalidConfig (naming ``pulse_store_url``, password masked) when it never
    answers, at once when no retry can help (no such database, bad credentials, an
    unknown host: :func:`refused_for_good`), and SchemaMissing when the schema is
    absent or old. A refused connection is retried: a store starting after its workers
    is normal.
    """
    store = store_on(make_engine(url, options))
    deadline = time.monotonic() + connect_timeout
    delay = 0.2
    while True:
        try:
            store.now()
            break
        except StoreUnavailable as exc:
            if (reason := refused_for_good(exc)) is not None:
                store.close()
                raise InvalidConfig(f"pulse_store_url: cannot open the store at "
                                    f"{mask_url(url)}: {reason}",
                                    setting="pulse_store_url") from exc
            if time.monotonic() + delay > deadline:
                store.close()
                raise InvalidConfig(
                    f"pulse_store_url: cannot reach the store at {mask_url(url)} "
                    f"after {connect_timeout:g}s: {driver_message(exc)}",
                    setting="pulse_store_url") from exc
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    if check_schema:
        store.check_schema()
    return store
