"""Making stores for tests, and reading what a store keeps, whichever store it is.

The contract suites speak to a store through its contract only; where a test must look
behind it (the message kept byte-exact, the evidence of a stale completion, the audit of
a review, the beat's slots), these readers answer the same fields from the SQL tables or
from the memory store's (:attr:`celery_pulse.store.memory.MemoryStore.tables`, whose
rows mirror the SQL columns by name).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa

from celery_pulse.store.base import Store
from celery_pulse.store.memory import MemoryStore
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.store.sql.results import ResultRows
from celery_pulse.store.sql.tables import beat_slots, claims, evidence, reviews


def migrated(url: str) -> SqlStore:
    """The SQL store at ``url``, its schema migrated to the head revision."""
    store = open_store(url, check_schema=False)
    store.migrate()
    return store


def url_of(store: SqlStore) -> str:
    """The store's URL with its password, to open another handle on it."""
    return store.engine.url.render_as_string(hide_password=False)


@contextlib.contextmanager
def other_handle(store: Store) -> Iterator[Store]:
    """Another handle on the same store, as another worker has it: on SQL, a store of its
    own (its own connections); in memory, the same object (there is nothing else)."""
    if isinstance(store, SqlStore):
        other = open_store(url_of(store))
        try:
            yield other
        finally:
            other.close()
    else:
        yield store


def claim_row(store: Store, task_id: str) -> Any:
    """The claim's row as the store keeps it (``body``, ``token``, ``headers`` as JSON
    text, ``lease_until``, ``retries``...)."""
    if isinstance(store, MemoryStore):
        return dataclasses.replace(store.tables.claims[task_id])
    assert isinstance(store, SqlStore)
    with store.engine.connect() as conn:
        return conn.execute(sa.select(claims).where(claims.c.task_id == task_id)).one()


def evidence_rows(store: Store, task_id: str) -> list[Any]:
    """The stale completions kept for ``task_id`` (``epoch``, ``holder``, ``outcome``,
    ``error``), in the order recorded."""
    if isinstance(store, MemoryStore):
        return [e for e in store.tables.evidence if e.task_id == task_id]
    assert isinstance(store, SqlStore)
    with store.engine.connect() as conn:
        return list(conn.execute(sa.select(evidence).where(evidence.c.task_id == task_id)
                                 .order_by(evidence.c.id)))


def review_audit(store: Store) -> list[tuple[str, str, str | None, str | None, str]]:
    """``(task_id, action, outcome, note, decided_by)`` of every review decision, in order."""
    if isinstance(store, MemoryStore):
        return [(r.task_id, r.action, r.outcome, r.note, r.decided_by)
                for r in store.tables.reviews]
    assert isinstance(store, SqlStore)
    with store.engine.connect() as conn:
        return [(r.task_id, r.action, r.outcome, r.note, r.decided_by) for r in conn.execute(
            sa.select(reviews.c.task_id, reviews.c.action, reviews.c.outcome, reviews.c.note,
                      reviews.c.decided_by).order_by(reviews.c.id))]


def slot_rows(store: Store) -> list[Any]:
    """Every beat slot recorded (``entry``, ``due_at``, ``leader_epoch``,
    ``published_at``...), by entry and due time."""
    if isinstance(store, MemoryStore):
        return [store.tables.slots[at] for at in sorted(store.tables.slots)]
    assert isinstance(store, SqlStore)
    with store.engine.connect() as conn:
        return list(conn.execute(sa.select(beat_slots).order_by(beat_slots.c.entry,
                                                                beat_slots.c.due_at)))


def change_claim(store: Store, task_id: str, **values: Any) -> int:
    """Change a claim's row behind the store's back (a test staging what no contract
    call can: a corrupted row, a clock that moved past a lease); rows changed."""
    if isinstance(store, MemoryStore):
        row = store.tables.claims.get(task_id)
        if row is None:
            return 0
        for name, value in values.items():
            setattr(row, name, value)
        return 1
    assert isinstance(store, SqlStore)
    with store.engine.begin() as conn:
        return int(conn.execute(sa.update(claims).where(claims.c.task_id == task_id)
                                .values(**values)).rowcount)


def forget_claims(store: Store) -> None:
    """Delete every claim and every piece of evidence (a fresh start on the same store)."""
    if isinstance(store, MemoryStore):
        store.tables.claims.clear()
        store.tables.evidence.clear()
        return
    assert isinstance(store, SqlStore)
    with store.engine.begin() as conn:
        conn.execute(sa.delete(claims))
        conn.execute(sa.delete(evidence))


def evidence_count(store: Store) -> int:
    """How many stale completions the store keeps, of every task."""
    if isinstance(store, MemoryStore):
        return len(store.tables.evidence)
    assert isinstance(store, SqlStore)
    with store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(evidence)).scalar_one())


def all_claim_rows(store: Store) -> list[Any]:
    """Every claim row as the store keeps it, by task id."""
    if isinstance(store, MemoryStore):
        return [dataclasses.replace(store.tables.claims[t]) for t in sorted(store.tables.claims)]
    assert isinstance(store, SqlStore)
    with store.engine.connect() as conn:
        return list(conn.execute(sa.select(claims).order_by(claims.c.task_id)))


def result_value(store: Store, key: str) -> bytes | None:
    """The live value at ``key`` of the ``pulse://`` backend's table (None: absent)."""
    if isinstance(store, MemoryStore):
        row = store.tables.results.get(key)
        live = row is not None and (row.expires_at is None or row.expires_at > store.now())
        return row.value if row is not None and live else None
    assert isinstance(store, SqlStore)
    return ResultRows(store.engine).get(key)
