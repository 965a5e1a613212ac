"""Store URLs: which schemes the store opens, their one canonical spelling, and how a
URL (or a setting holding one) is shown without its password."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
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
PG_DEFAULT_PORT = "5432"
_QUERY_PASSWORD = re.compile(r"(^|&)(password=)[^&]*")


def default_store_url() -> str:
    """The embedded default: a SQLite file in ``./.celery-pulse/`` (no server needed)."""
    return "sqlite:///" + os.path.abspath(os.path.join(DEFAULT_STORE_DIR, "pulse.sqlite3"))


def canonical_store_url(url: str) -> str:
    """``url`` as the store opens it: a driverless PostgreSQL scheme (``postgres://``,
    ``postgresql://``) becomes ``postgresql+psycopg://``, and libpq's multi-host
    spelling ``user@a:5432,b:5433/db`` (which SQLAlchemy cannot parse) becomes
    ``user@/db?host=a,b&port=5432,5433``; anything else is unchanged. The one place these
    names are mapped, so every consumer compares the same URL."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme.lower().startswith("postgres"):
        return url
    if scheme.lower() in POSTGRES_ALIASES:
        scheme = "postgresql+psycopg"
    return f"{scheme}://{_hosts_to_query(rest)}"


def _hosts_to_query(rest: str) -> str:
    """``rest`` (what follows ``scheme://``) with a comma-separated host list moved from
    the authority to the query's ``host`` and ``port`` lists."""
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    userinfo, at, hostports = netloc.rpartition("@")
    if "," not in hostports:
        return rest
    hosts, ports = [], []
    for entry in hostports.split(","):
        host, port = _split_host(entry)
        hosts.append(host)
        ports.append(port or PG_DEFAULT_PORT)
    path, _, query = rest[len(netloc):].partition("?")
    lists = f"host={','.join(hosts)}&port={','.join(ports)}"
    return f"{userinfo}{at}{path or '/'}?{lists}{'&' + query if query else ''}"


def pg_servers(host: str | None, port: int | None,
               query: Mapping[str, str | tuple[str, ...]]) -> tuple[tuple[str, str], ...]:
    """The (host, port) pairs a PostgreSQL URL names, sorted: one server, or the several
    of a multi-host URL in any of its spellings (``host=a:5432&host=b:5433``,
    ``host=a,b&port=5432,5433``). Two URLs naming the same servers compare equal."""
    listed = query.get("host")
    if listed is None:
        return ((host or "", str(port or PG_DEFAULT_PORT)),)
    entries = [h for item in ((listed,) if isinstance(listed, str) else listed)
               for h in item.split(",")]
    raw_ports = query.get("port") or ""
    ports = ",".join((raw_ports,) if isinstance(raw_ports, str) else raw_ports).split(",")
    pairs = []
    for i, entry in enumerate(entries):
        name, own = _split_host(entry)
        listed_port = ports[i] if i < len(ports) else ports[0] if len(ports) == 1 else ""
        pairs.append((name, own or listed_port or PG_DEFAULT_PORT))
    return tuple(sorted(pairs))


def _split_host(entry: str) -> tuple[str, str]:
    """``host:port`` (SQLAlchemy's spelling in a query), ``[v6]:port``, or a bare host
    (a name, an IPv6 address, a socket directory) with no port."""
    if entry.startswith("["):
        host, _, port = entry[1:].partition("]")
        return host, port.removeprefix(":")
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, port
    return entry, ""


def mask_url(url: str) -> str:
    """``url`` with its password (in the authority or the query) replaced by ``***``
    (safe to log and show)."""
    parts = urlsplit(url)
    if parts.query and "password=" in parts.query:
        parts = parts._replace(query=_QUERY_PASSWORD.sub(r"\1\2***", parts.query))
    if parts.password is None:
        return urlunsplit(parts) if parts.query != urlsplit(url).query else url
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
