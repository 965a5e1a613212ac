"""The store's clock as a gateway estimates it between readings.

Every answer carries ``server_time`` (and a renewal its ``lease_until``), the store's
clock. Reading it is a store round trip; a gateway reading it for every frame paid one
more round trip per operation than the operation itself. It is read once a second
instead (the gateway's watch loop) and estimated in between from this host's clock:
the offset measured at the last reading, whose error is at most half the reading's
round trip (plus this host's drift over a second). :meth:`StoreClock.earliest` is the
estimate minus that error: a renewal's ``lease_until`` counted from it is never later
than the store's. Nothing here decides authority: the store's statements do.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Readings older than this are not trusted: the store is read again instead.
STALE_AFTER = 5.0


class StoreClock:
    """The store clock from its last reading (see the module's rules)."""

    def __init__(self, read: Callable[[], float]) -> None:
        self._read = read
        self._offset = 0.0
        self._error = 0.0
        self._at: float | None = None  # monotonic time of the last reading

    def sample(self) -> float:
        """Read the store's clock (blocking: a thread's) and keep the offset."""
        before = time.time()
        now = self._read()
        after = time.time()
        self._offset = now - (before + after) / 2
        self._error = (after - before) / 2
        self._at = time.monotonic()
        return now

    def fresh(self) -> bool:
        return self._at is not None and time.monotonic() - self._at < STALE_AFTER

    def estimate(self) -> float:
        """The store's clock now, as estimated (call only when :meth:`fresh`)."""
        return time.time() + self._offset

    def earliest(self) -> float:
        """No later than the store's clock now."""
        return self.estimate() - self._error
