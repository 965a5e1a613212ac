"""LoopCaller: callables run on the hub in order, and a drain the hub lost is replaced."""

from __future__ import annotations

from typing import Any

from celery_pulse.bootsteps.loop import STALE, LoopCaller
from tests.helpers.clock import FakeClock


class Hub:
    """The part of kombu's hub LoopCaller uses; ``lose()`` drops what it holds, as kombu
    does with the rest of a loop turn's callbacks when one of them raises."""

    def __init__(self) -> None:
        self.ready: list[Any] = []

    def call_soon(self, fn: Any) -> None:
        self.ready.append(fn)

    def run(self) -> None:
        ready, self.ready = self.ready, []
        for fn in ready:
            fn()

    def lose(self) -> None:
        self.ready = []


def test_calls_run_on_the_hub_in_order_with_one_drain() -> None:
    hub, seen = Hub(), []
    caller = LoopCaller(hub, FakeClock(100.0))
    for i in range(3):
        caller.call(seen.append, i)
    assert seen == [] and len(hub.ready) == 1
    hub.run()
    assert seen == [0, 1, 2]


def test_a_drain_the_hub_lost_is_scheduled_again_once_stale() -> None:
    hub, clock, seen = Hub(), FakeClock(100.0), []
    caller = LoopCaller(hub, clock)
    caller.call(seen.append, 1)
    hub.lose()  # a broker error in the same loop turn
    caller.call(seen.append, 2)
    hub.run()
    assert seen == []  # still presumed scheduled: no drain per call
    clock.now += STALE
    caller.call(seen.append, 3)
    hub.run()
    assert seen == [1, 2, 3]


def test_rearm_after_a_reconnect_runs_what_was_queued() -> None:
    hub, seen = Hub(), []
    caller = LoopCaller(hub, FakeClock(100.0))
    caller.call(seen.append, 1)
    hub.lose()
    caller.rearm()
    hub.run()
    assert seen == [1]
    caller.call(seen.append, 2)  # and the next call schedules normally
    hub.run()
    assert seen == [1, 2]


def test_without_a_hub_calls_run_inline() -> None:
    seen: list[int] = []
    LoopCaller(None).call(seen.append, 1)
    assert seen == [1]


class TimerHub(Hub):
    """... with kombu's timers: ``call_later`` entries the test fires, and ``clear()``
    as Celery before 5.6 does to the hub's timer on a broker reconnect."""

    def __init__(self) -> None:
        super().__init__()
        self.timers: list[tuple[float, Any, tuple[Any, ...]]] = []

    def call_later(self, delay: float, fn: Any, *args: Any) -> None:
        self.timers.append((delay, fn, args))

    def fire_all(self) -> None:
        timers, self.timers = self.timers, []
        for _delay, fn, args in timers:
            fn(*args)


def test_a_kept_timer_cleared_by_a_reconnect_runs_once_after_rearm() -> None:
    hub, clock, seen = TimerHub(), FakeClock(100.0), []
    caller = LoopCaller(hub, clock)
    caller.later_kept(1.0, seen.append, "retry")
    caller.later(1.0, seen.append, "plain")
    hub.run()  # the call_later calls reach the hub
    assert len(hub.timers) == 2
    hub.timers.clear()  # the reconnect
    clock.now += 0.4
    caller.rearm()
    hub.run()
    assert [round(delay, 6) for delay, _, _ in hub.timers] == [0.6], "the kept one, as due"
    hub.fire_all()
    assert seen == ["retry"]


def test_a_kept_timer_that_survived_the_reconnect_still_runs_once() -> None:
    hub, clock, seen = TimerHub(), FakeClock(100.0), []
    caller = LoopCaller(hub, clock)
    caller.later_kept(1.0, seen.append, "retry")
    hub.run()
    caller.rearm()  # Celery 5.6+ keeps the hub's timers: now it is scheduled twice
    hub.run()
    assert len(hub.timers) == 2
    hub.fire_all()
    assert seen == ["retry"]
    caller.rearm()  # nothing left to schedule again
    hub.run()
    assert hub.timers == []

