"""The tests' one fake clock: it moves only when a test moves it.

Passed as a store clock (``MemoryStore(clock)``), a monotonic clock (``monotonic=``) and
a wall clock (``now=``), alone or all at once, so that a test decides every instant.
"""

from __future__ import annotations


class FakeClock:
    """Seconds as a float; ``now`` may be set, or moved by :meth:`advance`."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
