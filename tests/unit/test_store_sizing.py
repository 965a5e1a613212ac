"""The connection rules of :mod:`celery_pulse.store.sql.sizing`: the pool each role gets,
the bounded wait, and the name each connection gives."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from celery_pulse.settings import Settings
from celery_pulse.store.sql import sizing
from celery_pulse.store.sql.engine import EngineOptions

SQLITE = "sqlite:///pulse.sqlite3"


@pytest.mark.parametrize("role", ["worker", "cli", "beat", "flower"])
def test_a_process_pool_never_overflows(role: str) -> None:
    options = EngineOptions.of(Settings(store_url=SQLITE, store_pool_size=3), role)
    assert options.pool() == {"pool_size": 3, "max_overflow": 0, "pool_timeout": 5.0}


def test_a_gateways_pool_serves_its_workers_side_by_side_and_never_overflows() -> None:
    small = EngineOptions.of(Settings(store_url=SQLITE, store_pool_size=3), "gateway")
    assert small.pool() == {"pool_size": sizing.GATEWAY_POOL_SIZE, "max_overflow": 0,
                            "pool_timeout": 5.0}
    large = EngineOptions.of(Settings(store_url=SQLITE, store_pool_size=40), "gateway")
    assert large.pool()["pool_size"] == 40


def test_a_pool_child_keeps_one_connection_whatever_the_setting() -> None:
    options = EngineOptions.of(Settings(store_url=SQLITE, store_pool_size=8), "child")
    assert options.pool()["pool_size"] == sizing.CHILD_POOL_SIZE == 1
    assert options.pool()["max_overflow"] == 0


def test_the_backend_role_serves_waiting_threads_past_its_pool() -> None:
    options = EngineOptions.of(Settings(store_url=SQLITE, store_pool_size=2), "backend")
    assert options.pool() == {"pool_size": 2, "max_overflow": sizing.BACKEND_OVERFLOW,
                              "pool_timeout": sizing.BACKEND_POOL_TIMEOUT_S}


@pytest.mark.parametrize(("ttl", "expected"), [(30.0, 5.0), (6.0, 1.0), (3.0, 0.5)])
def test_the_pool_wait_is_under_half_a_renewal_interval(ttl: float, expected: float) -> None:
    """A renewal that cannot get a connection fails in time for the next one."""
    settings = Settings(store_url=SQLITE, lease_ttl=ttl)
    assert EngineOptions.of(settings, "worker").pool_timeout == expected
    assert expected <= settings.renew_interval / 2


def test_a_connection_names_its_role_process_and_host() -> None:
    assert sizing.connection_name("child") == (
        f"pulse:child:{os.getpid()}@{socket.gethostname()}"[:sizing.NAME_LIMIT])


@pytest.mark.parametrize(("backend", "driver", "given", "expected"), [
    ("postgresql", "psycopg", {}, {"fallback_application_name": "NAME"}),
    ("postgresql", "psycopg", {"application_name": "billing"},
     {"application_name": "billing", "fallback_application_name": "NAME"}),
    ("mysql", "pymysql", {}, {"program_name": "NAME"}),
    ("mysql", "pymysql", {"program_name": "billing"}, {"program_name": "billing"}),
    ("mysql", "mysqldb", {}, {}),
])
def test_a_name_given_by_the_url_wins(backend: str, driver: str, given: dict[str, Any],
                                      expected: dict[str, Any]) -> None:
    """libpq uses ``fallback_application_name`` only when the URL (or ``PGAPPNAME``)
    names none; PyMySQL's ``program_name`` from the URL is kept."""
    cparams = dict(given)
    sizing.name_connection(backend, driver, "worker", cparams)
    name = sizing.connection_name("worker")
    assert cparams == {k: (name if v == "NAME" else v) for k, v in expected.items()}
