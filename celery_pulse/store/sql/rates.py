"""Cluster-wide rate limits in SQL (the contract is ``ClaimStore.start_many``, a
:class:`~celery_pulse.store.records.Permit` with a ``window``).

The rule is a sliding log: a start of a rate key is granted only if fewer than ``limit``
of the key's recorded starts are newer than ``now - window``, and each granted start is
recorded (``pulse_rate_starts``) in the same transaction. Starts of one key are
serialised by the key's row of ``pulse_permits`` (locked first, as for concurrency
permits), so no two transactions decide on the same count. The count includes starts
recorded with a later time than this transaction's (a transaction's clock may lag one
that took the lock before it), which is what makes the rule hold for *every* window of
the declared length: of any ``limit + 1`` starts inside one window, the last one granted
saw the other ``limit`` and was refused.

A start counts whatever becomes of its claim (its worker killed at once, a stale
attempt's later finish): nothing deletes a row before its window has passed. Rows older
than their key's window are deleted by the key's next start, and by retention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from celery_pulse.limits import LONGEST_WINDOW
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.tables import rate_starts

#: Rows past their window that retention deletes in one statement.
PURGE_LIMIT = 500


def counted(conn: sa.Connection, dialect: Dialect, windows: Mapping[str, float]
            ) -> tuple[dict[str, int], dict[str, float]]:
    """Each rate key's starts inside its window now (rows past it deleted first), and
    its oldest one's time relative to now (<= 0: when the window next has room)."""
    if not windows:
        return {}, {}
    now = dialect.now()
    for key, window in sorted(windows.items()):
        conn.execute(sa.delete(rate_starts).where(rate_starts.c.key == key,
                                                  rate_starts.c.started_at <= now - window))
    rows = list(conn.execute(sa.select(rate_starts.c.key, sa.func.count(),
                                       sa.func.min(rate_starts.c.started_at) - now)
                             .where(rate_starts.c.key.in_(list(windows)))
                             .group_by(rate_starts.c.key)))
    return ({key: int(count) for key, count, _ in rows},
            {key: min(0.0, float(oldest)) for key, _, oldest in rows})


def started(conn: sa.Connection, dialect: Dialect, windows: Mapping[str, float]
            ) -> dict[str, int]:
    """Each rate key's starts inside its window now (read only: what a page shows)."""
    if not windows:
        return {}
    now = dialect.now()
    rows = conn.execute(sa.select(rate_starts.c.key, sa.func.count()).where(sa.or_(*(
        sa.and_(rate_starts.c.key == key, rate_starts.c.started_at > now - window)
        for key, window in windows.items()))).group_by(rate_starts.c.key))
    return {key: int(count) for key, count in rows}


def record(conn: sa.Connection, dialect: Dialect, grants: Sequence[tuple[str, str, int]]
           ) -> None:
    """The granted starts, at the store's time."""
    if grants:
        started_at = conn.execute(sa.select(dialect.now())).scalar_one()
        conn.execute(sa.insert(rate_starts), [
            {"key": key, "task_id": task_id, "epoch": epoch, "started_at": float(started_at)}
            for key, task_id, epoch in grants])


def purge(conn: sa.Connection, dialect: Dialect, longest: float = LONGEST_WINDOW,
          limit: int = PURGE_LIMIT) -> int:
    """Retention: rows older than ``longest`` seconds (no window is longer)."""
    old = list(conn.execute(sa.select(rate_starts.c.key, rate_starts.c.task_id,
                                      rate_starts.c.epoch)
                            .where(rate_starts.c.started_at <= dialect.now() - longest)
                            .limit(limit)))
    if not old:
        return 0
    return int(conn.execute(sa.delete(rate_starts).where(
        sa.tuple_(rate_starts.c.key, rate_starts.c.task_id, rate_starts.c.epoch).in_(
            [tuple(row) for row in old]))).rowcount)


def pg_sql(now: str) -> dict[str, str]:
    """The same in plain PostgreSQL, for the pipelined start (arrays for any batch)."""
    return {
        "rate_drop": (
            "DELETE FROM pulse_rate_starts r USING unnest(%s::text[], %s::float8[]) "
            f"AS w(key, win) WHERE r.key = w.key AND r.started_at <= {now} - w.win"),
        "rate_count": (
            f"SELECT key, count(*), min(started_at) - {now} FROM pulse_rate_starts "
            "WHERE key = ANY(%s::text[]) GROUP BY key"),
        "rate_record": (
            "INSERT INTO pulse_rate_starts (key, task_id, epoch, started_at) "
            f"SELECT k, t, e, {now} FROM unnest(%s::text[], %s::text[], %s::bigint[]) "
            "AS v(k, t, e)"),
    }


def pg_params(windows: Mapping[str, float]) -> tuple[Any, ...]:
    keys = sorted(windows)
    return keys, [windows[k] for k in keys]
