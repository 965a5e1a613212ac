"""One connection's operations applied side by side, each attempt's in the order sent.

A worker sends a start, a renewal or a finish for each of its attempts independently: one
waiting on the store must not hold up the others (a connection applied one frame at a
time was one store round trip per frame for every task the worker runs). Two frames
naming the same attempt (or two capacity declarations) are applied in the order they
arrived, as the seed's per-attempt state machine expects. At most ``limit`` operations
of a connection are under way at once: the read loop waits for a place, so a worker
sending faster than the store answers is slowed, not buffered without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class Ordered:
    """Bounded concurrency with per-key order (pure asyncio; knows no protocol)."""

    def __init__(self, limit: int) -> None:
        self._places = asyncio.Semaphore(limit)
        self._last: dict[str, asyncio.Future[None]] = {}
        self._running: set[asyncio.Future[None]] = set()

    async def submit(self, key: str, work: Callable[[], Awaitable[None]]) -> None:
        """Start ``work`` once a place is free, after the previous work of ``key``."""
        await self._places.acquire()
        previous = self._last.get(key)
        task = asyncio.ensure_future(self._after(previous, work))
        self._last[key] = task
        self._running.add(task)

        def done(finished: asyncio.Future[None]) -> None:
            self._running.discard(finished)
            self._places.release()
            if self._last.get(key) is finished:
                del self._last[key]
            if not finished.cancelled():
                finished.exception()  # retrieved: failures are the work's to report

        task.add_done_callback(done)

    @staticmethod
    async def _after(previous: asyncio.Future[None] | None,
                     work: Callable[[], Awaitable[None]]) -> None:
        if previous is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(previous)
        await work()

    async def drain(self) -> None:
        """Wait for the work under way (the connection is over; its answers are moot,
        but what it applies in the store completes)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
