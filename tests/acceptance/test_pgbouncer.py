"""PostgreSQL through a real PgBouncer (Debian's ``pgbouncer``, tests/helpers/pgbouncer.py):
the pooler mode detected at start, statement pooling refused, real ``-P pulse`` workers
in transaction mode, the ``pulse://`` backend in both modes, ``lease.fenced()`` on an
application engine through the pooler. The contract suites (tests/contract/) and the
permits tests (test_permits.py) run through both modes too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from celery_pulse.errors import InvalidConfig
from celery_pulse.lease import Lease
from celery_pulse.store.base import Completion, Grant, Permit
from celery_pulse.store.sql import open_store
from celery_pulse.store.sql import pooler as pooler_mod
from celery_pulse.store.sql.engine import EngineOptions, make_engine
from celery_pulse.store.sql.fence import make_fencer
from tests.acceptance import test_result_backend as result_backend
from tests.acceptance.test_permits import (
    FREE,
    Cluster,
    all_in_state,
    cluster,
    penv,
    producer,
    runs,
    store_of,
)
from tests.contract.test_claims_contract import W1, W2, grant, request
from tests.helpers.pgbouncer import PgBouncer, pgb_database
from tests.helpers.services import require
from tests.helpers.stores import migrated
from tests.helpers.workers import Env, Worker, wait_alive

__all__ = ["cluster", "penv", "store_of"]

TTL = 30.0


@pytest.fixture
def bouncer(request: pytest.FixtureRequest) -> Iterator[PgBouncer]:
    """A PgBouncer of the test's own: ``parametrize("bouncer", [(mode, pool size)])``."""
    require("postgres")
    mode, size = request.param
    made = PgBouncer(mode, pool_size=size).start()
    try:
        yield made
    finally:
        made.stop()


def _mode(url: str, setting: str = "auto") -> str:
    engine = make_engine(url, EngineOptions(role="cli", pooler=setting))
    try:
        return pooler_mod.mode_of(engine)
    finally:
        engine.dispose()


# -- detection ------------------------------------------------------------------------------
@pytest.mark.parametrize("bouncer", [("transaction", 1), ("transaction", 10),
                                     ("session", 1), ("session", 10)],
                         indirect=True, ids=["transaction-pool1", "transaction-pool10",
                                             "session-pool1", "session-pool10"])
def test_auto_detects_the_mode_and_never_hangs_on_a_pool_of_one(
        bouncer: PgBouncer, pg_url: str) -> None:
    """Passes if ``auto`` finds transaction pooling as such, and session pooling as a
    direct connection (``none``; ``session`` when the second probe got no server: a pool
    of one), within the probes' bounds; a direct connection is ``none``."""
    with pgb_database(bouncer) as url:
        found = _mode(url)
    if bouncer.mode == "transaction":
        assert found == "transaction"
    else:
        assert found in ("none", "session")
    assert _mode(pg_url) == "none"


@pytest.mark.parametrize("bouncer", [("statement", 5)], indirect=True, ids=["statement"])
def test_statement_pooling_is_refused_at_start_with_exit_78(
        bouncer: PgBouncer, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """Passes if a worker through a statement-mode PgBouncer exits 78 at start with one
    ``cannot start`` line naming ``pulse_store_pooler`` and no traceback; and if the
    setting, when given, wins over detection (no probe, no refusal)."""
    with pgb_database(bouncer) as url:
        env = make_env(url, rabbitmq_url, migrate=False)
        w = workers(env, "stmt@%h")
        assert w.wait(60) == 78, w.log()[-3000:]
        lines = [ln for ln in w.log().splitlines() if "cannot start" in ln]
        assert len(lines) == 1 and "pulse_store_pooler" in lines[0], w.log()[-3000:]
        assert "Traceback" not in w.log(), w.log()[-3000:]
        with pytest.raises(InvalidConfig, match="pulse_store_pooler"):
            _mode(url)
        assert _mode(url, "none") == "none"  # named: not detected, not refused


def test_an_explicit_mode_wins_over_detection(pgb_session_url: str, pg_url: str) -> None:
    """Passes if a named mode is used as named: ``transaction`` on a direct connection
    (where ``auto`` finds ``none``), ``session`` through PgBouncer, and the store works
    in it (grants, a start with a permit, completions: unnamed statements only)."""
    assert _mode(pg_url) == "none"
    assert _mode(pg_url, "transaction") == "transaction"
    assert _mode(pgb_session_url, "session") == "session"
    migrated(pg_url).close()
    store = open_store(pg_url, options=EngineOptions(pooler="transaction"))
    try:
        g = grant(store, W1, request())
        started = store.start_many(W1, [(g.task_id, g.epoch, g.token)], TTL,
                                   permits={g.task_id: (Permit("k", 1),)})
        assert g.task_id in started
        store.complete(W1, [Completion(g.task_id, g.epoch, g.token, "succeeded")])
        pipeline = getattr(store.claims, "pipeline", None)
        assert pipeline is not None and pipeline.unnamed
    finally:
        store.close()


@pytest.mark.parametrize("bouncer", [("transaction", 1)], indirect=True, ids=["pool1"])
def test_two_stores_share_one_server_connection(bouncer: PgBouncer) -> None:
    """Two stores (two workers) through a transaction pool of ONE server connection, from
    two threads at once: grants, permit starts and completions interleave on it. Passes
    if every one applies: no statement of one store lands on the other's (the issue's
    ``DuplicatePreparedStatement``, ``prepared statement "pulse_N" requires 8``)."""
    with pgb_database(bouncer) as url:
        migrated(url).close()
        stores = [open_store(url), open_store(url)]
        errors: list[BaseException] = []

        def work(store: Any, holder: str) -> None:
            # The worker's hot path: each exchange completes the last task, reserves
            # and starts the next (several statements in one pipeline), then a start
            # under a permit (a transaction of two round trips).
            try:
                done: list[Completion] = []
                for _ in range(30):
                    out = store.exchange(holder, TTL, done, [request()], [])
                    (g,) = out.reserved
                    assert isinstance(g, Grant), g
                    assert all(v == "applied" for v in out.completed.values()), out.completed
                    lease = (g.task_id, g.epoch, g.token)
                    started = store.start_many(holder, [lease], TTL,
                                               permits={g.task_id: (Permit(holder, 5),)})
                    assert g.task_id in started
                    done = [Completion(g.task_id, g.epoch, g.token, "succeeded")]
                out = store.exchange(holder, TTL, done, [], [])
                assert list(out.completed.values()) == ["applied"]
            except BaseException as exc:
                errors.append(exc)

        try:
            assert pooler_mod.mode_of(stores[0].engine) == "transaction"
            threads = [threading.Thread(target=work, args=(s, h))
                       for s, h in zip(stores, (W1, W2), strict=True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert errors == []
            assert all(not t.is_alive() for t in threads)
        finally:
            for s in stores:
                s.close()


# -- lease.fenced() on the application's own engine ---------------------------------------
def test_fenced_refuses_an_auto_preparing_engine_under_transaction_pooling(
        pgb_transaction_url: str) -> None:
    """Passes if ``lease.fenced(conn)`` on an application engine through a transaction
    pooler is refused naming ``pulse_store_pooler`` and ``prepare_threshold`` while the
    engine prepares (psycopg's default), and works ten times over with
    ``prepare_threshold=None`` (psycopg would prepare from the fifth use)."""
    store = migrated(pgb_transaction_url)
    app_engine = sa.create_engine(pgb_transaction_url)
    plain = sa.create_engine(pgb_transaction_url, connect_args={"prepare_threshold": None})
    fencer = make_fencer(pgb_transaction_url, TTL,
                         lambda: pooler_mod.mode_of(store.engine))
    try:
        g = grant(store, W1, request())
        assert store.start(W1, g.task_id, g.epoch, g.token, TTL)
        far = time.monotonic() + 3600
        lease = Lease(g.task_id, g.epoch, g.token, W1, read_deadline=lambda: (far, False),
                      fencer=fencer, initial_deadline=far)
        refused = r"pulse_store_pooler.*prepare_threshold"
        with app_engine.connect() as conn, pytest.raises(InvalidConfig, match=refused), \
                lease.fenced(conn):
            pass
        for _ in range(10):
            with plain.connect() as conn, lease.fenced(conn):
                conn.execute(sa.text("SELECT 1"))
    finally:
        app_engine.dispose()
        plain.dispose()
        store.close()


# -- the pulse:// backend, both modes, and with a direct listener -------------------------
@pytest.fixture(params=["pgb-session", "pgb-transaction", "pgb-transaction-listen"])
def pooled_stack(request: pytest.FixtureRequest, rabbitmq_url: str
                 ) -> tuple[str, str, dict[str, Any]]:
    """(store_url, broker_url, conf) through PgBouncer: session mode, transaction mode
    (waiters poll), transaction mode with ``pulse_store_listen_url`` (a direct LISTEN)."""
    mode = request.param.removesuffix("-listen")
    url: str = request.getfixturevalue(f"pgb_{mode.split('-')[1]}_url")
    conf: dict[str, Any] = {}
    if request.param.endswith("-listen"):
        database = sa.make_url(url).database
        conf["pulse_store_listen_url"] = f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"
    return url, rabbitmq_url, conf


def test_results_through_pgbouncer(pooled_stack: tuple[str, str, dict[str, Any]],
                                   make_env: Callable[..., Env],
                                   workers: Callable[..., Worker]) -> None:
    """test_result_backend's get, failures, groups, chord and forget, through PgBouncer."""
    result_backend.test_results_groups_and_chords(pooled_stack, make_env, workers)


# -- 2 workers, 300 tasks through transaction pooling ---------------------------------------
def test_two_workers_run_300_tasks_through_transaction_pooling(
        pgb_transaction_url: str, rabbitmq_url: str, tmp_path: Path,
        penv: Callable[..., Env], cluster: Cluster) -> None:
    """The issue's setup: 2 workers x ``-c 2`` through PgBouncer in transaction mode, 300
    tasks. Passes if each ran exactly once and succeeded, each worker logged the
    detected mode, and none paused consuming, reported the store unavailable, or logged
    a traceback."""
    n = 300
    env = penv(pgb_transaction_url, rabbitmq_url)
    journal = tmp_path / "journal.txt"
    ws = tuple(cluster.worker(env, f"t{i}@%h", concurrency=2) for i in range(2))
    cluster.ready(*ws)
    with producer(env) as client:
        ids = [client.send_task(FREE, (str(journal), 0.005)).id for _ in range(n)]
    wait_alive(lambda: all_in_state(pgb_transaction_url, ids, "succeeded"), 120,
               f"all {n} claims to succeed", ws)
    history = runs(journal, FREE)
    assert sorted(r.task_id for r in history) == sorted(ids)  # each exactly once
    for w in ws:
        log = w.log()
        assert "store pooler mode transaction (detected)" in log, log[-3000:]
        for bad in ("stopped consuming", "store unavailable", "Traceback",
                    "DuplicatePreparedStatement", "InvalidSqlStatementName"):
            assert bad not in log, log[-3000:]


@pytest.mark.parametrize("bouncer", [("transaction", 1)], indirect=True, ids=["pool1"])
def test_no_session_setting_reaches_another_client_of_the_pool(bouncer: PgBouncer) -> None:
    """Through a transaction pool of ONE server connection: pulse's store runs its
    statements, then another client of the pool reads the server connection's
    ``idle_in_transaction_session_timeout``. Passes if that client sees the server's
    default (0; the issue: pulse's connect-time 2 s leaked to every client), a pulse
    transaction sees its own 2 s cap, and with the database's own default set pulse
    sets nothing per transaction."""
    with pgb_database(bouncer) as url:
        store = migrated(url)
        other = sa.create_engine(url, poolclass=sa.pool.NullPool,
                                 connect_args={"prepare_threshold": None})
        try:
            g = grant(store, W1, request())
            assert store.start(W1, g.task_id, g.epoch, g.token, TTL)
            with store.engine.begin() as conn:
                assert conn.exec_driver_sql(
                    "SHOW idle_in_transaction_session_timeout").scalar() == "2s"
            with other.connect() as conn:
                assert conn.exec_driver_sql(
                    "SHOW idle_in_transaction_session_timeout").scalar() == "0"
            with other.connect() as conn:
                conn.exec_driver_sql(f'ALTER DATABASE "{sa.make_url(url).database}" '
                                     "SET idle_in_transaction_session_timeout = '3s'")
                conn.commit()
        finally:
            other.dispose()
            store.close()
        # The new default applies to new server connections only: PgBouncer's console
        # closes the ones it holds.
        with psycopg.Connection.connect(host="127.0.0.1", port=bouncer.port, user="postgres",
                                        dbname="pgbouncer", autocommit=True) as admin:
            admin.execute("RECONNECT")
        engine = make_engine(url, EngineOptions(pooler="transaction"))
        try:
            with engine.begin() as conn:
                assert conn.exec_driver_sql(
                    "SHOW idle_in_transaction_session_timeout").scalar() == "3s"
            found = pooler_mod.of(engine)
            assert found is not None and not found.per_transaction_timeout
        finally:
            engine.dispose()
