"""Which permits a request needs, and the order in which waiting tasks ask again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_pulse.bootsteps.permits import FIRST_RETRY, MAX_RETRY, PermitRules, PermitWaits
from celery_pulse.errors import InvalidConfig
from celery_pulse.leases import LocalClaim
from celery_pulse.store.base import Permit


def _app() -> Celery:
    return Celery("rules", broker="memory://", set_as_current=False)


def test_option_setting_key_and_queue_make_the_permits() -> None:
    app = _app()

    @app.task(name="t.charge", shared=False, pulse_concurrency=5)
    def charge() -> None: ...

    @app.task(name="t.sync", shared=False, pulse_concurrency=2,
              pulse_concurrency_key=lambda args, kwargs: kwargs["customer"])
    def sync(customer: int) -> None: ...

    @app.task(name="t.free", shared=False)
    def free() -> None: ...

    rules = PermitRules.for_app(app, {"t.charge": 3, "queue:payments": 20})
    assert rules.declared
    # The setting overrides the option; the queue's permit comes on top.
    assert rules.needs(charge, (), {}, "payments") == (
        Permit("task:t.charge", 3), Permit("queue:payments", 20))
    assert rules.needs(sync, (), {"customer": 7}, "celery") == (Permit("task:t.sync[7]", 2),)
    assert rules.needs(free, (), {}, "celery") == ()
    assert rules.limited(free, "payments") and not rules.limited(free, "celery")
    assert rules.limited(sync, None)


def test_a_failing_key_function_falls_back_to_the_whole_kind() -> None:
    app = _app()

    @app.task(name="t.sync", shared=False, pulse_concurrency=1,
              pulse_concurrency_key=lambda a, k: k["x"])
    def sync() -> None: ...

    assert PermitRules.for_app(app, {}).needs(sync, (), {}, None) == (Permit("task:t.sync", 1),)


def test_long_keys_are_shortened_distinctly() -> None:
    app = _app()

    @app.task(name="t.sync", shared=False, pulse_concurrency=1,
              pulse_concurrency_key=lambda a, k: k["x"])
    def sync() -> None: ...

    rules = PermitRules.for_app(app, {})
    one = rules.needs(sync, (), {"x": "a" * 300}, None)[0].key
    two = rules.needs(sync, (), {"x": "a" * 299 + "b"}, None)[0].key
    assert len(one) <= 200 and len(two) <= 200 and one != two


@pytest.mark.parametrize(("options", "setting"), [
    ({"pulse_concurrency": 0}, "pulse_concurrency"),
    ({"pulse_concurrency": "2"}, "pulse_concurrency"),
    ({"pulse_concurrency": 2, "pulse_concurrency_key": "customer"}, "pulse_concurrency_key"),
    ({"pulse_concurrency_key": lambda a, k: 1}, "pulse_concurrency_key"),
])
def test_bad_task_options_fail_naming_them(options: dict[str, Any], setting: str) -> None:
    app = _app()

    def bad() -> None: ...

    app.task(name="t.bad", shared=False, **options)(bad)
    with pytest.raises(InvalidConfig) as info:
        PermitRules.for_app(app, {})
    assert info.value.setting == setting
    assert "t.bad" in str(info.value)


class _Loop:
    """A LoopCaller stand-in: ``later`` only records (the test fires timers itself)."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, Callable[..., Any], tuple[Any, ...]]] = []

    def later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.timers.append((delay, fn, args))

    later_kept = later

    def fire(self) -> float:
        delay, fn, args = self.timers.pop(0)
        fn(*args)
        return delay


def _claim(name: str, *keys: str) -> LocalClaim:
    claim = LocalClaim(name, 1, "tok", 1e9)
    claim.permits = tuple(Permit(k, 1) for k in keys)
    return claim


def _waits() -> tuple[PermitWaits, _Loop, list[str], list[tuple[str, dict[str, Any]]]]:
    loop = _Loop()
    asked: list[str] = []
    events: list[tuple[str, dict[str, Any]]] = []
    now = [0.0]
    waits = PermitWaits(lambda: loop, lambda claim, job: asked.append(claim.task_id),  # type: ignore[arg-type,return-value]
                        lambda event, **fields: events.append((event, fields)), 60.0,
                        monotonic=lambda: now[0])
    return waits, loop, asked, events


def test_waiting_tasks_ask_in_arrival_order_one_at_a_time() -> None:
    waits, _loop, asked, _ = _waits()
    a, b, c = _claim("a", "k"), _claim("b", "k"), _claim("c", "other")
    for claim in (a, b, c):
        waits.settled(claim, None, "waiting")
    assert waits.count == 3 and waits.by_key() == {"k": 2, "other": 1}
    waits.freed({"k"})
    assert asked == ["a"]  # b waits for a's answer
    waits.settled(a, None, "started")  # a permit was free: b asks at once
    assert asked == ["a", "b"] and waits.count == 2
    waits.settled(b, None, "waiting")  # none left: b stays first, backs off
    assert waits.count == 2
    assert waits.groups[("k",)].entries[0][0] is b
    assert waits.groups[("k",)].delay == 2 * FIRST_RETRY


def test_the_retry_backs_off_to_its_cap_and_a_freed_key_resets_it() -> None:
    waits, loop, asked, _ = _waits()
    claim = _claim("a", "k")
    waits.settled(claim, None, "waiting")
    delays = []
    for _ in range(8):
        delays.append(loop.fire())
        waits.settled(claim, None, "waiting")
    assert delays[0] == FIRST_RETRY and delays[-1] == MAX_RETRY
    assert delays == sorted(delays)
    waits.freed({"k"})
    assert waits.groups[("k",)].delay == FIRST_RETRY  # asked at once (in flight now)
    assert asked[-1] == "a"


def test_a_permit_freed_while_a_retry_is_in_flight_is_not_lost() -> None:
    """The retry may have counted the key's holders before the permit came back: its
    "waiting" must not send it to sleep for the backoff (a benchmark saw 40 ms+ hand-overs
    under limit 1)."""
    waits, loop, asked, _ = _waits()
    a = _claim("a", "k")
    waits.settled(a, None, "waiting")
    loop.fire()  # the retry goes out
    assert asked == ["a"]
    waits.freed({"k"})  # ... a permit comes back while it is in flight
    assert asked == ["a"]  # one start in flight per keys
    timers = len(loop.timers)
    waits.settled(a, None, "waiting")  # it looked too early
    assert asked == ["a", "a"], "asks again at once"
    assert len(loop.timers) == timers  # no backoff timer
    waits.settled(a, None, "waiting")  # a real "no room" backs off again
    assert asked == ["a", "a"] and len(loop.timers) == timers + 1


def test_a_task_gone_while_waiting_lets_the_next_one_ask() -> None:
    waits, _loop, asked, _ = _waits()
    a, b = _claim("a", "k"), _claim("b", "k")
    waits.settled(a, None, "waiting")
    waits.settled(b, None, "waiting")
    waits.freed({"k"})
    waits.settled(a, None, "gone")  # lost or revoked meanwhile
    assert asked == ["a", "b"] and waits.count == 1


def test_a_long_wait_sends_one_event() -> None:
    loop = _Loop()
    now = [0.0]
    events: list[tuple[str, dict[str, Any]]] = []
    waits = PermitWaits(lambda: loop, lambda claim, job: None,  # type: ignore[arg-type,return-value]
                        lambda event, **fields: events.append((event, fields)), 60.0,
                        monotonic=lambda: now[0])
    a, b = _claim("a", "k"), _claim("b", "k")
    waits.settled(a, None, "waiting")
    waits.settled(b, None, "waiting")
    now[0] = 59.0
    loop.fire()  # a asks (in flight): nobody has waited a minute yet
    assert events == []
    waits.settled(a, None, "waiting")
    now[0] = 61.0
    loop.fire()
    assert [(e, f["uuid"]) for e, f in events] == [("pulse-permit-wait", "a"),
                                                 ("pulse-permit-wait", "b")]
    waits.settled(a, None, "waiting")
    loop.fire()
    assert len(events) == 2  # once per task


def test_many_waiters_gone_at_once_do_not_recurse() -> None:
    """A reconnect drops every waiter: each resume answers ``gone`` at once and lets the
    next ask, which must run one after another, not nested (a worker hit RecursionError)."""
    loop = _Loop()
    waits: PermitWaits
    asked: list[str] = []

    def resume(claim: LocalClaim, job: Any) -> None:
        asked.append(claim.task_id)
        waits.settled(claim, job, "gone")

    waits = PermitWaits(lambda: loop, resume, lambda *a, **k: None, 60.0)  # type: ignore[arg-type]
    claims = [_claim(f"t{i}", "k") for i in range(3000)]
    for claim in claims:
        waits.settled(claim, None, "waiting")
    waits.freed({"k"})
    assert asked == [c.task_id for c in claims] and waits.count == 0
