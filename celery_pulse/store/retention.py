"""Retention's pass, the same on every store: batches until none comes back full.

A store deletes past-retention rows (finished claims, old evidence, past permit holds,
expired results) at most ``limit`` of each kind per batch, each batch in short
transactions of their own, so no lock is held for long. One batch a minute would cap
retention at ``limit`` rows a minute (8.3 tasks/s at 500): a pass repeats batches while
one came back full, within a time budget so the thread that purges (Recover's) keeps
its other work; a pass cut by its budget goes on at the next one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: One batch's result: finished claims deleted, and whether any kind filled its limit
#: (more may be waiting).
Batch = tuple[int, bool]


def drain(batch: Callable[[], Batch], budget: float | None,
          monotonic: Callable[[], float] = time.monotonic) -> int:
    """Run ``batch`` while it comes back full, until ``budget`` seconds are spent (None:
    no budget; 0: one batch). The finished claims deleted."""
    began = monotonic()
    total = 0
    while True:
        claims, full = batch()
        total += claims
        if not full or (budget is not None and monotonic() - began >= budget):
            return total
