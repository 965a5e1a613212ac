"""Concurrency permits in memory (the contract is ``ClaimStore.start_many``).

As in SQL (:mod:`celery_pulse.store.sql.permits`), a permit is not a counter: a claim
holds one while it is ``running`` under the epoch whose start took it (a
:class:`~celery_pulse.store.memory.tables.HoldRow` marked held). Whatever moves the claim
on gives the permit back by that alone, and nothing can give one back twice. The
decision itself is :func:`celery_pulse.store.rules.decide_permits`, shared with any store
that decides it in Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from celery_pulse.limits import LONGEST_WINDOW
from celery_pulse.store.memory.tables import HoldRow, PermitRow, Tables
from celery_pulse.store.records import (
    LIVE_STATES,
    RESERVED,
    RUNNING,
    LeaseKey,
    Permit,
    PermitUsage,
    Waiting,
)
from celery_pulse.store.rules import decide_permits, rate_grants, rate_retry, rate_windows


def _claim_state(tables: Tables, task_id: str, hold: HoldRow) -> str | None:
    """The state of the claim a hold belongs to, under the hold's epoch (None: moved on)."""
    row = tables.claims.get(task_id)
    return row.state if row is not None and row.epoch == hold.epoch else None


def holders(tables: Tables, keys: Sequence[str]) -> dict[str, int]:
    """How many running claims hold each key now."""
    counts: dict[str, int] = {}
    for (key, task_id), hold in tables.holds.items():
        if key in keys and hold.held and _claim_state(tables, task_id, hold) == RUNNING:
            counts[key] = counts.get(key, 0) + 1
    return counts


def drop_past(tables: Tables, keys: Sequence[str] | None = None, limit: int = 500) -> int:
    """Forget holds whose claim moved on from the epoch that asked (they hold nothing):
    of ``keys``, only held ones (before a start); else up to ``limit`` of any."""
    past = [(key, task_id) for (key, task_id), hold in tables.holds.items()
            if _claim_state(tables, task_id, hold) not in LIVE_STATES
            and (keys is None or (key in keys and hold.held))]
    if keys is None:
        past = past[:limit]
    for pair in past:
        del tables.holds[pair]
    return len(past)


def rate_counted(tables: Tables, now: float, windows: Mapping[str, float]
                 ) -> tuple[dict[str, int], dict[str, float]]:
    """Each rate key's starts inside its window (older ones forgotten first), and its
    oldest one's time relative to now: the rule of :mod:`celery_pulse.store.sql.rates`."""
    for entry in [e for e, at in tables.rate_starts.items()
                  if e[0] in windows and at <= now - windows[e[0]]]:
        del tables.rate_starts[entry]
    counts: dict[str, int] = {}
    oldest: dict[str, float] = {}
    for (key, _, _), at in tables.rate_starts.items():
        if key in windows:
            counts[key] = counts.get(key, 0) + 1
            oldest[key] = min(oldest.get(key, 0.0), at - now)
    return counts, oldest


def start(tables: Tables, now: float, holder: str, leases: Sequence[LeaseKey], ttl: float,
          needs: Mapping[str, Sequence[Permit]]) -> tuple[dict[str, float], Waiting]:
    """Start the leases that find room under every permit they need, in order:
    ``(task_id -> lease_until, waiting task ids)``."""
    wanted = {lease[0]: {p.key: p for p in needs[lease[0]]} for lease in leases}
    limits = {key: p.limit for keyed in wanted.values() for key, p in keyed.items()}
    windows = rate_windows(wanted)
    for key in sorted(limits):
        tables.permits[key] = PermitRow(limits[key], now, windows.get(key))
    drop_past(tables, [k for k in limits if k not in windows])
    used = holders(tables, [k for k in limits if k not in windows])
    counts, oldest = rate_counted(tables, now, windows)
    used.update(counts)
    live: set[tuple[str, int]] = set()
    for task_id, epoch, token in leases:
        row = tables.claims.get(task_id)
        if (row is not None and row.epoch == epoch and row.token == token
                and row.holder == holder and row.state == RESERVED
                and row.lease_until is not None and row.lease_until > now):
            live.add((task_id, epoch))
    granted, waiting, holds = decide_permits(leases, wanted, used, live)
    started: dict[str, float] = {}
    for task_id, _, _ in granted:
        row = tables.claims[task_id]
        row.state, row.started_at, row.lease_until = RUNNING, now, now + ttl
        started[task_id] = row.lease_until
    for key, task_id, epoch in rate_grants(granted, wanted):
        tables.rate_starts[(key, task_id, epoch)] = now
    if holds:
        moved = {lease[0] for lease in granted + waiting}
        for pair in [pair for pair in tables.holds if pair[1] in moved]:
            del tables.holds[pair]
        for key, task_id, epoch, held in holds:
            tables.holds[(key, task_id)] = HoldRow(epoch, held)
    out = Waiting(*(lease[0] for lease in waiting))
    out.retry_in.update(rate_retry(waiting, wanted, used, oldest))
    return started, out


def usage(tables: Tables, now: float) -> list[PermitUsage]:
    """Every key with its limit, its holders, and the live reservations waiting for it."""
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    oldest: dict[str, float] = {}
    for (key, task_id), hold in tables.holds.items():
        state = _claim_state(tables, task_id, hold)
        if hold.held and state == RUNNING:
            running[key] = running.get(key, 0) + 1
        elif not hold.held and state == RESERVED:
            claim = tables.claims[task_id]
            if claim.lease_until is not None and claim.lease_until > now:
                waiting[key] = waiting.get(key, 0) + 1
                since = claim.reserved_at if claim.reserved_at is not None else claim.created_at
                oldest[key] = min(oldest.get(key, since), since)
    for (key, _, _), at in tables.rate_starts.items():
        row = tables.permits.get(key)
        if row is not None and row.window_s is not None and at > now - row.window_s:
            running[key] = running.get(key, 0) + 1
    return [PermitUsage(key, row.max_running, running.get(key, 0), waiting.get(key, 0),
                        oldest.get(key), row.window_s)
            for key, row in sorted(tables.permits.items())]


def purge(tables: Tables, now: float, older_than: float, limit: int = 500) -> int:
    """Retention: past holds, rate starts past the longest window (an hour), and keys
    nobody asked for in ``older_than`` seconds."""
    dropped = drop_past(tables, None, limit)
    for entry in [e for e, at in tables.rate_starts.items()
                  if at <= now - LONGEST_WINDOW][:limit]:
        del tables.rate_starts[entry]
    asked = {key for key, _ in tables.holds}
    idle = [key for key, row in tables.permits.items()
            if row.updated_at < now - older_than and key not in asked][:limit]
    for key in idle:
        del tables.permits[key]
    return dropped
