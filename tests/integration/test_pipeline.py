"""The PostgreSQL hot path's pipelined connection (:class:`Pipeline`), on a real server.

It drives libpq's pipeline itself: what each statement returns, that a failing one
undoes the whole exchange (one implicit transaction), that its prepared statements
stay bounded, and that a connection the server dropped is the store being unavailable
and the next exchange reconnects. And the transaction of two round trips built on it
(:class:`TwoTrips`: starts under permits): one transaction, undone by a failure in
either trip or between them, and driven without blocking as the event loop does.
"""

from __future__ import annotations

import select
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from celery_pulse.errors import StoreUnavailable
from celery_pulse.store.sql import libpq_io
from celery_pulse.store.sql.pipeline import PREPARED_MAX, Pipeline
from celery_pulse.store.sql.pipeline_tx import TwoTrips

pytestmark = pytest.mark.postgres

ROW = "INSERT INTO t VALUES (%s, %s, %s, %s, %s, %s) RETURNING id, n, f, b, note, flag"


@pytest.fixture
def engine(pg_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (id text PRIMARY KEY, n bigint, f float8, "
                             "b bytea, note text, flag boolean)")
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(params=["gil-free", "psycopg"])
def pipeline(request: pytest.FixtureRequest, engine: sa.Engine,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Pipeline]:
    """Both ways of making libpq's socket calls: through ctypes (the GIL released, where
    psycopg's libpq is known) and psycopg's own calls (elsewhere)."""
    if request.param == "psycopg":
        monkeypatch.setattr(libpq_io, "gil_free_libpq", lambda: None)
    pipe = Pipeline(engine)
    try:
        yield pipe
    finally:
        pipe.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="found through /proc/self/maps")
def test_on_linux_the_socket_calls_go_through_psycopg_s_own_libpq() -> None:
    """Where this suite runs (Linux, psycopg's binary or C build), the GIL-free calls must
    be found: a silent fallback would cost the worker ~6% of its no-op throughput."""
    lib = libpq_io.gil_free_libpq()
    assert lib is not None
    assert lib.PQlibVersion() == psycopg.pq.version()


def ids(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [row[0] for row in conn.exec_driver_sql("SELECT id FROM t ORDER BY id")]


def test_each_statement_returns_its_rows_with_their_types(pipeline: Pipeline) -> None:
    rows = pipeline.run("test", [
        (ROW, ("a", 2**40, 2.5, b"\x00\xff", None, True)),
        (ROW, ("b", 3, -1.0, None, "é", False)),
        ("SELECT count(*) FROM t WHERE n > %s", (1,)),  # sees the rows inserted before it
        ("DELETE FROM t WHERE id = %s", ("none",)),  # returns no rows
    ])
    assert rows == [[("a", 2**40, 2.5, b"\x00\xff", None, True)],
                    [("b", 3, -1.0, None, "é", False)], [(2,)], []]


def test_a_failing_statement_undoes_the_whole_exchange(engine: sa.Engine,
                                                         pipeline: Pipeline) -> None:
    pipeline.run("test", [(ROW, ("a", 1, 0.0, None, None, None))])
    with pytest.raises(psycopg.errors.UniqueViolation):
        pipeline.run("test", [(ROW, ("b", 1, 0.0, None, None, None)),
                              (ROW, ("a", 1, 0.0, None, None, None))])
    assert ids(engine) == ["a"]  # "b" went with the exchange that failed
    assert pipeline.run("test", [(ROW, ("c", 1, 0.0, None, None, None))]) == [
        [("c", 1, 0.0, None, None, None)]]
    assert ids(engine) == ["a", "c"]


def test_prepared_statements_stay_bounded_and_evicted_ones_still_run(
        pipeline: Pipeline) -> None:
    statements = [f"SELECT %s::bigint + {i}" for i in range(PREPARED_MAX + 20)]
    for i, sql in enumerate(statements):
        assert pipeline.run("test", [(sql, (1,))]) == [[(1 + i,)]]
    prepared = pipeline.run("test", [("SELECT count(*) FROM pg_prepared_statements", ())])
    assert PREPARED_MAX // 2 < prepared[0][0][0] <= PREPARED_MAX
    assert pipeline.run("test", [(statements[0], (41,))]) == [[(41,)]]  # evicted first


def test_a_dropped_connection_is_the_store_unavailable_and_the_next_exchange_reconnects(
        engine: sa.Engine, pipeline: Pipeline) -> None:
    backend = "SELECT pg_backend_pid()"
    pid = pipeline.run("test", [(backend, ())])[0][0][0]
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
    with pytest.raises(StoreUnavailable):
        pipeline.run("test", [(ROW, ("a", 1, 0.0, None, None, None))])
    assert pipeline.run("test", [(backend, ())])[0][0][0] != pid
    assert pipeline.run("test", [(ROW, ("a", 1, 0.0, None, None, None))]) == [
        [("a", 1, 0.0, None, None, None)]]


# -- a transaction of two round trips (TwoTrips) ----------------------------------------
def one(n: int, row: str) -> tuple[str, tuple[object, ...]]:
    return (ROW, (row, n, 0.0, None, None, None))


def test_two_trips_are_one_transaction_the_first_trip_s_rows_deciding_the_second(
        engine: sa.Engine, pipeline: Pipeline) -> None:
    """The first trip's statements stay uncommitted (invisible elsewhere) until the
    second trip's COMMIT; ``then`` sees the first trip's rows, not the opening's."""
    seen: list[object] = []

    def then(rows: list[list[tuple[Any, ...]]]) -> list[tuple[str, tuple[object, ...]]]:
        seen.append(rows)
        seen.append(ids(engine))  # another connection, between the trips
        ((count,),) = rows[1]
        return [one(count, "b")]

    trips = TwoTrips.begin(pipeline, "test", [one(1, "a"), ("SELECT count(*) FROM t", ())],
                           then)
    trips.wait(10)
    assert seen == [[[("a", 1, 0.0, None, None, None)], [(1,)]], []]
    assert trips.rows() == [[("a", 1, 0.0, None, None, None)], [(1,)],
                            [("b", 1, 0.0, None, None, None)]]
    assert ids(engine) == ["a", "b"]
    assert pipeline.run("test", [("SELECT count(*) FROM t", ())]) == [[(2,)]]


def test_a_failing_second_trip_undoes_the_first(engine: sa.Engine,
                                                 pipeline: Pipeline) -> None:
    trips = TwoTrips.begin(pipeline, "test", [one(1, "a")], lambda _rows: [one(2, "a")])
    with pytest.raises(psycopg.errors.UniqueViolation):
        trips.wait(10)
        trips.rows()
    assert ids(engine) == []
    assert pipeline.run("test", [one(3, "c")]) == [[("c", 3, 0.0, None, None, None)]]
    assert ids(engine) == ["c"]


def test_a_decision_that_raises_leaves_nothing_committed_and_the_pipeline_usable(
        engine: sa.Engine, pipeline: Pipeline) -> None:
    def then(_rows: object) -> list[tuple[str, tuple[object, ...]]]:
        raise RuntimeError("a bug between the trips")

    trips = TwoTrips.begin(pipeline, "test", [one(1, "a")], then)
    with pytest.raises(RuntimeError):
        trips.wait(10)
    assert ids(engine) == []  # the connection was closed: the server rolled back
    assert pipeline.run("test", [one(2, "b")]) == [[("b", 2, 0.0, None, None, None)]]


def test_two_trips_are_driven_without_blocking_as_the_event_loop_does(
        engine: sa.Engine, pipeline: Pipeline) -> None:
    """``begin_now`` and ``step`` on the socket's readiness: the second trip goes out
    from ``step`` when the first's answer is in."""
    assert TwoTrips.begin_now(pipeline, "test", [one(1, "a")], lambda _r: []) is None
    pipeline.run("test", [("SELECT 1", ())])  # connected: nothing blocks now
    trips = TwoTrips.begin_now(pipeline, "test", [one(1, "a")], lambda _r: [one(2, "b")])
    assert trips is not None
    steps = 0
    while not trips.done:
        ready, _, _ = select.select([trips.fileno], [], [], 5)
        assert ready, "no answer in 5 s"
        trips.step()
        steps += 1
    assert steps >= 2  # one answer per trip
    assert [r[0][0] for r in trips.rows()] == ["a", "b"]
    assert ids(engine) == ["a", "b"]
