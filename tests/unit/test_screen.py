"""The intake's screening of a delivery (issue 32): what the claim row and Celery need."""

from __future__ import annotations

import uuid
from typing import Any

import pymysql
import pytest

from celery_pulse.bootsteps.screen import name_problem, problem
from celery_pulse.errors import StoreUnavailable, Unstorable
from celery_pulse.store.sql.errors import translate

GOOD = {"id": str(uuid.uuid4()), "task": "proj.add", "retries": 0,
        "timelimit": [None, None], "eta": None, "expires": None}


def test_a_well_formed_delivery_passes() -> None:
    assert problem(GOOD, 100, 1000) is None
    assert problem({**GOOD, "timelimit": [1.5, 10], "eta": "2026-01-01T00:00:00+00:00",
                    "retries": 3}, 100, None) is None


@pytest.mark.parametrize(("change", "words"), [
    ({"id": None}, "no task id"),
    ({"id": 12}, "of type int"),
    ({"id": ["a"]}, "of type list"),
    ({"id": ""}, "empty"),
    ({"id": "i" * 256}, "256 characters"),
    ({"id": "a\x00b"}, "NUL"),
    ({"id": "\ud800"}, "not valid Unicode"),
    ({"retries": "abc"}, "retries"),
    ({"retries": True}, "retries"),
    ({"timelimit": "abc"}, "pair"),
    ({"timelimit": [None]}, "pair"),
    ({"timelimit": ["soon", None]}, "number of seconds"),
    ({"timelimit": [None, -1]}, "number of seconds"),
    ({"eta": "not a time"}, "eta"),
    ({"expires": 12}, "expires"),
    ({"pulse_pub": "p\x00"}, "pulse_pub"),
])
def test_a_malformed_header_is_named(change: dict[str, Any], words: str) -> None:
    found = problem({**GOOD, **change}, 100, None)
    assert found is not None and words in found, found


def test_headers_that_are_not_a_mapping() -> None:
    assert problem(["id"], 1, None) == "its headers are not a mapping"


def test_a_body_over_the_store_limit() -> None:
    assert "1,001 bytes" in (problem(GOOD, 1001, 1000) or "")
    assert problem(GOOD, 1000, 1000) is None


def test_a_task_name_the_claims_table_cannot_keep() -> None:
    assert name_problem("proj.add") is None
    assert "300 characters" in (name_problem("x" * 300) or "")


@pytest.mark.parametrize(("code", "text"), [
    (1406, "Data too long for column 'content_type' at row 1"),
    (1366, "Incorrect string value: '\\xF0\\x9F' for column 'task_id'"),
    (1153, "Got a packet bigger than 'max_allowed_packet' bytes"),
])
def test_mysql_refusing_a_value_is_unstorable_not_an_outage(code: int, text: str) -> None:
    # 1153 is reported like a lost connection (the server drops it): still the value's.
    error = translate(pymysql.err.OperationalError(code, text), "reserve", True)
    assert type(error) is Unstorable
    assert not isinstance(error, StoreUnavailable)


def test_postgres_data_exceptions_are_unstorable() -> None:
    import psycopg.errors

    exc = psycopg.errors.StringDataRightTruncation("value too long for type character varying(128)")
    assert type(translate(exc, "reserve", False)) is Unstorable
    exc = psycopg.errors.ProgramLimitExceeded("index row size 3000 exceeds maximum 2712")
    assert type(translate(exc, "reserve", False)) is Unstorable


def test_a_lost_connection_stays_an_outage() -> None:
    exc = pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query")
    assert type(translate(exc, "reserve", True)) is StoreUnavailable
