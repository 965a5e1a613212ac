"""The ``pulse://`` backend's values in memory: what a fenced completion writes and counts.

The same two rules as the SQL table (:mod:`celery_pulse.store.sql.results`): a live value
in its ``final`` state is never overwritten, and a counter counts each part once, in
task id order within a call. A value past its expiry reads as absent; retention deletes
it. Written only inside a completion that applies (the memory store's lock held).
"""

from __future__ import annotations

from collections.abc import Sequence

from celery_pulse.store.memory.tables import ResultRow, Tables, new_token
from celery_pulse.store.records import ResultRecord


def _live(row: ResultRow | None, now: float) -> bool:
    return row is not None and (row.expires_at is None or row.expires_at > now)


def _until(now: float, seconds: float | None) -> float | None:
    return None if not seconds else now + float(seconds)


def write_fenced(tables: Tables, now: float, records: Sequence[ResultRecord]) -> None:
    """The results of the completions a call applied."""
    for record in sorted(records, key=lambda r: r.key):
        if record.value is None:
            continue
        old = tables.results.get(record.key)
        if _live(old, now) and old is not None and old.state == record.final:
            continue
        tables.results[record.key] = ResultRow(record.value, None, record.state, now,
                                               _until(now, record.expires))


def count_parts(tables: Tables, now: float, parts: Sequence[tuple[str, ResultRecord]]
                ) -> dict[str, tuple[int, str]]:
    """Add one to each applied part's counter: ``task_id -> (count, nonce)``. A counter
    created here, or found expired, starts again with a new nonce."""
    by_key: dict[str, list[tuple[str, ResultRecord]]] = {}
    for task_id, record in parts:
        if record.counter is not None:
            by_key.setdefault(record.counter, []).append((task_id, record))
    out: dict[str, tuple[int, str]] = {}
    for key in sorted(by_key):
        members = sorted(by_key[key], key=lambda part: part[0])
        first = members[0][1]
        row = tables.results.get(key)
        if row is None or not _live(row, now):
            row = ResultRow(first.counter_note, len(members), new_token(), now,
                            _until(now, first.expires))
        else:
            row.counter = (row.counter or 0) + len(members)
            row.value = first.counter_note if row.value is None else row.value
            row.state = new_token() if row.state is None else row.state
            row.updated_at, row.expires_at = now, _until(now, first.expires)
        tables.results[key] = row
        after, nonce = row.counter or 0, str(row.state)
        for offset, (task_id, _) in enumerate(members):
            out[task_id] = (after - len(members) + 1 + offset, nonce)
    return out


def get(tables: Tables, now: float, key: str) -> bytes | None:
    """The live value at ``key`` (None: absent or expired)."""
    row = tables.results.get(key)
    return row.value if row is not None and _live(row, now) else None


def purge_expired(tables: Tables, now: float, limit: int = 500) -> int:
    """Delete up to ``limit`` values past their expiry."""
    expired = [key for key, row in tables.results.items()
               if row.expires_at is not None and row.expires_at < now][:limit]
    for key in expired:
        del tables.results[key]
    return len(expired)
