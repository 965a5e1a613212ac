"""Store URLs: the driverless PostgreSQL forms mean psycopg 3, mapped in one place.

``postgres://`` is what Django's ``DATABASE_URL`` and Heroku hand out; ``postgresql://``
is SQLAlchemy's own form, which would pick psycopg2 (not a pulse dependency).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_pulse.backend import same_store, store_url_for
from celery_pulse.settings import Settings
from celery_pulse.store.sql.fence import identity as fence_identity
from celery_pulse.store_urls import canonical_store_url, mask_url, pg_servers
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


# -- multi-host PostgreSQL URLs (a primary and its standbys) ---------------------------
LIBPQ = "postgresql://u:pw@a.example:5432,b.example:5433/app?target_session_attrs=read-write"
LISTS = ("postgresql+psycopg://u:pw@/app?host=a.example,b.example&port=5432,5433"
         "&target_session_attrs=read-write")
REPEATED = ("postgresql+psycopg://u:pw@/app?host=a.example:5432&host=b.example:5433"
            "&target_session_attrs=read-write")


def test_libpq_host_lists_become_the_query_lists_sqlalchemy_reads() -> None:
    assert canonical_store_url(LIBPQ) == LISTS
    assert Settings(store_url=LIBPQ).store_url == LISTS
    assert canonical_store_url("postgres://u@a,b/app") == (
        "postgresql+psycopg://u@/app?host=a,b&port=5432,5432")
    assert canonical_store_url("postgresql://u@[::1]:5433,b/app") == (
        "postgresql+psycopg://u@/app?host=::1,b&port=5433,5432")


@pytest.mark.parametrize("url", [LIBPQ, LISTS, REPEATED])
def test_every_multi_host_spelling_reaches_both_servers(url: str) -> None:
    """What psycopg is handed: libpq's host and port lists, in order."""
    parsed = make_url(canonical_store_url(url))
    _, kwargs = sa.create_engine(parsed).dialect.create_connect_args(parsed)
    assert (kwargs["host"], kwargs["port"]) == ("a.example,b.example", "5432,5433")
    assert kwargs["target_session_attrs"] == "read-write"
    assert pg_servers(parsed.host, parsed.port, parsed.query) == (
        ("a.example", "5432"), ("b.example", "5433"))


@pytest.mark.parametrize("url", [LIBPQ, LISTS, REPEATED,
                                 REPEATED.replace("&target", "&password=pw&target")])
def test_multi_host_passwords_are_masked(url: str) -> None:
    masked = mask_url(canonical_store_url(url))
    assert "pw" not in masked.replace("u:***", "").replace("password=***", "")
    assert "***" in masked and "a.example" in masked and "b.example" in masked


def test_the_fence_and_the_backend_see_one_database_in_every_spelling() -> None:
    """``lease.fenced(conn)`` takes the application's connection to the store's
    database whichever way its URL lists the servers, and no other database."""
    same = [make_url(canonical_store_url(u)) for u in (LIBPQ, LISTS, REPEATED)]
    assert len({fence_identity(u) for u in same}) == 1
    assert all(same_store(LIBPQ, u) for u in (LISTS, REPEATED))
    other_db = make_url(LISTS.replace("/app?", "/other?"))
    one_host = make_url("postgresql+psycopg://u@a.example:5432/app")
    assert fence_identity(other_db) != fence_identity(same[0])
    assert fence_identity(one_host) != fence_identity(same[0])
    assert not same_store(LIBPQ, LISTS.replace("/app?", "/other?"))
