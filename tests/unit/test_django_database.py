"""``pulse_database``: a Django ``DATABASES`` entry as the store URL pulse opens
(celery_pulse/contrib/django/database.py). Pure mapping, no Django settings needed; the
real-process side is tests/acceptance/test_django.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_pulse.contrib.django.database import url_of
from celery_pulse.errors import InvalidConfig
from celery_pulse.settings import Settings

PG = {"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app",
      "PASSWORD": "p@ss:word", "HOST": "db.internal", "PORT": "6432"}


def test_a_postgresql_database_is_opened_through_psycopg_3_with_its_options() -> None:
    url = url_of("default", {**PG, "OPTIONS": {
        "options": "-c search_path=tenant", "sslmode": "require", "pool": {"min_size": 2},
        "isolation_level": 2, "server_side_binding": True}})
    assert url == ("postgresql+psycopg://app:p%40ss%3Aword@db.internal:6432/shop"
                   "?options=-c+search_path%3Dtenant&sslmode=require")
    assert Settings(store_url=url).store_url == url  # the store takes it as it is


def test_postgis_a_socket_directory_and_no_password_map_too() -> None:
    url = url_of("geo", {"ENGINE": "django.contrib.gis.db.backends.postgis", "NAME": "geo",
                         "USER": "postgres", "HOST": "/var/run/postgresql", "PORT": "5433"})
    assert url == "postgresql+psycopg://postgres@/geo?host=%2Fvar%2Frun%2Fpostgresql&port=5433"


def test_mysql_goes_through_pymysql_with_its_charset_only() -> None:
    url = url_of("default", {"ENGINE": "django.db.backends.mysql", "NAME": "shop", "USER": "root",
                             "HOST": "127.0.0.1", "PORT": 3306,
                             "OPTIONS": {"charset": "utf8mb4", "init_command": "SET x=1"}})
    assert url == "mysql+pymysql://root@127.0.0.1:3306/shop?charset=utf8mb4"


def test_sqlite_is_its_absolute_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = url_of("default", {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"})
    assert url == f"sqlite:///{tmp_path.resolve() / 'db.sqlite3'}"


def test_djangos_in_memory_test_database_is_opened_in_process() -> None:
    """Django's test runner makes a shared in-memory SQLite database: pulse's engine
    opens the same one in the test process."""
    url = url_of("default", {"ENGINE": "django.db.backends.sqlite3",
                             "NAME": "file:memorydb_default?mode=memory&cache=shared"})
    assert url == "sqlite:///file:memorydb_default?mode=memory&cache=shared&uri=true"


@pytest.mark.parametrize(("database", "said"), [
    ({"ENGINE": "django.db.backends.oracle", "NAME": "x"}, "'django.db.backends.oracle'"),
    ({"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}, "not a SQLite file"),
    ({"ENGINE": "django.db.backends.mysql", "NAME": "x",
      "OPTIONS": {"read_default_file": "/etc/my.cnf"}}, "read_default_file"),
])
def test_what_pulse_cant_open_is_refused_naming_the_setting(database: dict[str, Any],
                                                             said: str) -> None:
    with pytest.raises(InvalidConfig) as refused:
        url_of("default", database)
    assert refused.value.setting == "pulse_database" and said in str(refused.value)


def test_an_explicit_store_url_wins_over_pulse_database() -> None:
    """Resolving the alias would need Django's settings: never asked when the URL is set."""
    settings = Settings.from_conf({"pulse_database": "default",
                                   "pulse_store_url": "sqlite:////tmp/explicit.db"})
    assert settings.store_url == "sqlite:////tmp/explicit.db"
    assert settings.database == "default"


def test_pulse_database_without_djangos_settings_says_so(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A worker started without DJANGO_SETTINGS_MODULE: the setting is named, not
    Django's ImproperlyConfigured."""
    from django.conf import settings

    assert not settings.configured  # Django runs in the tests' subprocesses only
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    with pytest.raises(InvalidConfig) as refused:
        Settings.from_conf({"pulse_database": "default"})
    assert refused.value.setting == "pulse_database"
    assert "DJANGO_SETTINGS_MODULE" in str(refused.value)
