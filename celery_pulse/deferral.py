"""An attempt's outcome kept for its fenced completion, and which completions can carry it.

Celery-free (no Celery, no kombu; SQLAlchemy only to compare URLs, imported when asked),
so the three places that decide it share one reading without importing Celery through
the result backend: :mod:`celery_pulse.backend` (``pulse://``, which defers a write
while :func:`deferred_result` is open), a ``-P pulse`` pool child, and the gateway
server, which settles a remote worker's finish with its result in one transaction.
``celery_pulse.backend`` still exports every name here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery_pulse.store.base import ResultRecord
from celery_pulse.store_urls import canonical_store_url, pg_servers

#: The states a pool child hands to its parent instead of writing them: those that end
#: an attempt. ``STARTED`` (``task_track_started``) is written at once, to be seen while
#: the task runs. Celery's ``READY_STATES`` and ``RETRY``, spelled out here so that
#: knowing them needs no Celery (:mod:`celery_pulse.backend` checks they agree).
DEFERRED_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED", "RETRY"})


class Deferral(threading.local):
    """The outcome of the attempt :func:`deferred_result` is open around, per thread."""

    task_id: str | None = None
    record: ResultRecord | None = None
    #: The chord part's request (``id``, ``group``, ``chord``) when the task is one.
    chord: dict[str, Any] | None = None
    #: Messages the attempt published that its completion carries, for the one that
    #: applies it to publish first (a gateway worker's: it has no broker of its own).
    published: list[dict[str, Any]] | None = None


#: The one deferral (thread-local): written by the backend, read by the completion.
deferral = Deferral()


@contextmanager
def deferred_result(task_id: str) -> Iterator[Deferral]:
    """In a ``-P pulse`` pool child, around one attempt of ``task_id``: its outcome is not
    written but kept in ``.record`` (and a chord part's request in ``.chord``), for the
    parent's fenced completion to write and count (in the completion's transaction, only
    if the attempt still holds its lease). No SQL in the child.
    """
    deferral.task_id, deferral.record, deferral.chord = task_id, None, None
    deferral.published = None
    try:
        yield deferral
    finally:
        deferral.task_id = None


def keep_published(message: dict[str, Any]) -> bool:
    """Keep a message the attempt published for its completion to carry; False if no
    attempt is open in this thread (the publisher must refuse it instead)."""
    if deferral.task_id is None:
        return False
    if deferral.published is None:
        deferral.published = []
    deferral.published.append(message)
    return True


#: Query parameters of a PostgreSQL URL that say which server to reach, not which data.
_SERVER_CHOICE = ("host", "port", "target_session_attrs", "load_balance_hosts")


def same_store(a: Any, b: Any) -> bool:
    """Whether two store URLs (strings or SQLAlchemy URLs) name one database: a
    completion in one can carry a result for the other. The driver and the password
    don't matter; the query does (a PostgreSQL ``search_path`` is another schema)."""
    from sqlalchemy.engine import make_url

    def key(url: Any) -> tuple[Any, ...]:
        parsed = make_url(canonical_store_url(url) if isinstance(url, str) else url)
        database = parsed.database
        if parsed.get_backend_name() == "sqlite" and database and database != ":memory:":
            database = os.path.realpath(database)
        servers: Any = (parsed.host, parsed.port)
        query = dict(parsed.query)
        if parsed.get_backend_name() == "postgresql":  # a multi-host URL in any spelling
            servers = pg_servers(parsed.host, parsed.port, parsed.query)
            for name in _SERVER_CHOICE:
                query.pop(name, None)
        return (parsed.get_backend_name(), parsed.username, servers, database,
                sorted(query.items()))

    return key(a) == key(b)


class StoreResults:
    """A result backend that keeps its results in the pulse store at ``store_url``
    (:class:`celery_pulse.backend.PulseBackend` is the one): what
    :func:`carried_by_completions` recognises without importing it."""

    store_url: str


def carried_by_completions(backend: Any, store_url: Any) -> bool:
    """Whether ``backend`` keeps its results in the store at ``store_url`` (``pulse://``
    or ``pulse+`` that store): then a fenced completion there writes them. A
    ``pulse+<url>`` backend on a store of its own is written as any backend is."""
    return isinstance(backend, StoreResults) and same_store(backend.store_url, store_url)
