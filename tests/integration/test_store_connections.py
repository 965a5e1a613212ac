"""A store engine's connections on a real server: each says what it is (the role, the
process), the pool never grows past its size, a full pool fails within the bounded wait,
and the long-lived connections (LISTEN, the pipeline) stay out of the pool."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from celery_pulse.errors import StoreUnavailable
from celery_pulse.store.sql import SqlStore, store_on
from celery_pulse.store.sql.engine import EngineOptions, make_engine
from celery_pulse.store.sql.pipeline import Pipeline
from celery_pulse.store.sql.results import ResultRows
from tests.helpers import services
from tests.helpers.connections import mariadb_with_connect_attrs
from tests.helpers.mariadb import PrivateMariaDB
from tests.helpers.stores import migrated

NAME = f"{os.getpid()}@{socket.gethostname()}"


def sessions(engine: sa.Engine) -> dict[int, str]:
    """The sessions of this process named as pulse's: server pid -> application_name."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT pid, application_name FROM pg_stat_activity "
            "WHERE application_name LIKE :mine"), {"mine": f"pulse:%:{NAME}"[:63]})
        return {int(pid): str(name) for pid, name in rows}


class Opened:
    """The sessions this process opened since the test began (earlier tests in the same
    process may have left engines open: they are not this test's)."""

    def __init__(self, admin: sa.Engine) -> None:
        self.admin = admin
        self.before = set(sessions(admin))

    def names(self) -> list[str]:
        return sorted(name for pid, name in sessions(self.admin).items()
                      if pid not in self.before)


@pytest.fixture
def admin() -> Iterator[Opened]:
    services.require("postgres")
    engine = sa.create_engine(services.PG_ADMIN_URL, poolclass=sa.pool.NullPool)
    yield Opened(engine)
    engine.dispose()


@pytest.fixture
def small(pg_url: str) -> Iterator[SqlStore]:
    """A migrated store whose pool holds one connection, waited for at most 0.3 s."""
    migrated(pg_url).close()
    store = store_on(make_engine(pg_url, EngineOptions(role="worker", pool_size=1,
                                                       pool_timeout=0.3)))
    yield store
    store.close()


def test_each_connection_names_its_role_and_process(pg_url: str, admin: Opened) -> None:
    engine = make_engine(pg_url, EngineOptions(role="gateway"))
    try:
        with engine.connect() as conn:
            name = conn.execute(sa.text("SELECT current_setting('application_name')")).scalar()
        assert name == f"pulse:gateway:{NAME}"[:63]
        assert admin.names() == [name]
    finally:
        engine.dispose()


def test_an_application_name_in_the_url_is_kept(pg_url: str) -> None:
    engine = make_engine(f"{pg_url}&application_name=billing", EngineOptions(role="worker"))
    try:
        with engine.connect() as conn:
            name = conn.execute(sa.text("SELECT current_setting('application_name')")).scalar()
        assert name == "billing"
    finally:
        engine.dispose()


def test_a_full_pool_fails_within_the_bounded_wait(small: SqlStore, admin: Opened) -> None:
    """No overflow: a second connection is never opened, the waiter gets StoreUnavailable
    after the pool timeout (not SQLAlchemy's 30 s)."""
    with small.conns.engine.connect():
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="during now"):
            small.now()
        waited = time.monotonic() - started
        assert len(admin.names()) == 1
    assert 0.3 <= waited < 5, waited
    small.now()  # the connection given back serves the next call


def test_the_long_lived_connections_stay_out_of_the_pool(small: SqlStore,
                                                          admin: Opened) -> None:
    """The permit signals' LISTEN and the hot path's pipeline each hold a connection of
    their own for the worker's life: with a pool of one, the threads still get theirs."""
    channel = small.permit_signals()
    assert channel is not None
    pipeline = Pipeline(small.conns.engine)
    try:
        with channel as signals:
            pipeline.run("test", [("SELECT 1", [])])
            small.now()
            signals.send(["k"])
            assert signals.receive(5.0) == {"k"}
            assert len(admin.names()) == 3  # LISTEN, pipeline, the pool's one
    finally:
        pipeline.close()


def test_a_result_wait_reads_on_its_listening_connection(small: SqlStore,
                                                         admin: Opened) -> None:
    """``AsyncResult.get()`` holds one connection, not two: a pool of one serves it."""
    rows = ResultRows(small.conns.engine)
    with rows.watch(["k"]) as watch:
        assert rows.get("k") is None
        assert len(admin.names()) == 1
        rows_elsewhere = ResultRows(make_engine(small.conns.engine.url.render_as_string(
            hide_password=False)))
        try:
            rows_elsewhere.set("k", b"v", state="SUCCESS")
        finally:
            rows_elsewhere.engine.dispose()
        watch.wait(5.0)
        assert rows.get("k") == b"v"


@pytest.fixture
def mariadb_with_attrs() -> Iterator[PrivateMariaDB]:
    with mariadb_with_connect_attrs() as server:
        yield server


def test_mariadb_connections_carry_their_program_name(mariadb_with_attrs: PrivateMariaDB
                                                      ) -> None:
    engine = make_engine(mariadb_with_attrs.url, EngineOptions(role="child"))
    try:
        with engine.connect() as conn:
            name = conn.execute(sa.text(
                "SELECT ATTR_VALUE FROM performance_schema.session_connect_attrs "
                "WHERE PROCESSLIST_ID = CONNECTION_ID() AND ATTR_NAME = 'program_name'"
            )).scalar()
        assert name == f"pulse:child:{NAME}"[:63]
    finally:
        engine.dispose()
