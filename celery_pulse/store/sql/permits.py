"""Cluster-wide concurrency permits in SQL (the contract is ``ClaimStore.start_many``).

A permit is not a counter: a claim holds one while it is ``running`` under the epoch
that took it (a row of ``pulse_permit_holds``). Every statement that moves a claim on
(a completion, a release, a requeue, Recover's takeover, a new reservation) therefore
gives its permits back by itself, in its own transaction, and nothing can give one back
twice. Taking one locks the key's row of ``pulse_permits`` and counts the key's
holders: starts of one key are serialised across workers, starts of other keys and
every other statement are not.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from celery_pulse.errors import StoreUnavailable
from celery_pulse.store.base import (
    LIVE_STATES,
    RESERVED,
    RUNNING,
    LeaseKey,
    Permit,
    PermitUsage,
    Waiting,
)
from celery_pulse.store.rules import (
    decide_permits,
    rate_grants,
    rate_retry,
    rate_wants,
    rate_windows,
)
from celery_pulse.store.sql import pooler, rates
from celery_pulse.store.sql.claim_rows import CHUNK
from celery_pulse.store.sql.connections import Connections
from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.errors import driver_translated, translated
from celery_pulse.store.sql.tables import claims, permit_holds, permits

#: The claim a hold row belongs to, under the epoch that asked for the permit.
_SAME_ATTEMPT = sa.and_(claims.c.task_id == permit_holds.c.task_id,
                        claims.c.epoch == permit_holds.c.epoch)


def lock_keys(conn: sa.Connection, dialect: Dialect, limits: Mapping[str, int],
              windows: Mapping[str, float] | None = None) -> None:
    """Create or lock each key's row, in key order (two starts never deadlock)."""
    now = dialect.now()
    windows = windows or {}
    for key in sorted(limits):
        # A rate key's updated_at moves with its buckets, after the batch (.rate_bound).
        update = ("max_running", "window_s") if key in windows else (
            "max_running", "updated_at", "window_s")
        conn.execute(dialect.upsert(permits, {"key": key, "max_running": limits[key],
                                              "updated_at": now,
                                              "window_s": windows.get(key)},
                                    [permits.c.key], update))


def holders(conn: sa.Connection, keys: Sequence[str]) -> dict[str, int]:
    """How many running claims hold each key now."""
    rows = conn.execute(
        sa.select(permit_holds.c.key, sa.func.count())
        .select_from(permit_holds.join(claims, _SAME_ATTEMPT))
        .where(permit_holds.c.key.in_(list(keys)), permit_holds.c.held,
               claims.c.state == RUNNING)
        .group_by(permit_holds.c.key))
    return {key: int(count) for key, count in rows}


def drop_past(conn: sa.Connection, keys: Sequence[str] | None = None, limit: int = 500) -> int:
    """Forget rows whose claim moved on from the epoch that asked (they hold nothing)."""
    live = sa.exists().where(_SAME_ATTEMPT, claims.c.state.in_(LIVE_STATES))
    if keys is not None:
        # Before a start (the keys' rows locked by the caller): only held rows, the ones
        # holders() joins; a key's waiters (up to a backlog per worker) are not read for
        # each start, their past rows wait for retention.
        return int(conn.execute(sa.delete(permit_holds).where(
            permit_holds.c.key.in_(list(keys)), permit_holds.c.held, ~live)).rowcount)
    past = list(conn.execute(sa.select(permit_holds.c.key, permit_holds.c.task_id)
                             .where(~live).limit(limit)))
    if not past:
        return 0
    return int(conn.execute(sa.delete(permit_holds).where(
        sa.tuple_(permit_holds.c.key, permit_holds.c.task_id).in_(
            [tuple(row) for row in past]))).rowcount)


def decide(leases: Sequence[LeaseKey], wanted: Mapping[str, Mapping[str, Permit]],
            used: dict[str, int], live: set[tuple[str, int]]
            ) -> tuple[list[LeaseKey], list[LeaseKey], list[dict[str, Any]]]:
    """:func:`~celery_pulse.store.rules.decide_permits`, its holds as rows of
    ``pulse_permit_holds``."""
    granted, waiting, holds = decide_permits(leases, wanted, used, live)
    return granted, waiting, [{"key": key, "task_id": task_id, "epoch": epoch, "held": held}
                              for key, task_id, epoch, held in holds]


def wanted_of(leases: Sequence[LeaseKey], needs: Mapping[str, Sequence[Permit]]
            ) -> tuple[dict[str, dict[str, Permit]], dict[str, int]]:
    wanted = {lease[0]: {p.key: p for p in needs[lease[0]]} for lease in leases}
    return wanted, {key: p.limit for keyed in wanted.values() for key, p in keyed.items()}


def start(conn: sa.Connection, dialect: Dialect, holder: str,
          leases: Sequence[LeaseKey], ttl: float,
          needs: Mapping[str, Sequence[Permit]]) -> tuple[dict[str, float], set[str]]:
    """Start the leases that find room under every permit they need, in order.

    Returns ``(task_id -> lease_until, waiting task ids)``; the leases that are not live
    reservations of ``holder`` are in neither.
    """
    now = dialect.now()
    wanted, limits = wanted_of(leases, needs)
    windows = rate_windows(wanted)
    lock_keys(conn, dialect, limits, windows)
    drop_past(conn, [k for k in limits if k not in windows])
    used = holders(conn, [k for k in limits if k not in windows])
    tally = rates.counted(conn, dialect, windows, rate_wants(wanted))
    used.update(tally.used)
    live = {(task_id, int(epoch)) for task_id, epoch in conn.execute(
        sa.select(claims.c.task_id, claims.c.epoch).where(
            claims.c.task_id.in_(list(wanted)),
            sa.tuple_(claims.c.task_id, claims.c.epoch, claims.c.token).in_(
                [tuple(lease) for lease in leases]),
            claims.c.holder == holder, claims.c.state == RESERVED,
            claims.c.lease_until > now).with_for_update())}
    granted, waiting, rows = decide(leases, wanted, used, live)
    started: dict[str, float] = {}
    if granted:
        ids = [lease[0] for lease in granted]
        # Under a rate, a start is at the time its batch was decided at (the time its
        # window counts it at), its lease from now.
        conn.execute(sa.update(claims).where(claims.c.task_id.in_(ids)).values(
            state=RUNNING, started_at=tally.now if windows else now, lease_until=now + ttl))
        started = {task_id: float(until) for task_id, until in conn.execute(
            sa.select(claims.c.task_id, claims.c.lease_until).where(claims.c.task_id.in_(ids)))}
    rates.record(conn, tally, rate_grants(granted, wanted))
    if rows:
        conn.execute(sa.delete(permit_holds).where(
            permit_holds.c.task_id.in_([lease[0] for lease in granted + waiting])))
        conn.execute(sa.insert(permit_holds), rows)
    return started, waiting_of(waiting, wanted, used, tally.oldest)


def waiting_of(waiting: Sequence[LeaseKey], wanted: Mapping[str, Mapping[str, Permit]],
             used: Mapping[str, int], oldest: Mapping[str, float]) -> Waiting:
    out = Waiting(*(lease[0] for lease in waiting))
    out.retry_in.update(rate_retry(waiting, wanted, used, oldest))
    return out


def usage(conn: sa.Connection, dialect: Dialect) -> list[PermitUsage]:
    """Every key with its limit, its holders, and the live reservations waiting for it
    (the oldest since its reservation)."""
    now = dialect.now()
    counts: dict[tuple[str, str], int] = {}
    oldest: dict[str, float] = {}
    since = sa.func.coalesce(claims.c.reserved_at, claims.c.created_at)
    for key, state, count, first in conn.execute(
            sa.select(permit_holds.c.key, claims.c.state, sa.func.count(), sa.func.min(since))
            .select_from(permit_holds.join(claims, _SAME_ATTEMPT))
            .where(sa.or_(sa.and_(permit_holds.c.held, claims.c.state == RUNNING),
                          sa.and_(~permit_holds.c.held, claims.c.state == RESERVED,
                                  claims.c.lease_until > now)))
            .group_by(permit_holds.c.key, claims.c.state)):
        counts[(key, state)] = int(count)
        if state == RESERVED and first is not None:
            oldest[key] = float(first)
    keys = list(conn.execute(sa.select(permits.c.key, permits.c.max_running, permits.c.window_s)
                             .order_by(permits.c.key)))
    started = rates.started(conn, dialect, {key: float(w) for key, _, w in keys
                                            if w is not None})
    return [PermitUsage(key, int(limit), started.get(key, 0) if window is not None
                        else counts.get((key, RUNNING), 0), counts.get((key, RESERVED), 0),
                        oldest.get(key), None if window is None else float(window))
            for key, limit, window in keys]


def purge(conn: sa.Connection, dialect: Dialect, older_than: float, limit: int = 500) -> int:
    """Retention: past hold rows, rate starts past every window, and keys nobody asked
    for in ``older_than`` seconds."""
    dropped = drop_past(conn, None, limit)
    rates.purge(conn, dialect, limit=limit)
    idle = list(conn.execute(
        sa.select(permits.c.key).where(
            permits.c.updated_at < dialect.now() - older_than,
            ~sa.exists().where(permit_holds.c.key == permits.c.key)).limit(limit)).scalars())
    if idle:
        conn.execute(sa.delete(permits).where(permits.c.key.in_(idle)))
    return dropped


#: Starts one chunk of limited starts in a transaction of its own (a store's own way,
#: such as PostgreSQL's pipeline): ``(holder, leases, ttl, needs) -> (started, waiting)``.
ChunkStarter = Callable[[str, list[LeaseKey], float, Mapping[str, Sequence[Permit]]],
                        tuple[dict[str, float], set[str]]]


def start_limited(conns: Connections, holder: str, leases: list[LeaseKey], ttl: float,
                  needs: Mapping[str, Sequence[Permit]], waiting: set[str] | None,
                  start_chunk: ChunkStarter | None = None) -> dict[str, float]:
    """Starts that need permits: one transaction per chunk, their keys locked (by
    ``start_chunk`` where the store has its own way)."""
    started: dict[str, float] = {}
    for i in range(0, len(leases), CHUNK):
        chunk = leases[i:i + CHUNK]
        if start_chunk is not None:
            moved, wait = start_chunk(holder, chunk, ttl, needs)
        else:
            moved, wait = conns.atomic("start", functools.partial(
                start, dialect=conns.dialect, holder=holder, leases=chunk, ttl=ttl,
                needs=needs))
        started.update(moved)
        if isinstance(waiting, Waiting):
            waiting.add_from(wait)
        elif waiting is not None:
            waiting.update(wait)
    return started


#: The PostgreSQL channel on which workers announce permits given back.
CHANNEL = "pulse_permits"


#: Seconds between two checks that the listening connection's server is still the
#: read-write primary (a demoted primary that stays up keeps its sessions).
PRIMARY_CHECK_S = 5.0


class Signals:
    """PostgreSQL ``LISTEN``/``NOTIFY`` on :data:`CHANNEL`, on one connection of its own.

    Every :data:`PRIMARY_CHECK_S` it asks whether its server still takes writes: after
    a failover the other workers notify on the new primary, so a connection left on the
    old one (now read-only, or a standby) would hear nothing for as long as it lives.
    It raises StoreUnavailable instead, and the caller reconnects (to whichever host
    of a multi-host URL is read-write)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._checked = time.monotonic()

    def _check_primary(self) -> None:
        if time.monotonic() - self._checked < PRIMARY_CHECK_S:
            return
        self._checked = time.monotonic()
        row = self._conn.execute("SELECT pg_is_in_recovery() OR "
                                 "current_setting('transaction_read_only') = 'on'").fetchone()
        if row and row[0]:
            raise StoreUnavailable("permit signals: the server is read-only now (a "
                                   "failover?); listening again on the primary")

    def send(self, keys: Sequence[str]) -> None:
        with driver_translated("permit signal"):
            self._conn.execute("SELECT pg_notify(%s, k) FROM unnest(%s::text[]) AS k",
                               (CHANNEL, list(keys)))

    def receive(self, timeout: float) -> set[str]:
        end = time.monotonic() + max(0.0, timeout)
        keys: set[str] = set()
        with driver_translated("permit signal"):
            self._check_primary()
            while not keys and (left := end - time.monotonic()) > 0:
                keys.update(n.payload for n in self._conn.notifies(timeout=left, stop_after=1))
            # ... and whatever else already arrived
            keys.update(n.payload for n in self._conn.notifies(timeout=0.0))
        return keys


@contextlib.contextmanager
def signals(engine: sa.Engine) -> Iterator[Signals]:
    """A connection LISTENing on :data:`CHANNEL`: a direct one to
    ``pulse_store_listen_url`` when set, else one out of the pool (never back)."""
    with driver_translated("permit signal"):
        direct = pooler.direct_listener(engine, CHANNEL)
    if direct is not None:
        try:
            yield Signals(direct)
        finally:
            direct.close()
        return
    with translated("permit signal"):
        raw = engine.raw_connection()
    conn: Any = raw.driver_connection
    # Out of the pool for good (a dedicated connection, see sizing): it LISTENs for as
    # long as the worker runs, and must not take a pooled connection from the threads.
    raw.detach()
    try:
        with driver_translated("permit signal"):
            conn.autocommit = True
            conn.execute(f"LISTEN {CHANNEL}")
        yield Signals(conn)
    finally:
        with contextlib.suppress(Exception):
            conn.close()
