"""An awaitable under a deadline, at the cost of the interpreter's cheapest way.

``asyncio.wait_for`` wraps what it waits for in a task of its own before Python 3.12: on
the gateway's hot path (a read, a write and a store call for every frame) those tasks
were a twentieth of its CPU. ``asyncio.timeout`` (3.11) waits in place; both raise
``TimeoutError`` and cancel what they wait for.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):
    async def within(work: Awaitable[T], seconds: float) -> T:
        """``work``'s result, or ``TimeoutError`` after ``seconds`` (``work`` cancelled)."""
        async with asyncio.timeout(seconds):
            return await work
else:  # pragma: no cover (3.10)
    async def within(work: Awaitable[T], seconds: float) -> T:
        """``work``'s result, or ``TimeoutError`` after ``seconds`` (``work`` cancelled)."""
        return await asyncio.wait_for(work, seconds)
