"""Store URLs: which schemes the store opens, their one canonical spelling, and how a
URL (or a setting holding one) is shown without its password."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: URL schemes the SQL store understands (SQLAlchemy dialect+driver names).
STORE_SCHEMES = ("sqlite", "sqlite+pysqlite", "postgres", "postgresql", "postgresql+psycopg",
                 *(f"{family}{driver}" for family in ("mysql", "mariadb")
                   for driver in ("", "+pymysql", "+mysqldb", "+mariadbconnector")))
#: PostgreSQL schemes that name no driver: Django's and Heroku's ``postgres://`` and
#: SQLAlchemy's own ``postgresql://`` (which would pick psycopg2). pulse speaks psycopg 3.
POSTGRES_ALIASES = ("postgres", "postgresql")
DEFAULT_STORE_DIR = ".celery-pulse"


def default_store_url() -> str:
    """The embedded default: a SQLite file in ``./.celery-pulse/`` (no server needed)."""
    return "sqlite:///" + os.path.abspath(os.path.join(DEFAULT_STORE_DIR, "pulse.sqlite3"))


def canonical_store_url(url: str) -> str:
    """``url`` as the store opens it: a driverless PostgreSQL scheme (``postgres://``,
    ``postgresql://``) becomes ``postgresql+psycopg://``; anything else is unchanged.
    The one place these names are mapped, so every consumer compares the same URL."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in POSTGRES_ALIASES:
        return "postgresql+psycopg://" + rest
    return url


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (safe to log and show)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    userinfo = netloc[0].split(":", 1)[0] + ":***"
    return urlunsplit(parts._replace(netloc=userinfo + "@" + netloc[1]))


def masked_value(key: Any, value: Any) -> Any:
    """``value`` of the setting ``key`` as it may be shown to anyone (``celery inspect
    conf``, logs): a pulse setting's URL password masked, everything else as it is."""
    if not (isinstance(key, str) and isinstance(value, str)
            and ("pulse_" in key.lower() or key == "gateway_url")):
        return value
    try:
        return mask_url(value)
    except ValueError:  # not parseable as a URL, yet it might hold one: show nothing
        return "********"
