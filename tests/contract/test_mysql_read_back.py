"""The claim contract on MariaDB as MySQL 8 runs it: a new claim's grant read back under
the reservation's locks, not taken from ``INSERT .. RETURNING`` (which MySQL lacks).

MariaDB answers both ways, so the read-back path is held to the same contract here
(:attr:`~celery_pulse.store.sql.mysql.MySqlClaims.returning_inserts` set False).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from celery_pulse.store.sql import SqlStore
from celery_pulse.store.sql.mysql import MySqlClaims
from tests.contract import test_claims_contract
from tests.contract.conftest import migrated

pytestmark = pytest.mark.mariadb


@pytest.fixture
def store(mariadb_url: str) -> Iterator[SqlStore]:
    sql = migrated(mariadb_url)
    assert isinstance(sql.claims, MySqlClaims)
    sql.claims.returning_inserts = False
    try:
        yield sql
        assert sql.claims.returning_inserts is False  # never asked of the dialect
    finally:
        sql.close()


globals().update({name: fn for name, fn in vars(test_claims_contract).items()
                  if name.startswith("test_") and inspect.isfunction(fn)
                  and "store" in inspect.signature(fn).parameters})

