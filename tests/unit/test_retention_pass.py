"""Retention's pass (issue 35): batches while one comes back full, within a time budget,
and Recover going on with a pass cut short at its next turn (a fake monotonic clock)."""

from __future__ import annotations

from celery_pulse.recover import PURGE_BUDGET, RATE_WINDOW, Recoverer
from celery_pulse.store.memory import MemoryStore
from celery_pulse.store.retention import drain


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_pass_repeats_full_batches_until_one_comes_back_short() -> None:
    batches = iter([(500, True), (500, True), (120, False), (999, True)])
    assert drain(lambda: next(batches), None) == 1120


def test_a_pass_stops_at_its_budget_and_a_zero_budget_is_one_batch() -> None:
    clock = Clock()

    def batch() -> tuple[int, bool]:
        clock.t += 0.4
        return 500, True
    assert drain(batch, 1.0, clock) == 1500  # 0.4, 0.8, 1.2 s: over budget after three
    assert drain(batch, 0, clock) == 500


def recoverer(clock: Clock, purge: object, every: float = 60.0) -> Recoverer:
    return Recoverer(MemoryStore(), "w@h", interval=2.0, batch=10, publish_ttl=5.0,
                     retention=30.0, purge_every=every, publish=lambda item: None,
                     listener=None,  # type: ignore[arg-type] - no recovery in these tests
                     purge=purge, lag=lambda older_than: 0.0, monotonic=clock)  # type: ignore[arg-type]


def test_a_pass_cut_short_goes_on_at_the_next_turn_then_waits_an_interval() -> None:
    clock = Clock()
    passes: list[float] = []

    def purge(older_than: float, budget: float) -> int:
        passes.append(clock.t)
        clock.t += budget if len(passes) == 1 else 0.1  # the first pass uses its budget
        return 500
    r = recoverer(clock, purge)
    r.maybe_purge()
    r.maybe_purge()  # right away: the first pass was cut short
    r.maybe_purge()  # the second ended on its own: the next waits an interval
    assert passes == [100.0, 100.0 + PURGE_BUDGET]
    stats = r.retention_stats()  # over the worker's life, while shorter than the window
    assert stats == {"lag": 0.0, "purged_per_second": round(1000 / (clock.t - 100.0), 3)}
    clock.t += 60.0
    r.maybe_purge()
    assert len(passes) == 3 and r.counts["purged"] == 1500
    clock.t += 0.5  # the first two passes have left the window
    assert r.retention_stats()["purged_per_second"] == round(500 / RATE_WINDOW, 3)


def test_a_worker_that_does_not_purge_shows_no_lag() -> None:
    r = recoverer(Clock(), lambda older_than, budget: None)
    r.maybe_purge()
    assert r.retention_stats() == {"lag": None, "purged_per_second": 0.0}
