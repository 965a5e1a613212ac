"""The store across a PostgreSQL failover, against a real primary and streaming standby.

A multi-host URL with ``target_session_attrs=read-write`` opens on whichever server
takes writes; when the primary turns read-only (demoted in place) or goes away, the
store's next call fails as StoreUnavailable and leaves no connection on the old server
(the pool, the pipelined hot path, the permit LISTEN connection): the call after
reaches the new primary.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from celery_pulse.errors import StoreUnavailable
from celery_pulse.store.base import Grant
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.store.sql import permits as sql_permits
from celery_pulse.store.sql.replication import check_replication
from celery_pulse.store_urls import mask_url
from celery_pulse.testing import wait_for
from tests.contract.test_claims_contract import request
from tests.helpers.pg import PrivatePostgres
from tests.helpers.pg_ha import ReplicatedPostgres
from tests.helpers.stores import migrated

W = "w1@host"


def _port(store: SqlStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(sa.text("select inet_server_port()")).scalar_one())


def _clients(server: PrivatePostgres) -> int:
    """Client sessions on ``server`` other than the one asking."""
    engine = sa.create_engine(server.url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(
                "select count(*) from pg_stat_activity where backend_type = 'client backend' "
                "and pid <> pg_backend_pid()")).scalar_one())
    finally:
        engine.dispose()


@pytest.fixture
def ha_store(replicated_pg: ReplicatedPostgres) -> Iterator[SqlStore]:
    store = migrated(replicated_pg.url)
    yield store
    store.close()


def _reserve(store: SqlStore) -> Grant:
    (result,) = store.reserve(W, [request(uuid.uuid4().hex)], 30.0)
    assert isinstance(result, Grant), result
    return result


@pytest.mark.parametrize("spelling", ["libpq", "query-lists", "sqlalchemy"])
def test_a_multi_host_url_opens_on_the_read_write_server(replicated_pg: ReplicatedPostgres,
                                                         spelling: str) -> None:
    """The standby is listed first: libpq skips it for the primary, in every spelling."""
    a, b = replicated_pg.standby.port, replicated_pg.primary.port
    url = {"libpq": f"postgresql://postgres:s3cret@127.0.0.1:{a},127.0.0.1:{b}/postgres"
                    "?target_session_attrs=read-write",
           "query-lists": f"postgres://postgres:s3cret@/postgres?host=127.0.0.1,127.0.0.1"
                          f"&port={a},{b}&target_session_attrs=read-write",
           "sqlalchemy": f"postgresql+psycopg://postgres:s3cret@/postgres?host=127.0.0.1:{a}"
                         f"&host=127.0.0.1:{b}&target_session_attrs=read-write"}[spelling]
    store = migrated(url)
    try:
        assert _port(store) == b
        _reserve(store)
        assert "s3cret" not in mask_url(url) and "s3cret" not in repr(store)
    finally:
        store.close()


def _refused(call: Callable[[], object], what: str) -> None:
    """Call until the store says it is unavailable (a few seconds at most): a session
    takes the server's new read-only default at its next command but one (PostgreSQL
    reloads its configuration between commands), so one write may still land."""
    def refused() -> bool:
        try:
            call()
        except StoreUnavailable:
            return True
        return False
    wait_for(refused, 5, what, interval=0.05)


def _ok(call: Callable[[], object]) -> bool:
    try:
        call()
    except StoreUnavailable:
        return False
    return True


def test_a_primary_turned_read_only_is_left_for_the_new_primary(
        replicated_pg: ReplicatedPostgres, ha_store: SqlStore) -> None:
    """Demoted in place first (it keeps its sessions), then the standby promoted, as a
    failover tool does it: the old primary never takes a write the standby lacks."""
    store = ha_store
    _reserve(store)  # the pipelined hot path's connection
    store.register(W, {}, 30.0)  # and the pool's
    assert _port(store) == replicated_pg.primary.port
    assert _clients(replicated_pg.primary) > 0
    replicated_pg.demote_primary()
    # The hot path's write is refused on the old primary: the store is unavailable ...
    _refused(lambda: _reserve(store), "the hot path's write to be refused")
    replicated_pg.promote()
    # ... and a later call reaches the new one (libpq skips the read-only server).
    wait_for(lambda: _ok(lambda: _reserve(store)), 10, "the hot path on the new primary")
    store.register(W, {}, 30.0)
    assert _port(store) == replicated_pg.standby.port
    # Nothing of the store stays on the old server: the pool was replaced.
    wait_for(lambda: _clients(replicated_pg.primary) == 0, 10,
             "the store's sessions on the demoted primary to close")


def test_the_pool_leaves_a_read_only_server_on_its_first_refused_write(
        replicated_pg: ReplicatedPostgres, ha_store: SqlStore) -> None:
    """A write through SQLAlchemy (not the hot path) refused as read-only drops the pool."""
    store = ha_store
    store.register(W, {}, 30.0)
    replicated_pg.demote_primary()
    _refused(lambda: store.register(W, {}, 30.0), "the registration to be refused")
    replicated_pg.promote()
    wait_for(lambda: _ok(lambda: store.register(W, {}, 30.0)), 10,
             "the registration on the new primary")
    assert _port(store) == replicated_pg.standby.port
    wait_for(lambda: _clients(replicated_pg.primary) == 0, 10,
             "the pool's sessions on the demoted primary to close")


def test_a_connection_checked_out_during_the_failover_leaves_on_its_checkin(
        replicated_pg: ReplicatedPostgres, ha_store: SqlStore) -> None:
    """Another thread's connection, checked out while a refused write drops the pool, is
    closed when it is checked in: a disposed pool would keep it, idle on the demoted
    primary, until the garbage collector found the pool (a worker's session left there
    for as long as that takes)."""
    store = ha_store
    held, idle = store.engine.connect(), store.engine.connect()
    for conn in (held, idle):
        conn.execute(sa.text("select 1"))
    idle.close()  # the pooled session the refused write will be made on
    replicated_pg.demote_primary()
    _refused(lambda: store.register(W, {}, 30.0), "the registration to be refused")
    replicated_pg.promote()
    wait_for(lambda: _ok(lambda: store.register(W, {}, 30.0)), 10,
             "the registration on the new primary")
    assert _clients(replicated_pg.primary) == 1  # the one still held
    held.close()
    wait_for(lambda: _clients(replicated_pg.primary) == 0, 5,
             "the held connection to leave the demoted primary on its checkin")


def test_a_killed_primary_is_left_for_the_promoted_standby(
        replicated_pg: ReplicatedPostgres, ha_store: SqlStore) -> None:
    store = ha_store
    _reserve(store)
    store.register(W, {}, 30.0)
    replicated_pg.kill_primary()
    with pytest.raises(StoreUnavailable):  # dead, and the standby not promoted yet
        _reserve(store)
    with pytest.raises(StoreUnavailable):  # the standby is not read-write
        store.register(W, {}, 30.0)
    replicated_pg.promote()
    wait_for(lambda: _ok(lambda: _reserve(store)), 15, "the hot path on the new primary")
    store.register(W, {}, 30.0)
    assert _port(store) == replicated_pg.standby.port


def test_the_permit_listener_leaves_a_read_only_server(
        replicated_pg: ReplicatedPostgres, ha_store: SqlStore,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sql_permits, "PRIMARY_CHECK_S", 0.0)
    channel = ha_store.permit_signals()
    assert channel is not None
    with channel as signals:
        assert signals.receive(0.05) == set()  # listening on the primary
        replicated_pg.demote_primary()
        _refused(lambda: signals.receive(0.05), "the listener to leave the old primary")
        replicated_pg.promote()
    channel = ha_store.permit_signals()
    assert channel is not None
    with channel as signals:  # the caller's reconnect: on the new primary
        signals.send(["k"])
        assert wait_for(lambda: signals.receive(0.2), 5, "our own notification") == {"k"}


def test_no_warning_when_commits_wait_for_the_standby(
        replicated_pg: ReplicatedPostgres, ha_store: SqlStore,
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "celery_pulse.store.sql.replication"):
        rep = check_replication(ha_store.engine)
    assert rep is not None and rep.standbys == 1 and rep.synchronous
    assert not caplog.records


def test_a_warning_when_a_standby_is_attached_but_commits_do_not_wait(
        caplog: pytest.LogCaptureFixture) -> None:
    pair = ReplicatedPostgres(synchronous=False)
    try:
        pair.start()
        store = open_store(pair.url, check_schema=False)
        try:
            with caplog.at_level(logging.INFO, "celery_pulse.store.sql.replication"):
                rep = check_replication(store.engine)
        finally:
            store.close()
    finally:
        pair.destroy()
    assert rep is not None and rep.standbys == 1 and not rep.synchronous
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    for words in ("synchronous_commit='on'", "synchronous_standby_names=''",
                  "production.md"):
        assert words in record.getMessage()


def test_no_warning_on_a_single_server(private_pg: PrivatePostgres,
                                       caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(private_pg.url, check_schema=False)
    try:
        with caplog.at_level(logging.INFO, "celery_pulse.store.sql.replication"):
            rep = check_replication(store.engine)
    finally:
        store.close()
    assert rep is not None and rep.standbys == 0
    assert not caplog.records
