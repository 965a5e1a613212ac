"""SQLite runs a worker's exchange in one transaction: a failure anywhere in it leaves
nothing of it behind, and driver errors reach the caller as the store's errors. A usual
exchange is one pass on the driver's connection; one that needs more is rolled back and
made by the general path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_pulse.errors import PulseError, SchemaMissing
from celery_pulse.store.base import Completion, Grant
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.sql.sqlite import SqliteClaims
from celery_pulse.store.sql.tables import claims as claims_table
from celery_pulse.store.sql.tables import evidence
from tests.contract.test_claims_contract import request
from tests.helpers.stores import claim_row, migrated


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    sql = migrated(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        yield sql
    finally:
        sql.close()


def _running(store: SqlStore) -> Grant:
    (granted,) = store.reserve("w1", [request()], 30.0)
    assert isinstance(granted, Grant)
    assert granted.task_id in store.start_many("w1", [_key(granted)], 30.0)
    return granted


def _key(grant: Grant) -> tuple[str, int, str]:
    return grant.task_id, grant.epoch, grant.token


def test_a_failed_reservation_takes_the_exchanges_completion_back_with_it(
        store: SqlStore) -> None:
    done = _running(store)
    with store.engine.begin() as conn:  # the reservation of task "boom" fails in SQLite
        conn.exec_driver_sql("CREATE TRIGGER boom BEFORE INSERT ON pulse_claims "
                             "WHEN NEW.task_id = 'boom' BEGIN SELECT RAISE(ABORT, 'boom'); END")
    with pytest.raises((PulseError, sa.exc.DBAPIError), match="boom"):
        store.exchange("w1", 30.0, [Completion(*_key(done), "succeeded")],
                       [request("boom")], [])
    assert claim_row(store, done.task_id).state == "running"  # not completed
    # Without the failing reservation the same exchange applies.
    answers = store.exchange("w1", 30.0, [Completion(*_key(done), "succeeded")],
                             [request()], [])
    assert answers.completed == {done.task_id: "applied"}
    assert isinstance(answers.reserved[0], Grant)
    assert claim_row(store, done.task_id).state == "succeeded"


def test_a_driver_error_in_the_exchange_is_the_stores_error(store: SqlStore) -> None:
    done = _running(store)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE pulse_claims")
    with pytest.raises(SchemaMissing):
        store.exchange("w1", 30.0, [Completion(*_key(done), "succeeded")], [request()], [])


def _traced(store: SqlStore) -> list[str]:
    """Every statement SQLite runs on the store's connections from now on."""
    seen: list[str] = []
    store.engine.dispose()  # new connections, each traced from its start

    @sa.event.listens_for(store.engine, "connect")
    def _trace(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.set_trace_callback(seen.append)

    return seen


def test_a_usual_exchange_is_one_transaction_of_one_statement_per_verb(
        store: SqlStore) -> None:
    done, waiting = _running(store), store.reserve("w1", [request()], 30.0)[0]
    assert isinstance(waiting, Grant)
    claims = store.claims
    assert isinstance(claims, SqliteClaims)
    before = dict(claims.made)
    seen = _traced(store)
    out = store.exchange("w1", 30.0, [Completion(*_key(done), "succeeded")], [request()],
                         [_key(waiting)])
    assert out.completed == {done.task_id: "applied"}
    assert isinstance(out.reserved[0], Grant) and set(out.started) == {waiting.task_id}
    hot = [s.split()[0] for s in seen if not s.startswith("PRAGMA")]
    assert hot[0] == "BEGIN" and hot[-1] == "COMMIT" and len(hot) == 5, seen
    assert claims.made == {**before, "direct_exchanges": before["direct_exchanges"] + 1}
    assert claim_row(store, done.task_id).state == "succeeded"
    assert claim_row(store, waiting.task_id).state == "running"


def test_a_refused_reservation_rolls_the_pass_back_and_the_general_path_decides(
        store: SqlStore) -> None:
    """The completion applied in the first pass is rolled back with it, then applied by
    the general path: answered "applied", not "duplicate"; the new task granted once."""
    done, held = _running(store), _running(store)
    claims = store.claims
    assert isinstance(claims, SqliteClaims)
    fresh = request()
    out = store.exchange("w1", 30.0, [Completion(*_key(done), "succeeded")],
                         [fresh, request(held.task_id)], [])
    assert claims.made["direct_exchanges_redone"] == 1
    assert out.completed == {done.task_id: "applied"}
    granted, taken = out.reserved
    assert isinstance(granted, Grant) and granted.epoch == 1 and granted.task_id == fresh.task_id
    assert not isinstance(taken, Grant) and taken.reason == "taken"
    # Rolled back to a clean connection: the next usual exchange takes the one pass.
    assert isinstance(store.reserve("w1", [request()], 30.0)[0], Grant)
    assert claims.made["direct_exchanges_redone"] == 1


def test_a_stale_completion_is_kept_as_evidence_once(store: SqlStore) -> None:
    lost = _running(store)
    with store.engine.begin() as conn:  # taken over: another holder, a new epoch
        conn.execute(sa.update(claims_table).where(claims_table.c.task_id == lost.task_id)
                     .values(holder="w2", epoch=lost.epoch + 1, token="t2"))
    mine = _running(store)
    out = store.complete("w1", [Completion(*_key(lost), "succeeded", returned="42"),
                                Completion(*_key(mine), "succeeded")])
    assert out == {lost.task_id: "evidence", mine.task_id: "applied"}
    with store.engine.connect() as conn:
        kept = conn.execute(sa.select(evidence.c.task_id, evidence.c.result)).all()
    assert [tuple(row) for row in kept] == [(lost.task_id, "42")]
