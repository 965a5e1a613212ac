"""A rate key's upper bound on its recent starts, so that a start far from the limit is
granted without counting the window.

Counting the sliding log reads every start in the window: a rate that never binds
(``"100000/h"`` at 500 starts a second) would read tens of thousands of rows at each
start, and the cost grows with the rate times the window. So each rate key's row of
``pulse_permits`` also keeps two fixed buckets of the window's length: bucket ``b``
holds the starts made at a store time in ``[b * window, (b + 1) * window)``. Any window
``(t - window, t]`` with ``t`` in bucket ``b`` lies inside buckets ``b - 1`` and ``b``,
so their starts bound the window's from above. A batch whose bound plus its own starts
fits under the limit is granted without reading the log; only near the limit is the
window counted exactly (the rule itself is unchanged: :mod:`.sql.rates`), and that count
re-seeds the buckets.

The buckets are trusted only while the row says this code kept them (``bounded_at =
updated_at``): this code's lock leaves ``updated_at`` alone on a rate key's row and sets
both together after the batch, while a worker of the revision before (which knows no
buckets) sets ``updated_at`` at every lock. One such start during a rolling upgrade, a
row created anew, or a changed window makes the next batch count exactly. A start is
recorded at the time its batch decided (bucket ``b``), and counted in bucket ``b`` or a
later one: a bucket that lasts longer only bounds higher.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, slots=True)
class Buckets:
    """A rate key's buckets as its row has them."""

    #: Kept by this code since the row last changed (``bounded_at = updated_at``), for
    #: this window (``bucket_s = window_s``).
    valid: bool
    #: The newer bucket's number (None: never kept).
    number: int | None
    #: Starts in bucket ``number``, and in bucket ``number - 1``.
    starts: int
    previous: int


def bucket_of(now: float, window: float) -> int:
    return math.floor(now / window)


def bound(buckets: Buckets, now: float, window: float) -> int | None:
    """At most how many starts the window ending at ``now`` holds (None: count them)."""
    if not buckets.valid or buckets.number is None:
        return None
    current = bucket_of(now, window)
    if buckets.number > current:  # kept by a transaction whose clock ran ahead: count
        return None
    if buckets.number == current:
        return buckets.starts + buckets.previous
    if buckets.number == current - 1:
        return buckets.starts
    return 0


def skips_count(buckets: Buckets, now: float, window: float, wanted: int,
                limit: int) -> bool:
    """Whether ``wanted`` more starts fit under ``limit`` by the bound alone."""
    most = bound(buckets, now, window)
    return most is not None and most + wanted <= limit


def stale_rows(buckets: Buckets, now: float, window: float) -> bool:
    """Whether the key's starts past the window are deleted in this batch: once per
    bucket (the first batch of a new one), or while the buckets are not trusted. They
    stay up to two windows, never past the next batch of a later bucket."""
    return not buckets.valid or buckets.number is None or (
        buckets.number < bucket_of(now, window))


def after(buckets: Buckets, now: float, window: float, granted: int,
          counted: tuple[int, int, float | None] | None) -> tuple[int, int, int] | None:
    """``(number, starts, previous)`` once ``granted`` starts are recorded at ``now``
    (None: leave the buckets untrusted, to be counted again).

    ``counted``: the window's starts as counted exactly in this batch, those of them in
    the current bucket, and the newest one's time (the buckets are then seeded from the
    count); None: the bound was used, so the buckets were valid and roll forward.
    """
    current = bucket_of(now, window)
    if counted is not None:
        total, newer, newest = counted
        if newest is not None and bucket_of(newest, window) > current:
            return None  # a start recorded ahead of this clock: no bucket to seed
        return current, newer + granted, total - newer
    if buckets.number == current:
        return current, buckets.starts + granted, buckets.previous
    if buckets.number == current - 1:
        return current, granted, buckets.starts
    return current, granted, 0
