"""Translate driver errors into pulse errors (the only place that does)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy.exc as sa_exc

from celery_pulse.errors import SchemaMissing, StoreUnavailable

_MISSING_MARKERS = ("no such table", "undefinedtable", "does not exist")
#: A store that answers but cannot take writes is as good as down for leases.
_UNWRITABLE_MARKERS = ("read-only", "readonly", "read only", "disk full", "diskfull",
                       "no space left", "database or disk is full", "readonlysqltransaction")


@contextmanager
def translated(where: str) -> Iterator[None]:
    """Re-raise connection failures as StoreUnavailable, missing tables as SchemaMissing."""
    try:
        yield
    except sa_exc.DBAPIError as exc:
        text = f"{type(exc.orig).__name__} {exc.orig}".lower()
        if (any(marker in text for marker in _MISSING_MARKERS) and "relation" in text) or (
                "no such table" in text):
            raise SchemaMissing() from exc
        first_line = (str(exc.orig).strip().splitlines() or [type(exc.orig).__name__])[0]
        if "syntax error" in text or "no such column" in text:
            raise  # SQLite reports these as OperationalError: a bug, not an outage
        if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)) or (
                exc.connection_invalidated) or any(m in text for m in _UNWRITABLE_MARKERS):
            raise StoreUnavailable(f"store unavailable during {where}: {first_line}") from exc
        raise
    except sa_exc.TimeoutError as exc:  # connection pool exhausted / connect timeout
        raise StoreUnavailable(f"store unavailable during {where}: {exc}") from exc
