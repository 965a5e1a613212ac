"""A rate key's bucket bound (:mod:`celery_pulse.store.rate_bound`), against a model of
the store's log: whatever the batches, their times and an older worker's starts
between them, the bound is never below the starts in the window it stands for, and a
rate granted on it never passes its limit in any window."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_pulse.store.rate_bound import (
    Buckets,
    after,
    bound,
    bucket_of,
    skips_count,
    stale_rows,
)

#: One batch: (seconds since the last, starts asked, started by a worker of the
#: revision before: counts exactly and leaves the buckets untrusted).
BATCHES = st.lists(st.tuples(st.floats(0.0, 2.5, allow_nan=False), st.integers(1, 6),
                             st.booleans()), min_size=1, max_size=80)
NEVER = Buckets(False, None, 0, 0)


def in_window(log: list[float], now: float, window: float) -> list[float]:
    return [t for t in log if now - window < t <= now]


@settings(max_examples=300, deadline=None)
@given(batches=BATCHES, window=st.sampled_from([0.5, 1.0, 0.3, 7.0]),
       limit=st.integers(1, 12), start=st.floats(1.7e9, 1.8e9, allow_nan=False))
def test_rate_bound_never_below_the_window_and_the_limit_holds(
        batches: list[tuple[float, int, bool]], window: float, limit: int,
        start: float) -> None:
    log: list[float] = []
    row, now = NEVER, start
    for gap, wanted, older in batches:
        now += gap
        seen = in_window(log, now, window)
        most = bound(row, now, window)
        assert most is None or most >= len(seen), (most, len(seen))
        if older:  # its own exact count; its start moves updated_at: untrusted
            log += [now] * max(0, min(wanted, limit - len(seen)))
            row = NEVER
            continue
        if stale_rows(row, now, window):
            log = [t for t in log if t > now - window]
        counted = None
        if skips_count(row, now, window, wanted, limit):
            used = most or 0
        else:
            newer = [t for t in seen if bucket_of(t, window) >= bucket_of(now, window)]
            counted = (len(seen), len(newer), max(seen, default=None))
            used = len(seen)
        granted = max(0, min(wanted, limit - used))
        log += [now] * granted
        kept = after(row, now, window, granted, counted)
        row = NEVER if kept is None else Buckets(True, *kept)
    for t in log:
        assert len(in_window(log, t, window)) <= limit


def test_rate_bound_rolls_two_buckets_and_forgets_older_ones() -> None:
    row = Buckets(True, 10, 4, 3)  # bucket 10 of 1 s: 4 starts, bucket 9: 3
    assert bound(row, 10.5, 1.0) == 7
    assert bound(row, 11.2, 1.0) == 4  # bucket 9 fell out of every window ending in 11
    assert bound(row, 12.0, 1.0) == 0
    assert bound(row, 9.9, 1.0) is None  # kept by a clock ahead of this one: count
    assert after(row, 11.2, 1.0, 2, None) == (11, 2, 4)
    assert after(row, 10.5, 1.0, 2, None) == (10, 6, 3)
    # Seeded from a count: 5 in the window, 2 of them in the current bucket.
    assert after(NEVER, 10.5, 1.0, 1, (5, 2, 10.4)) == (10, 3, 3)
    assert after(NEVER, 10.5, 1.0, 1, (5, 2, 11.1)) is None  # a start recorded ahead
    assert not skips_count(row, 10.5, 1.0, 4, 10) and skips_count(row, 10.5, 1.0, 3, 10)
