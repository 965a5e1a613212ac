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
than their key's window are deleted by the key's first start in each new bucket, and by
retention.

Far from the limit the window is not counted at all: the key's row keeps an upper bound
(:mod:`celery_pulse.store.rate_bound`), and a batch that fits under it is granted on
the bound. Each batch is decided at one reading of the store's clock (``now``): its
window, its bucket and the time its starts are recorded at.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from celery_pulse.limits import LONGEST_WINDOW
from celery_pulse.store.rate_bound import (
    Buckets,
    after,
    bound,
    bucket_of,
    skips_count,
    stale_rows,
)
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.tables import permits, rate_starts

#: Rows past their window that retention deletes in one statement.
PURGE_LIMIT = 500


@dataclasses.dataclass
class Tally:
    """A batch's rate keys as decided at the store's ``now``: the starts each window holds
    (counted, or bounded), the oldest counted one's age, and what re-seeds the buckets."""

    now: float
    windows: Mapping[str, float]
    used: dict[str, int]
    oldest: dict[str, float]
    buckets: dict[str, Buckets]
    #: Keys counted exactly: (the window's starts, those in the current bucket, newest).
    counted: dict[str, tuple[int, int, float | None]]

    def take_bound(self, key: str, buckets: Buckets, window: float, limit: int) -> None:
        """The key's window as its buckets bound it (the batch fits under ``limit``).
        Were the store's SQL and this ever to disagree that it does, the key counts as
        full and its waiters ask again at once, to be counted."""
        most = bound(buckets, self.now, window)
        self.used[key] = limit if most is None else most
        if most is None:
            self.oldest[key] = -window

    def take_count(self, key: str, total: int, newer: int | None, first: float | None,
                   last: float | None) -> None:
        """The key's window as counted exactly: its starts, those in the current bucket,
        and its oldest and newest start's times."""
        self.used[key] = int(total)
        self.counted[key] = (int(total), int(newer or 0), None if last is None else float(last))
        if first is not None:
            self.oldest[key] = min(0.0, float(first) - self.now)


def buckets_of(valid: Any, number: Any, starts: Any, previous: Any) -> Buckets:
    return Buckets(bool(valid), None if number is None else int(number), int(starts or 0),
                   int(previous or 0))


def counted(conn: sa.Connection, dialect: Dialect, windows: Mapping[str, float],
            wanted: Mapping[str, int]) -> Tally:
    """Each rate key's starts inside its window now (its rows locked by the caller):
    bounded by its buckets where ``wanted`` more fit under the limit, else counted (rows
    past the window deleted first, once per bucket)."""
    tally = Tally(0.0, windows, {}, {}, {}, {})
    if not windows:
        return tally
    tally.now = now = float(conn.execute(sa.select(dialect.now())).scalar_one())
    rows = {row[0]: row[1:] for row in conn.execute(sa.select(
        permits.c.key, permits.c.max_running, permits.c.bounded_at, permits.c.updated_at,
        permits.c.bucket_s, permits.c.bucket_no, permits.c.bucket_starts,
        permits.c.prev_starts).where(permits.c.key.in_(list(windows))))}
    for key, window in sorted(windows.items()):
        limit, bounded_at, updated_at, bucket_s, number, starts, previous = rows[key]
        valid = bounded_at is not None and bounded_at == updated_at and bucket_s == window
        buckets = tally.buckets[key] = buckets_of(valid, number, starts, previous)
        if stale_rows(buckets, now, window):
            conn.execute(sa.delete(rate_starts).where(rate_starts.c.key == key,
                                                      rate_starts.c.started_at <= now - window))
        if skips_count(buckets, now, window, wanted.get(key, 0), int(limit)):
            tally.take_bound(key, buckets, window, int(limit))
            continue
        newer = sa.case((rate_starts.c.started_at >= bucket_of(now, window) * window, 1),
                        else_=0)
        tally.take_count(key, *conn.execute(
            sa.select(sa.func.count(), sa.func.sum(newer), sa.func.min(rate_starts.c.started_at),
                      sa.func.max(rate_starts.c.started_at))
            .where(rate_starts.c.key == key, rate_starts.c.started_at > now - window)).one())
    return tally


def record(conn: sa.Connection, tally: Tally, grants: Sequence[tuple[str, str, int]]
           ) -> None:
    """The granted starts, at the batch's time, and each key's buckets after them."""
    if grants:
        conn.execute(sa.insert(rate_starts), [
            {"key": key, "task_id": task_id, "epoch": epoch, "started_at": tally.now}
            for key, task_id, epoch in grants])
    for key, values in bounds_after(tally, grants).items():
        conn.execute(sa.update(permits).where(permits.c.key == key).values(**values))


def bounds_after(tally: Tally, grants: Sequence[tuple[str, str, int]]
                 ) -> dict[str, dict[str, Any]]:
    """Each rate key's row after the batch: asked for now, its buckets kept (or left
    untrusted)."""
    granted = collections.Counter(key for key, _, _ in grants)
    out: dict[str, dict[str, Any]] = {}
    for key, window in tally.windows.items():
        kept = after(tally.buckets[key], tally.now, window, granted[key],
                     tally.counted.get(key))
        number, starts, previous = kept or (None, 0, 0)
        out[key] = {"updated_at": tally.now, "bounded_at": None if kept is None else tally.now,
                    "bucket_s": window, "bucket_no": number, "bucket_starts": starts,
                    "prev_starts": previous}
    return out


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
    """The same in plain PostgreSQL, for the pipelined start (arrays for any batch).

    ``rate_count`` reads the clock once (``n.t``, a materialized CTE) and gives each
    key's buckets; it counts the window only where they can't tell (``NOT s.skip``: a
    one-time filter, no scan).
    ``rate_drop`` deletes past rows only where :func:`.rate_bound.stale_rows` says so.
    """
    valid = "p.bounded_at = p.updated_at AND p.bucket_s = w.win"
    return {
        # The keys to tidy first, at a clock read once: the rows past the window are then
        # an index range of each (the clock itself is volatile: no index condition).
        "rate_drop": (
            f"WITH n(t) AS MATERIALIZED (SELECT {now}), d(key, cut) AS MATERIALIZED ("
            "SELECT w.key, n.t - w.win FROM unnest(%s::text[], %s::float8[]) AS w(key, win) "
            "CROSS JOIN n JOIN pulse_permits p ON p.key = w.key "
            f"WHERE NOT coalesce({valid} AND p.bucket_no >= floor(n.t / w.win), false)) "
            "DELETE FROM pulse_rate_starts r USING d "
            "WHERE r.key = d.key AND r.started_at <= d.cut"),
        "rate_count": (
            f"WITH n(t) AS MATERIALIZED (SELECT {now}) "
            f"SELECT w.key, n.t, p.max_running, coalesce({valid}, false), p.bucket_no, "
            "p.bucket_starts, p.prev_starts, s.skip, c.total, c.newer, c.first, c.last "
            "FROM unnest(%s::text[], %s::float8[], %s::int[]) AS w(key, win, want) "
            "CROSS JOIN n JOIN pulse_permits p ON p.key = w.key "
            "CROSS JOIN LATERAL (SELECT floor(n.t / w.win)) AS k(b) "
            f"CROSS JOIN LATERAL (SELECT coalesce({valid} AND p.bucket_no <= k.b AND "
            "CASE WHEN p.bucket_no = k.b THEN p.bucket_starts + p.prev_starts "
            "WHEN p.bucket_no = k.b - 1 THEN p.bucket_starts ELSE 0 END + w.want "
            "<= p.max_running, false)) AS s(skip) "
            "CROSS JOIN LATERAL (SELECT count(*), count(*) FILTER (WHERE "
            "r.started_at >= k.b * w.win), min(r.started_at), max(r.started_at) "
            "FROM pulse_rate_starts r WHERE NOT s.skip AND r.key = w.key "
            "AND r.started_at > n.t - w.win) AS c(total, newer, first, last)"),
        "rate_record": (
            "INSERT INTO pulse_rate_starts (key, task_id, epoch, started_at) "
            "SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::float8[])"),
        "rate_bound": (
            "UPDATE pulse_permits p SET updated_at = v.at, bounded_at = v.bounded, "
            "bucket_s = v.win, bucket_no = v.no, bucket_starts = v.cur, prev_starts = v.prev "
            "FROM unnest(%s::text[], %s::float8[], %s::float8[], %s::float8[], %s::bigint[], "
            "%s::int[], %s::int[]) AS v(key, at, bounded, win, no, cur, prev) "
            "WHERE p.key = v.key"),
    }


def pg_params(windows: Mapping[str, float]) -> tuple[Any, ...]:
    keys = sorted(windows)
    return keys, [windows[k] for k in keys]


def pg_count_params(windows: Mapping[str, float], wanted: Mapping[str, int]
                    ) -> tuple[Any, ...]:
    return (*pg_params(windows), [wanted.get(k, 0) for k in sorted(windows)])


def pg_tally(rows: Sequence[Sequence[Any]], windows: Mapping[str, float],
             wanted: Mapping[str, int]) -> Tally:
    """:func:`counted`'s answer from ``rate_count``'s rows."""
    tally = Tally(0.0, windows, {}, {}, {}, {})
    for (key, now, limit, valid, number, starts, previous, skip, total, newer, first,
         last) in rows:
        tally.now = float(now)
        buckets = tally.buckets[key] = buckets_of(valid, number, starts, previous)
        if skip:  # the store found room by the bound: taken again here, same row and clock
            tally.take_bound(key, buckets, windows[key], int(limit))
        else:
            tally.take_count(key, total, newer, first, last)
    return tally


def pg_record_params(tally: Tally, grants: Sequence[tuple[str, str, int]]
                     ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``rate_record``'s and ``rate_bound``'s parameters."""
    rows = bounds_after(tally, grants)
    keys = sorted(rows)

    def column(name: str) -> list[Any]:
        return [rows[k][name] for k in keys]
    return (([g[0] for g in grants], [g[1] for g in grants], [g[2] for g in grants],
             [tally.now] * len(grants)),
            (keys, column("updated_at"), column("bounded_at"), column("bucket_s"),
             column("bucket_no"), column("bucket_starts"), column("prev_starts")))
