"""SQLite runs a worker's exchange in one transaction: a failure anywhere in it leaves
nothing of it behind, and driver errors reach the caller as the store's errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_pulse.errors import PulseError, SchemaMissing
from celery_pulse.store.base import Completion, Grant
from celery_pulse.store.sql import SqlStore
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
