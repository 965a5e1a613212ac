"""Rules of the claim contract written once as plain functions, for stores that decide
them in Python (the memory store; a SQL store where a statement cannot say them).

Each mirrors a sentence of :mod:`celery_pulse.store.contracts`; none touches storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from celery_pulse.store.records import (
    FAILED,
    NEEDS_REVIEW,
    OPEN,
    RESERVED,
    RESTARTABLE_STATES,
    RETRY,
    REVOKED,
    RUNNING,
    SUCCEEDED,
    LeaseKey,
    Message,
    Permit,
)

T = TypeVar("T")
K = TypeVar("K")

#: The claim state each completion outcome leaves (a retry re-opens the claim).
OUTCOME_STATE = {SUCCEEDED: SUCCEEDED, FAILED: FAILED, REVOKED: REVOKED, RETRY: OPEN,
                 NEEDS_REVIEW: NEEDS_REVIEW}
#: Which answer of a ``complete`` call wins for a task id completed twice in it.
ANSWER_RANK = {"evidence": 0, "duplicate": 1, "applied": 2}


#: A claim a reservation may take, as data (a SQL store writes it as a ``WHERE`` clause):
#: ``(state, only once its lease expired, the policy it needs)``. Open; or reserved and
#: expired; or an expired run whose policy is ``redispatch``. A live lease is never
#: granted again.
CLAIMABLE: tuple[tuple[str, bool, str | None], ...] = (
    (OPEN, False, None),
    (RESERVED, True, None),
    (RUNNING, True, "redispatch"),
)


def queue_of(message: Message) -> str | None:
    """The queue a claim is listed under: its delivery's routing key (at most 255
    characters, the column's width; None when it has none)."""
    key = message.delivery_info.get("routing_key")
    return key[:255] if isinstance(key, str) and key else None


def claimable(state: str, policy: str, expired: bool) -> bool:
    """:data:`CLAIMABLE` for one claim (``expired``: the store clock's verdict)."""
    return any(state == s and (expired or not expires) and (need is None or policy == need)
               for s, expires, need in CLAIMABLE)


def new_publication(requested: str | None, current: str | None) -> bool:
    """A request of another publication than the claim's (not a redelivery of it)."""
    return requested is not None and requested != current


def grantable(state: str, policy: str, expired: bool, attempts: int, max_attempts: int,
              new_pub: bool) -> bool:
    """Whether a reservation is granted over an existing claim (see ``ClaimStore.reserve``)."""
    return ((new_pub or attempts < max_attempts) and claimable(state, policy, expired)) or (
        new_pub and state in RESTARTABLE_STATES)


def restarts(state: str, new_pub: bool) -> bool:
    """A new publication of a finished task: a new run, which no earlier run's checkpoint
    concerns (a retry, a requeue or a re-dispatch continues the run, and keeps it)."""
    return new_pub and state in RESTARTABLE_STATES


def rounds(items: Iterable[T], key: Callable[[T], K]) -> list[list[T]]:
    """``items`` in rounds of distinct keys, in order: the n-th copy of a key goes in round
    n (a task id twice in one call is decided against the claim as the first left it)."""
    out: list[list[T]] = []
    seen: dict[K, int] = {}
    for item in items:
        k = key(item)
        n = seen.get(k, 0)
        seen[k] = n + 1
        if n == len(out):
            out.append([])
        out[n].append(item)
    return out


def decide_permits(leases: Sequence[LeaseKey], wanted: Mapping[str, Mapping[str, Permit]],
                   used: dict[str, int], live: set[tuple[str, int]]
                   ) -> tuple[list[LeaseKey], list[LeaseKey], list[tuple[str, str, int, bool]]]:
    """In order: each live lease starts if every key it needs has room, else waits.

    ``used`` (holders per key) is counted up as leases are granted. Returns ``(granted,
    waiting, holds)``, holds as ``(key, task_id, epoch, held)``: held for the granted on
    every key, not held for a waiter only on the keys it found full (it is not counted
    on the others).

    A rate permit (``window`` set) counts starts, not holders (``used`` has the starts
    of its window): a granted start holds no row of it (:func:`rate_grants` records the
    start); a waiter is noted like any other.
    """
    granted: list[LeaseKey] = []
    waiting: list[LeaseKey] = []
    holds: list[tuple[str, str, int, bool]] = []
    for lease in leases:
        if (lease[0], lease[1]) not in live:
            continue
        keyed = wanted[lease[0]]
        full = [k for k, p in keyed.items() if used.get(k, 0) >= p.limit]
        if not full:
            for k in keyed:
                used[k] = used.get(k, 0) + 1
            granted.append(lease)
            holds += [(k, lease[0], lease[1], True) for k, p in keyed.items()
                      if p.window is None]
        else:
            waiting.append(lease)
            holds += [(k, lease[0], lease[1], False) for k in full]
    return granted, waiting, holds


def rate_grants(granted: Sequence[LeaseKey], wanted: Mapping[str, Mapping[str, Permit]]
                ) -> list[tuple[str, str, int]]:
    """``(key, task_id, epoch)`` of each rate permit the granted starts took: the starts
    a rate's window counts."""
    return [(key, lease[0], lease[1]) for lease in granted
            for key, permit in wanted[lease[0]].items() if permit.window is not None]


def rate_retry(waiting: Sequence[LeaseKey], wanted: Mapping[str, Mapping[str, Permit]],
               used: Mapping[str, int], oldest: Mapping[str, float]) -> dict[str, float]:
    """For each waiter held back by a rate: seconds until every full rate of its has
    room (``oldest[key]``: its oldest start in the window, relative to now, <= 0; none
    recorded before this call: its starts are now's)."""
    out: dict[str, float] = {}
    for lease in waiting:
        delays = [oldest.get(key, 0.0) + permit.window
                  for key, permit in wanted[lease[0]].items()
                  if permit.window is not None and used.get(key, 0) >= permit.limit]
        if delays:
            out[lease[0]] = max(0.0, max(delays))
    return out


def rate_windows(wanted: Mapping[str, Mapping[str, Permit]]) -> dict[str, float]:
    """The window of every rate permit asked for (the longest, if asked with several)."""
    out: dict[str, float] = {}
    for keyed in wanted.values():
        for key, permit in keyed.items():
            if permit.window is not None:
                out[key] = max(out.get(key, 0.0), permit.window)
    return out


def rate_wants(wanted: Mapping[str, Mapping[str, Permit]]) -> dict[str, int]:
    """How many of a batch's starts ask for each rate key."""
    out: dict[str, int] = {}
    for keyed in wanted.values():
        for key, permit in keyed.items():
            if permit.window is not None:
                out[key] = out.get(key, 0) + 1
    return out


def split_by_permits(permits: Mapping[str, Sequence[Permit]] | None,
                     leases: Sequence[LeaseKey]) -> tuple[list[LeaseKey], list[LeaseKey]]:
    """``(leases that need permits, the others)``."""
    if not permits:
        return [], list(leases)
    return ([lease for lease in leases if permits.get(lease[0])],
            [lease for lease in leases if not permits.get(lease[0])])


def split_starts(permits: Mapping[str, Sequence[Permit]] | None,
                 leases: Sequence[LeaseKey]) -> tuple[list[LeaseKey], list[LeaseKey]]:
    """:func:`split_by_permits` of ``leases`` each once (a start asked twice in a batch
    is one start)."""
    return split_by_permits(permits, list(dict.fromkeys(
        (lease[0], lease[1], lease[2]) for lease in leases)))
