"""The fault checker must catch each kind of violation (or the suite proves nothing)."""

from __future__ import annotations

from tests.fault.checker import ClaimState, Event, check


def claim(task_id: str, state: str = "succeeded", policy: str = "redispatch",
          epoch: int = 1) -> ClaimState:
    return ClaimState(task_id, state, epoch, policy)


def test_clean_history_has_no_violation() -> None:
    report = check(["a", "b"], [claim("a"), claim("b", "needs_review", "review")],
                   [Event("start", "a", 1), Event("start", "b", 1)], [("a", 1)])
    assert report.violations == []
    assert (report.succeeded, report.needs_review) == (1, 1)


def test_lost_and_stuck_tasks_are_reported() -> None:
    report = check(["a", "b"], [claim("b", "running")], [], [])
    assert any("a: lost" in v for v in report.violations)
    assert any("b: stuck in running" in v for v in report.violations)


def test_a_task_the_broker_lost_before_delivery_is_counted_apart() -> None:
    """Only the ids the test showed never reached a worker; any other loss still fails,
    and a claimed task named there is judged as usual."""
    report = check(["a", "b", "c"], [claim("c", "running")], [], [],
                   lost_by_broker=["a", "c"])
    assert report.broker_lost == 1
    assert not any("a: lost" in v for v in report.violations)
    assert any("b: lost" in v for v in report.violations)
    assert any("c: stuck in running" in v for v in report.violations)


def test_a_republication_the_broker_lost_is_counted_apart_only_while_open() -> None:
    """Recover's re-publication lost by the broker leaves its claim ``open``: counted
    apart when the test named it; an ``open`` claim it did not name is still stuck."""
    report = check(["a", "b"], [claim("a", "open"), claim("b", "open")], [], [],
                   lost_by_broker=["a"])
    assert report.broker_lost == 1
    assert [v for v in report.violations if "stuck" in v] == ["b: stuck in open (epoch 1)"]


def test_two_effects_are_a_violation() -> None:
    report = check(["a"], [claim("a")], [], [("a", 1), ("a", 2)])
    assert any("2 fenced effects" in v for v in report.violations)


def test_succeeded_without_effect_is_a_violation() -> None:
    assert check(["a"], [claim("a")], [], []).violations


def test_review_task_run_twice_is_a_violation() -> None:
    report = check(["a"], [claim("a", "failed", "review")],
                   [Event("start", "a", 1), Event("start", "a", 3)], [])
    assert any("started 2 times" in v for v in report.violations)


def test_review_task_retrying_itself_is_not_a_violation() -> None:
    report = check(["a"], [claim("a", "succeeded", "review")],
                   [Event("start", "a", 1, 0), Event("start", "a", 2, 1)], [("a", 2)])
    assert report.violations == []


def test_acks_late_task_in_review_is_a_violation() -> None:
    assert check(["a"], [claim("a", "needs_review", "redispatch")], [], []).violations


def test_periodic_slot_fired_twice_is_a_violation() -> None:
    report = check([], [], [Event("tick", "s1", 1), Event("tick", "s1", 2)], [])
    assert any("ran 2 times" in v for v in report.violations)
    assert report.ticks == 2


def test_skipped_slot_is_a_violation_with_catchup_all() -> None:
    slots = [("tick", "10.0"), ("tick", "11.0"), ("tick", "13.0")]
    assert check([], [], [], [], slots, slot_period=1.0).violations
    assert not check([], [], [], [], slots[:2], slot_period=1.0).violations
