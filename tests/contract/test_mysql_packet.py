"""MariaDB's usual exchange in one round trip (``store/sql/mysql_packet.py``).

The claims contract already runs through the packet on MariaDB (a verb on its own is an
exchange of one verb) and through the general path wherever the packet steps aside. Here:
that the packet is what ran, that it is one command to the server, that its answers and
rows are the general path's (each exchange made on two fresh stores, one each way), and
that a packet the server refuses halfway leaves nothing of itself behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_pulse.errors import StoreUnavailable
from celery_pulse.store.base import FAILED, RETRY, RUNNING, SUCCEEDED, Completion, Grant
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.store.sql.mysql import MySqlClaims
from celery_pulse.store.sql.mysql_packet import OnePacket
from celery_pulse.store.sql.tables import claims, evidence
from tests.contract.conftest import migrated
from tests.contract.test_claims_contract import TTL, W1, W2, grant, request
from tests.helpers import services
from tests.helpers.mariadb import Database
from tests.helpers.proxy import Proxy

pytestmark = pytest.mark.mariadb


@pytest.fixture
def store(mariadb_url: str) -> Iterator[SqlStore]:
    sql = migrated(mariadb_url)
    try:
        yield sql
    finally:
        sql.close()


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per packet sent: whether it committed (False: the general path ran)."""
    seen: list[bool] = []
    real = OnePacket._run

    def spy(self: OnePacket, raw: Any, packet: Any) -> Any:
        sets = real(self, raw, packet)
        seen.append(sets is not None)
        return sets

    monkeypatch.setattr(OnePacket, "_run", spy)
    return seen


def _claims(store: SqlStore) -> MySqlClaims:
    assert isinstance(store.claims, MySqlClaims)
    return store.claims


def _commands(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every command PyMySQL sends to the server from now on (one per round trip)."""
    import pymysql.connections

    sent: list[int] = []
    real = pymysql.connections.Connection._execute_command

    def counting(self: Any, command: int, sql: Any) -> Any:
        sent.append(command)
        return real(self, command, sql)

    monkeypatch.setattr(pymysql.connections.Connection, "_execute_command", counting)
    return sent


def test_a_usual_exchange_is_one_command(store: SqlStore, runs: list[bool],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    done_req, started_req, new = request(), request(), request()
    done, waiting = grant(store, W1, done_req), grant(store, W1, started_req)
    store.start(W1, done.task_id, done.epoch, done.token, TTL)
    runs.clear()
    sent = _commands(monkeypatch)
    out = store.exchange(W1, TTL, [Completion(done.task_id, done.epoch, done.token, SUCCEEDED)],
                         [new], [(waiting.task_id, waiting.epoch, waiting.token)])
    assert len(sent) == 1 and runs == [True]
    assert out.completed == {done.task_id: "applied"}
    (granted,) = out.reserved
    assert isinstance(granted, Grant) and granted.task_id == new.task_id
    assert set(out.started) == {waiting.task_id}
    with store.engine.connect() as conn:
        states = dict(conn.execute(sa.select(claims.c.task_id, claims.c.state)).all())
    assert states == {done.task_id: SUCCEEDED, waiting.task_id: RUNNING,
                      new.task_id: "reserved"}


def test_stale_and_duplicate_completions_are_answered_in_the_packet(
        store: SqlStore, runs: list[bool]) -> None:
    """Taken over (evidence, with what it returned), finished already (duplicate), and
    applied, in one packet: what the general path answers, and the evidence it keeps."""
    gone, twice, live = request(), request(), request()
    lost = grant(store, W1, gone, ttl=0.2)
    store.release(W1, [(lost.task_id, lost.epoch, lost.token)])
    grant(store, W2, gone)
    first = grant(store, W1, twice)
    finished = Completion(first.task_id, first.epoch, first.token, FAILED, error="boom")
    assert store.complete(W1, [finished]) == {first.task_id: "applied"}
    mine = grant(store, W1, live)
    runs.clear()
    out = store.complete(W1, [
        Completion(lost.task_id, lost.epoch, lost.token, SUCCEEDED, returned="42"),
        finished,
        Completion(mine.task_id, mine.epoch, mine.token, RETRY)])
    assert runs == [True]
    assert out == {lost.task_id: "evidence", first.task_id: "duplicate",
                   mine.task_id: "applied"}
    with store.engine.connect() as conn:
        kept = conn.execute(sa.select(evidence.c.task_id, evidence.c.epoch, evidence.c.holder,
                                      evidence.c.outcome, evidence.c.result)).all()
        reopened = conn.execute(sa.select(claims.c.state, claims.c.token, claims.c.finished_at)
                                .where(claims.c.task_id == mine.task_id)).one()
    assert [tuple(row) for row in kept] == [(lost.task_id, lost.epoch, W1, SUCCEEDED, "42")]
    assert (reopened.state, reopened.token, reopened.finished_at) == ("open", None, None)


def test_a_refused_packet_leaves_nothing_and_the_general_path_decides(
        store: SqlStore, runs: list[bool]) -> None:
    """A reservation of a task the store already has fails the packet's INSERT after its
    completions (one applied, one kept as evidence) were written: rolled back, then made
    once by the general path."""
    held, again = request(), request()
    lease = grant(store, W1, held)
    retried = grant(store, W1, again)
    runs.clear()
    out = store.exchange(
        W1, TTL, [Completion(retried.task_id, retried.epoch, retried.token, RETRY),
                  Completion(lease.task_id, lease.epoch, "not-its-token", SUCCEEDED)],
        [dataclasses.replace(again, retries=1), request(held.task_id)], [])
    assert runs == [False]  # the packet was refused; the general path answered
    assert out.completed == {retried.task_id: "applied", lease.task_id: "evidence"}
    regrant, taken = out.reserved
    assert isinstance(regrant, Grant) and regrant.epoch == retried.epoch + 1
    assert not isinstance(taken, Grant) and taken.reason == "taken"
    with store.engine.connect() as conn:
        kept = conn.execute(sa.select(evidence.c.task_id)).scalars().all()
        row = conn.execute(sa.select(claims.c.epoch, claims.c.holder)
                           .where(claims.c.task_id == lease.task_id)).one()
    assert (row.epoch, row.holder) == (lease.epoch, W1)
    assert kept == [lease.task_id]  # once: the packet's own row was rolled back
    # The connection went back to the pool clean: the next exchange is a packet again.
    runs.clear()
    assert isinstance(store.reserve(W1, [request()], TTL)[0], Grant)
    assert runs == [True]


def test_a_store_gone_mid_run_is_unavailable_not_a_crash(mariadb_url: str,
                                                         runs: list[bool]) -> None:
    """Its pooled connection cut, then no connection to be had at all: both are the
    store being unavailable (the worker self-fences), never a driver error."""
    migrated(mariadb_url).close()
    server = sa.make_url(mariadb_url)
    proxy = Proxy(server.port or 3306, server.host or "127.0.0.1")
    through = server.set(host="127.0.0.1", port=proxy.port)
    store = open_store(through.render_as_string(hide_password=False), check_schema=False)
    try:
        assert isinstance(store.reserve(W1, [request()], TTL)[0], Grant)
        assert runs == [True]
        proxy.cut()  # the pooled connection dropped under the packet
        with pytest.raises(StoreUnavailable):
            store.exchange(W1, TTL, [], [request()], [])
        proxy.close()  # and now no connection to be had
        with pytest.raises(StoreUnavailable):
            store.exchange(W1, TTL, [], [request()], [])
    finally:
        store.close()
        proxy.close()


@pytest.mark.parametrize("driver", ["pymysql", "mysqldb", "mariadbconnector"])
def test_which_drivers_send_the_packet(driver: str, runs: list[bool]) -> None:
    """PyMySQL and mysqlclient interpolate parameters themselves: one packet. MariaDB
    Connector/Python binds them per statement: the general path, still correct."""
    module = {"pymysql": "pymysql", "mysqldb": "MySQLdb", "mariadbconnector": "mariadb"}[driver]
    services.require_module(module, f"pip install -e '.[mysql-c-drivers]' ({driver})")
    database = Database(services.MARIADB_ADMIN_URL).create()
    try:
        url = sa.make_url(database.url).set(drivername=f"mysql+{driver}")
        sql = open_store(url.render_as_string(hide_password=False), check_schema=False)
        try:
            sql.migrate()
            g = grant(sql, W1, request())
            assert sql.start(W1, g.task_id, g.epoch, g.token, TTL) is not None
            assert sql.complete(W1, [Completion(g.task_id, g.epoch, g.token, SUCCEEDED)]) == {
                g.task_id: "applied"}
            assert runs == ([] if driver == "mariadbconnector" else [True, True, True])
        finally:
            sql.close()
    finally:
        database.drop()
