"""The pulse store on a Django database: ``pulse_database = "default"`` (Django settings:
``CELERY_PULSE_DATABASE`` under Celery's ``CELERY`` namespace) makes the store the
database that ``DATABASES`` names, through pulse's own connections.

What Django's settings say is turned into the store URL the rest of pulse reads: the
engine picks the family (PostgreSQL through psycopg 3, MySQL/MariaDB through PyMySQL,
SQLite), then host, port, name, user and password, and the ``OPTIONS`` that name the
connection rather than Django's use of it (a PostgreSQL ``search_path`` in
``options`` comes with them: pulse's tables live in that schema). An explicit
``pulse_store_url`` wins. Django is imported when asked, and only its settings are read
(no ``django.setup()``): a Celery CLI command can resolve it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from celery_pulse.errors import InvalidConfig

#: Django engines by the store family they are.
FAMILIES = {
    "django.db.backends.postgresql": "postgresql+psycopg",
    "django.db.backends.postgresql_psycopg2": "postgresql+psycopg",
    "django.contrib.gis.db.backends.postgis": "postgresql+psycopg",
    "django.db.backends.mysql": "mysql+pymysql",
    "django.contrib.gis.db.backends.mysql": "mysql+pymysql",
    "django.db.backends.sqlite3": "sqlite",
    "django.contrib.gis.db.backends.spatialite": "sqlite",
}
#: PostgreSQL ``OPTIONS`` that are Django's, not the connection's.
DJANGO_ONLY = frozenset({"isolation_level", "server_side_binding", "pool", "assume_role",
                         "cursor_factory", "context"})
#: MySQL ``OPTIONS`` PyMySQL takes in a URL's query.
MYSQL_OPTIONS = frozenset({"charset", "unix_socket", "connect_timeout", "read_timeout",
                           "write_timeout"})

SETTING = "pulse_database"


def store_url(alias: str) -> str:
    """The store URL of the Django database ``alias`` (``InvalidConfig`` naming
    ``pulse_database`` for an alias that doesn't exist or an engine pulse can't use)."""
    try:
        from django.conf import settings
        from django.core.exceptions import ImproperlyConfigured
    except ImportError:
        raise InvalidConfig("pulse_database names a Django database, and Django is not "
                            "installed (pip install 'celery-pulse-leases[django]')",
                            setting=SETTING) from None
    try:
        databases = getattr(settings, "DATABASES", None) or {}
    except ImproperlyConfigured as exc:
        raise InvalidConfig(f"pulse_database: Django's settings are not configured "
                            f"(DJANGO_SETTINGS_MODULE): {exc}", setting=SETTING) from None
    if alias not in databases:
        raise InvalidConfig(f"pulse_database: {alias!r} is not in Django's DATABASES "
                            f"({', '.join(map(repr, databases)) or 'none defined'})",
                            setting=SETTING)
    return url_of(alias, databases[alias])


def url_of(alias: str, database: dict[str, Any]) -> str:
    """``DATABASES[alias]`` as a store URL (see the module's rules)."""
    engine = database.get("ENGINE", "")
    family = FAMILIES.get(engine)
    if family is None:
        raise InvalidConfig(f"pulse_database: DATABASES[{alias!r}] uses {engine!r}, which "
                            f"pulse can't use as its store (PostgreSQL, MySQL/MariaDB or "
                            f"SQLite); set pulse_store_url instead", setting=SETTING)
    options = dict(database.get("OPTIONS") or {})
    name = database.get("NAME")
    if family == "sqlite":
        if str(name).startswith("file:") and "mode=memory" in str(name) \
                and "cache=shared" in str(name):
            # Django's test database: shared in-memory, reachable from this process only
            # (its test runner's eager tasks, the pulse:// backend, migrate).
            return f"sqlite:///{name}&uri=true"
        if not name or str(name) == ":memory:" or str(name).startswith("file:"):
            raise InvalidConfig(f"pulse_database: DATABASES[{alias!r}] is not a SQLite file "
                                f"the worker's processes can share ({name!r})",
                                setting=SETTING)
        return "sqlite:///" + str(Path(name).resolve())
    if family.startswith("mysql"):
        if "read_default_file" in options:
            raise InvalidConfig(f"pulse_database: DATABASES[{alias!r}] reads its connection "
                                "from an option file (read_default_file), which pulse "
                                "doesn't: set pulse_store_url", setting=SETTING)
        query = {k: v for k, v in options.items() if k in MYSQL_OPTIONS}
    else:
        query = {k: v for k, v in options.items()
                 if k not in DJANGO_ONLY and isinstance(v, (str, int, float))
                 and not isinstance(v, bool)}
    user, password = database.get("USER") or "", database.get("PASSWORD") or ""
    userinfo = quote(str(user), safe="")
    if password:
        userinfo += ":" + quote(str(password), safe="")
    host, port = str(database.get("HOST") or ""), str(database.get("PORT") or "")
    if host.startswith("/"):  # a Unix socket directory: libpq's host, in the query
        query.setdefault("unix_socket" if family.startswith("mysql") else "host", host)
        host = ""
    netloc = f"{userinfo}@" if userinfo else ""
    netloc += f"[{host}]" if ":" in host else host
    if port and host:
        netloc += f":{port}"
    elif port:
        query.setdefault("port", port)
    url = f"{family}://{netloc}/{quote(str(name or ''), safe='')}"
    return url + ("?" + urlencode({k: str(v) for k, v in query.items()}) if query else "")
