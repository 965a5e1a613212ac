"""Driver errors become pulse errors in one place: MySQL/MariaDB error numbers included."""

from __future__ import annotations

import pymysql
import pytest

from celery_pulse.errors import Contended, SchemaMissing, StoreUnavailable
from celery_pulse.store.sql.errors import translate


@pytest.mark.parametrize(("code", "text", "lost", "expected"), [
    (1213, "Deadlock found when trying to get lock; try restarting transaction", True,
     Contended),
    (1205, "Lock wait timeout exceeded; try restarting transaction", True, Contended),
    (1146, "Table 'test.pulse_claims' doesn't exist", False, SchemaMissing),
    (1290, "The MariaDB server is running with the --read-only option so it cannot "
           "execute this statement", False, StoreUnavailable),
    (1114, "The table 'pulse_claims' is full", False, StoreUnavailable),
    (2003, "Can't connect to MySQL server on '127.0.0.1' ([Errno 111] Connection refused)",
     True, StoreUnavailable),
    (2013, "Lost connection to MySQL server during query", True, StoreUnavailable),
])
def test_mysql_errors(code: int, text: str, lost: bool, expected: type[Exception]) -> None:
    error = translate(pymysql.err.OperationalError(code, text), "reserve", lost)
    assert type(error) is expected
    if expected is not SchemaMissing:
        assert "reserve" in str(error)


def test_contention_is_neither_an_outage_nor_a_lost_lease() -> None:
    assert not issubclass(Contended, StoreUnavailable)


def test_a_mysql_syntax_error_is_a_bug_not_an_outage() -> None:
    exc = pymysql.err.ProgrammingError(1064, "You have an error in your SQL syntax")
    assert translate(exc, "reserve", False) is None


@pytest.mark.parametrize("error", ["DeadlockDetected", "SerializationFailure"])
def test_postgres_deadlocks_are_contention(error: str) -> None:
    import psycopg.errors

    exc = getattr(psycopg.errors, error)("deadlock detected")
    assert type(translate(exc, "reserve", True)) is Contended
