"""Driver errors become pulse errors in one place: MySQL/MariaDB error numbers included."""

from __future__ import annotations

import sys

import pymysql
import pytest

from celery_pulse.errors import Contended, InvalidConfig, SchemaMissing, StoreUnavailable
from celery_pulse.store.sql.engine import make_engine
from celery_pulse.store.sql.errors import mysql_code, translate


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


def test_mysql_error_numbers_of_each_driver() -> None:
    """mysqlclient puts the number first in ``args`` as PyMySQL does; MariaDB Connector/
    Python keeps it in ``errno``. Classes are made here with each driver's module name, so
    the test runs whether or not the C drivers are installed."""
    mysqldb_error = type("OperationalError", (Exception,), {"__module__": "MySQLdb._exceptions"})
    connector_error = type("OperationalError", (Exception,), {"__module__": "mariadb"})
    by_connector = connector_error("Deadlock found when trying to get lock")
    by_connector.errno = 1213
    assert mysql_code(mysqldb_error(1213, "Deadlock found")) == 1213
    assert mysql_code(by_connector) == 1213
    assert type(translate(by_connector, "reserve", True)) is Contended
    # Another driver's exception with an int first argument is not a MySQL error number.
    assert mysql_code(OSError(1213, "not a server error")) is None


def test_a_mysql_driver_that_is_not_installed_names_the_setting_and_the_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "MySQLdb", None)  # import MySQLdb now raises ImportError
    with pytest.raises(InvalidConfig, match=r"pulse_store_url.*mysqldb.*pip install mysqlclient"):
        make_engine("mysql+mysqldb://root@127.0.0.1:3306/test")
