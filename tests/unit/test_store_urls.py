"""Store URLs: the driverless PostgreSQL forms mean psycopg 3, mapped in one place.

``postgres://`` is what Django's ``DATABASE_URL`` and Heroku hand out; ``postgresql://``
is SQLAlchemy's own form, which would pick psycopg2 (not a pulse dependency).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from celery_pulse.backend import store_url_for
from celery_pulse.settings import Settings
from celery_pulse.store_urls import canonical_store_url
from tests.helpers.workers import ROOT


@pytest.mark.parametrize("url", ["postgres://u:p@db.example:5433/app?sslmode=require",
                                 "postgresql://u:p@db.example:5433/app?sslmode=require"])
def test_driverless_postgres_urls_mean_psycopg(url: str) -> None:
    expected = "postgresql+psycopg://u:p@db.example:5433/app?sslmode=require"
    assert canonical_store_url(url) == expected
    assert Settings(store_url=url).store_url == expected
    assert Settings.from_conf({"pulse_store_url": url}).store_url == expected
    assert store_url_for(url, {}) == expected  # result_backend = "pulse+postgres://..."


@pytest.mark.parametrize("url", ["postgresql+psycopg://h/db", "sqlite:///x.db",
                                 "mysql://root@h/db", "mariadb+mariadbconnector://h/db"])
def test_other_urls_are_left_as_written(url: str) -> None:
    assert canonical_store_url(url) == url
    assert Settings(store_url=url).store_url == url


def test_a_postgres_url_without_psycopg_says_what_to_install(tmp_path: object) -> None:
    """As if the ``postgres`` extra were not installed: one InvalidConfig line with the
    pip command, not SQLAlchemy's ModuleNotFoundError traceback."""
    code = ("import sys; sys.modules['psycopg'] = None\n"  # `import psycopg` now fails
            "from celery_pulse.errors import InvalidConfig\n"
            "from celery_pulse.store.sql import open_store\n"
            "try:\n"
            "    open_store('postgres://root@127.0.0.1/test')\n"
            "except InvalidConfig as exc:\n"
            "    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ('pulse_store_url: the psycopg driver is not installed: '
                                   'pip install "celery-pulse-leases[postgres]"'), proc.stdout
