"""Translate driver errors into pulse errors (the only place that does)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy.exc as sa_exc

from celery_pulse.errors import SchemaMissing, StoreUnavailable

_MISSING_MARKERS = ("no such table", "undefinedtable", "does not exist")


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
        if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)) or (
                exc.connection_invalidated):
            raise StoreUnavailable(f"store unavailable during {where}: "
                                   f"{str(exc.orig).strip().splitlines()[0]}") from exc
        raise
    except sa_exc.TimeoutError as exc:  # connection pool exhausted / connect timeout
        raise StoreUnavailable(f"store unavailable during {where}: {exc}") from exc
