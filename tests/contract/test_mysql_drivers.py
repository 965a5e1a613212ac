"""The store contracts again on MariaDB through the other MySQL drivers pulse accepts.

PyMySQL (the ``[mysql]`` extra, and what ``mysql://`` means to pulse) runs every contract
suite already. mysqlclient (``mysql+mysqldb://``) and MariaDB Connector/Python
(``mariadb+mariadbconnector://``) report error numbers, matched-row counts and the server
version their own ways, and those decide grants: a duplicate key re-runs a reservation,
a deadlock is contention, a fenced write counts the rows it matched. So every contract
test that takes a store (or a store's URL) runs here once per driver.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import ModuleType

import pytest
import sqlalchemy as sa

from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.store.sql.engine import MYSQL_DRIVERS
from tests.contract import (
    test_claims_contract,
    test_leader_beat_contract,
    test_migrations,
    test_permits_contract,
    test_recover_contract,
    test_registry_contract,
    test_results_contract,
)
from tests.contract.test_results_contract import backend  # noqa: F401 - the results' fixture
from tests.helpers import services
from tests.helpers.mariadb import Database

DRIVERS = [pytest.param(name, id=name, marks=pytest.mark.mariadb)
           for name in MYSQL_DRIVERS if name != "pymysql"]


#: The fixtures the contract suites take a store or its URL from; overridden here.
STORE_FIXTURES = ("store", "sql_store", "server_store", "store_url", "backend")


@pytest.fixture(params=DRIVERS)
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh MariaDB database, reached through the driver of this parameter."""
    module, install = MYSQL_DRIVERS[request.param]
    services.require_module(module, install)
    services.require("mariadb")
    database = Database(services.MARIADB_ADMIN_URL).create()
    try:
        url = sa.make_url(database.url).set(drivername=f"mysql+{request.param}")
        yield url.render_as_string(hide_password=False)
    finally:
        database.drop()


@pytest.fixture
def store(store_url: str) -> Iterator[SqlStore]:
    """The migrated store on that database (``sql_store`` comes from ``store_url`` too)."""
    sql = open_store(store_url, check_schema=False)
    try:
        sql.migrate()
        yield sql
    finally:
        sql.close()


@pytest.fixture
def server_store(store: SqlStore) -> SqlStore:
    return store


def _store_tests(module: ModuleType) -> dict[str, object]:
    """The module's test functions that run on a store fixture, under their names."""
    return {name: fn for name, fn in vars(module).items()
            if name.startswith("test_") and inspect.isfunction(fn)
            and set(STORE_FIXTURES) & set(inspect.signature(fn).parameters)}


for _module in (test_claims_contract, test_recover_contract, test_registry_contract,
                test_leader_beat_contract, test_migrations, test_results_contract,
                test_permits_contract):
    globals().update(_store_tests(_module))


def test_each_driver_is_the_one_in_use(store: SqlStore) -> None:
    """The URL's driver is the one connected (not PyMySQL behind another name)."""
    with store.engine.connect() as conn:
        module = type(conn.connection.driver_connection).__module__
    assert module.split(".")[0] in ("MySQLdb", "mariadb")
