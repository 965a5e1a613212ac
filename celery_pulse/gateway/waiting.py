"""Deliveries a feeder keeps back, unacknowledged, until their time comes.

Two kinds wait, both as a Celery worker keeps them:

* **An ETA or countdown** (``self.retry()``'s, ``apply_async(countdown=...)``): held in
  memory until due, then reserved like any delivery. A remote worker renews only started
  attempts (seed 003), so a task reserved for it hours early would expire and be
  dispatched again at every lease expiry; Celery's own worker likewise holds such a
  message unacknowledged, raising its prefetch by one for each (kombu's QoS), so the
  held ones never stop the rest.
* **A new publication of a task whose previous attempt is live** (a retry published
  before that attempt's finish applied, ``Task.replace``, an id sent again): the store
  refuses it as taken; it runs once that attempt ends, so it is asked again shortly
  rather than dropped as a duplicate (a direct worker's intake does the same).

Unacknowledged, they stay the broker's: a gateway that dies hands them back.
"""

from __future__ import annotations

import heapq
import itertools
from datetime import datetime, timezone
from typing import Any

from celery_pulse.store.base import Refusal, ReserveRequest

#: Seconds before a new publication refused as taken is asked again.
TAKEN_AGAIN = 0.25


def eta_in(headers: Any, tz: Any, now: datetime | None = None) -> float:
    """Seconds until a delivery's ``eta`` (0 when none, past, or unreadable: Celery's
    worker refuses what it can't read, and runs the rest at once)."""
    value = (headers or {}).get("eta")
    if not value:
        return 0.0
    from celery.utils.time import maybe_iso8601, maybe_make_aware

    try:
        due = maybe_make_aware(maybe_iso8601(value), tz)
    except (AttributeError, ValueError, TypeError):
        return 0.0
    return max(0.0, float((due - (now or datetime.now(timezone.utc))).total_seconds()))


def newer(request: ReserveRequest, refusal: Refusal) -> bool:
    """Whether a delivery refused as taken is a new publication of its task (it runs
    after the live attempt), not a copy of the one that attempt runs (a duplicate)."""
    if refusal.reason != "taken":
        return False
    if request.publication:
        return request.publication != refusal.publication
    return request.retries > refusal.retries


class Waiting:
    """Deliveries held until a monotonic time, earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any, ReserveRequest]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, until: float, message: Any, request: ReserveRequest) -> None:
        heapq.heappush(self._heap, (until, next(self._order), message, request))

    def due(self, now: float) -> list[tuple[Any, ReserveRequest]]:
        """Those whose time has come, in time order (removed)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, _, message, request = heapq.heappop(self._heap)
            out.append((message, request))
        return out

    def wait(self, now: float, longest: float) -> float:
        """How long until the next is due, at most ``longest``."""
        return longest if not self._heap else max(0.0, min(longest, self._heap[0][0] - now))
