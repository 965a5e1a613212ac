"""A value the store cannot keep is :class:`Unstorable` (about one delivery), never an
outage, and the store goes on serving (issue 32). Run on every SQL store (``sql_store``):
what a store cannot keep is decided by its columns' widths and its driver's limits."""

from __future__ import annotations

import dataclasses

import pytest

from celery_pulse.errors import Unstorable
from celery_pulse.store.base import Grant, ReserveRequest
from celery_pulse.store.sql import SqlStore
from tests.contract.test_claims_contract import TTL, W1, request


def _with_content_type(content_type: str) -> ReserveRequest:
    req = request()
    return dataclasses.replace(req, message=dataclasses.replace(req.message,
                                                                content_type=content_type))


def test_a_value_over_its_column_is_unstorable_and_the_store_goes_on(
        sql_store: SqlStore) -> None:
    too_long = _with_content_type("application/" + "x" * 200)  # the column keeps 128
    if sql_store.dialect.name == "sqlite":  # SQLite keeps a string of any length
        (kept,) = sql_store.reserve(W1, [too_long], TTL)
        assert isinstance(kept, Grant)
    else:
        with pytest.raises(Unstorable, match="refused"):
            sql_store.reserve(W1, [too_long], TTL)
        with pytest.raises(Unstorable):  # the hot path's exchange says the same
            sql_store.exchange(W1, TTL, [], [too_long, request()], [])
    (after,) = sql_store.reserve(W1, [request()], TTL)
    assert isinstance(after, Grant)


def test_the_store_names_the_largest_body_it_keeps(sql_store: SqlStore) -> None:
    limit = sql_store.max_message_bytes()
    assert limit is not None
    if sql_store.dialect.is_mysql:  # half of what max_allowed_packet leaves (hex, escapes)
        with sql_store.engine.connect() as conn:
            packet = int(conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar_one())
        assert limit < packet // 2
        big = dataclasses.replace(request(), message=dataclasses.replace(
            request().message, body=b"y" * (limit - 1000)))
        (kept,) = sql_store.reserve(W1, [big], TTL)  # one that just fits is kept
        assert isinstance(kept, Grant)
    else:
        assert limit > 500_000_000
