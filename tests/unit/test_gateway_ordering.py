"""A connection's operations side by side (gateway/ordering.py), and the store clock
between readings (gateway/clock.py): pure asyncio and arithmetic, no I/O."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from celery_pulse.gateway.clock import StoreClock
from celery_pulse.gateway.ordering import Ordered


def test_one_keys_work_runs_in_order_and_other_keys_alongside() -> None:
    async def scenario() -> tuple[list[str], int]:
        ordered = Ordered(limit=8)
        log: list[str] = []
        running = 0
        most = 0

        def work(name: str, delay: float) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                nonlocal running, most
                running += 1
                most = max(most, running)
                log.append(f"{name}+")
                await asyncio.sleep(delay)
                log.append(f"{name}-")
                running -= 1
            return run

        await ordered.submit("a", work("a1", 0.05))
        await ordered.submit("a", work("a2", 0.0))
        await ordered.submit("b", work("b1", 0.01))
        await ordered.drain()
        await asyncio.sleep(0)
        return log, most

    log, most = asyncio.run(scenario())
    # a2 starts only after a1 ended; b1 ran while a1 was under way.
    assert log.index("a2+") > log.index("a1-")
    assert log.index("b1+") < log.index("a1-")
    assert most == 2


def test_the_limit_bounds_work_under_way_and_the_submitter_waits() -> None:
    async def scenario() -> int:
        ordered = Ordered(limit=2)
        running = most = 0
        gate = asyncio.Event()

        async def work() -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            await gate.wait()
            running -= 1

        for i in range(2):
            await ordered.submit(f"k{i}", work)
        third = asyncio.ensure_future(ordered.submit("k2", work))
        await asyncio.sleep(0.01)
        assert not third.done()  # no place: the read loop waits here
        gate.set()
        await third
        await ordered.drain()
        return most

    assert asyncio.run(scenario()) == 2


def test_a_failed_work_does_not_stop_the_next_of_its_key() -> None:
    async def scenario() -> list[str]:
        ordered = Ordered(limit=4)
        done: list[str] = []

        async def fails() -> None:
            raise RuntimeError("boom")

        async def runs() -> None:
            done.append("next")

        await ordered.submit("a", fails)
        await ordered.submit("a", runs)
        await ordered.drain()
        return done

    assert asyncio.run(scenario()) == ["next"]


def test_the_store_clock_is_estimated_from_its_last_reading() -> None:
    offset = 1000.0
    clock = StoreClock(lambda: time.time() + offset)
    assert not clock.fresh()
    now = clock.sample()
    assert clock.fresh()
    assert clock.estimate() == pytest.approx(time.time() + offset, abs=0.05)
    assert clock.earliest() <= clock.estimate()
    assert now == pytest.approx(time.time() + offset, abs=0.05)
