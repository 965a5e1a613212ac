"""A rate key's bound on its recent starts, in SQL (:mod:`celery_pulse.store.rate_bound`).

These speak about SQL itself (the row of ``pulse_permits`` and the log of
``pulse_rate_starts``, as another writer leaves them), so they take ``sql_store``: every
SQL store, PostgreSQL's pipelined starts and the general ones of SQLite and MariaDB. The
rule they keep is the rates contract's (test_rates_contract.py).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_pulse.store.base import Permit
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.sql.tables import permits, rate_starts
from tests.contract.test_claims_contract import W1, grant, request
from tests.contract.test_permits_contract import needs, start


def _row(store: SqlStore, key: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(sa.select(permits).where(permits.c.key == key)).one()


def _log_starts(store: SqlStore, key: str, count: int, *, tag: str) -> None:
    """Starts written to the key's log as now, by a writer that keeps no bound."""
    with store.engine.begin() as conn:
        now = conn.execute(sa.select(store.dialect.now())).scalar_one()
        conn.execute(sa.insert(rate_starts), [
            {"key": key, "task_id": f"{tag}-{i}", "epoch": 1, "started_at": float(now)}
            for i in range(count)])


def _starts(store: SqlStore, rate: Permit, count: int) -> tuple[int, int]:
    grants = [grant(store, W1, request()) for _ in range(count)]
    started, waiting = start(store, W1, grants, needs(grants, rate))
    return len(started), len(waiting)


def test_rate_bounds_far_from_the_limit_a_start_is_granted_without_reading_the_log(
        sql_store: SqlStore) -> None:
    """Limit 10 per 60 s: the first batch counts (no bound yet) and seeds the buckets;
    with 2 of 10 known, the next batch of 2 is granted by the bound alone: 20 rows
    written to the log meanwhile by a writer that kept no bound are not read. (Only a
    writer outside this code's rules can do that; the next test is the one that can.)"""
    rate = Permit("rate:task:far", 10, 60.0)
    assert _starts(sql_store, rate, 2) == (2, 0)
    row = _row(sql_store, rate.key)
    assert (row.bucket_starts + row.prev_starts, row.bounded_at) == (2, row.updated_at)
    _log_starts(sql_store, rate.key, 20, tag="unseen")
    assert _starts(sql_store, rate, 2) == (2, 0)
    assert _row(sql_store, rate.key).bucket_starts + _row(sql_store, rate.key).prev_starts == 4


def test_rate_bounds_a_start_by_a_worker_of_the_revision_before_makes_the_next_count(
        sql_store: SqlStore) -> None:
    """Limit 3 per 60 s, 2 started (bound 2). A worker of the revision before starts one
    of the key as it does: its lock moves ``updated_at`` and it logs the start, keeping no
    bound. The next start must not trust the bound (2 + 1 fits): it counts 3 and waits,
    and the buckets are seeded again from that count."""
    rate = Permit("rate:task:rolling", 3, 60.0)
    assert _starts(sql_store, rate, 2) == (2, 0)
    with sql_store.engine.begin() as conn:
        conn.execute(sa.update(permits).where(permits.c.key == rate.key).values(
            updated_at=permits.c.updated_at + 0.5))
    _log_starts(sql_store, rate.key, 1, tag="older-worker")
    assert _starts(sql_store, rate, 1) == (0, 1)
    row = _row(sql_store, rate.key)
    assert (row.bucket_starts + row.prev_starts, row.bounded_at) == (3, row.updated_at)


def test_rate_bounds_a_changed_window_makes_the_next_count(sql_store: SqlStore) -> None:
    """Buckets kept for a 60 s window don't bound a 120 s one: a key's window changed by
    a new setting counts its log again."""
    assert _starts(sql_store, Permit("rate:task:window", 3, 60.0), 2) == (2, 0)
    _log_starts(sql_store, "rate:task:window", 1, tag="unseen")
    assert _starts(sql_store, Permit("rate:task:window", 3, 120.0), 1) == (0, 1)
