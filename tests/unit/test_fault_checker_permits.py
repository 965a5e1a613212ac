"""The fault checker's permit rules on hand-made histories: each must catch what it
promises to (an over-limit start, a leaked permit) and must not flag a correct system
(a SIGKILLed or SIGSTOPped holder whose permit went back with Recover's takeover)."""

from __future__ import annotations

from tests.fault.checker import (
    ClaimState,
    Event,
    Held,
    PermitHold,
    check,
    ghost_waiters,
    leaked_permits,
    over_limit,
    peak,
    permit_intervals,
)

LIMITED = "faultapp.limited"
LIMITS = {LIMITED: 2}


def ev(kind: str, task_id: str, at: float, epoch: int = 1, attempt: str = "",
       name: str = LIMITED) -> Event:
    return Event(kind, task_id, epoch, name=name, at=at,
                 attempt=attempt or f"{task_id}.{epoch}", worker="f1")


def run(task_id: str, start: float, fenced: float, epoch: int = 1, end: float | None = None,
        every: float = 0.3) -> list[Event]:
    """A run that went to the end: start, a ``held`` mark every ``every`` s, fenced, end."""
    marks = [ev("start", task_id, start, epoch)]
    at = start + every
    while at < fenced:
        marks.append(ev("held", task_id, at, epoch))
        at += every
    marks += [ev("fenced", task_id, fenced, epoch),
              ev("end", task_id, fenced + 0.01 if end is None else end, epoch)]
    return marks


def done(*task_ids: str, epoch: int = 1) -> list[ClaimState]:
    return [ClaimState(t, "succeeded", epoch, "redispatch") for t in task_ids]


def effects(*task_ids: str) -> list[tuple[str, int]]:
    return [(t, 1) for t in task_ids]


def test_two_at_once_then_a_third_after_one_ended_is_clean() -> None:
    events = run("a", 0.0, 2.0) + run("b", 0.5, 3.0) + run("c", 2.05, 4.0)
    report = check(["a", "b", "c"], done("a", "b", "c"), events, effects("a", "b", "c"),
                   limits=LIMITS)
    assert report.violations == []
    assert (report.limited_runs, report.limited_peak) == (3, 2)


def test_three_at_once_is_a_violation() -> None:
    events = run("a", 0.0, 2.0) + run("b", 0.5, 3.0) + run("c", 1.0, 4.0)
    report = check(["a", "b", "c"], done("a", "b", "c"), events, effects("a", "b", "c"),
                   limits=LIMITS)
    assert report.limited_peak == 3
    (violation,) = report.violations
    assert violation.startswith(f"3 {LIMITED} held a permit at once at 1.000 (limit 2)")
    assert "a@1" in violation and "b@1" in violation and "c@1" in violation


def test_other_tasks_and_unlimited_kinds_do_not_count() -> None:
    events = run("a", 0.0, 2.0) + run("b", 0.5, 3.0)
    events += [ev("start", "x", 1.0, name="faultapp.long"),
               ev("end", "x", 1.5, name="faultapp.long")]
    assert check(["a", "b", "x"], done("a", "b", "x"), events, effects("a", "b", "x"),
                 limits=LIMITS).violations == []


def test_an_end_at_the_instant_of_a_start_is_before_it() -> None:
    held = [Held("a", 1, "a", "f1", 0.0, 1.0), Held("b", 1, "b", "f1", 0.0, 2.0),
            Held("c", 1, "c", "f1", 1.0, 2.0)]
    assert over_limit(held, 2) == []
    assert peak(held) == 2


def test_sigkilled_holder_counts_up_to_its_last_proven_mark_only() -> None:
    """A (epoch 1) is SIGKILLed at 1.7 after its held marks at 1.2 and 1.5: the mark at
    1.5 was never followed by a check that passed. Recover takes A over at 5 and frees
    its permit; C takes it at 5.5; A's re-run (epoch 2) waits for a permit until B ends
    at 8. Counting A's first run "until the next start of the same task" (8.1) would
    make A, B and C three at once: a correct system flagged."""
    killed = [ev("start", "a", 0.0), ev("held", "a", 0.3), ev("held", "a", 0.6),
              ev("held", "a", 0.9), ev("held", "a", 1.2), ev("held", "a", 1.5)]
    events = (killed + run("b", 1.0, 8.0) + run("c", 5.5, 9.0)
              + run("a", 8.1, 10.0, epoch=2))
    (first, *_) = permit_intervals(events, LIMITED)
    assert (first.task_id, first.epoch, first.start, first.until) == ("a", 1, 0.0, 1.2)
    report = check(["a", "b", "c"], done("b", "c") + done("a", epoch=2), events,
                   [("a", 2), ("b", 1), ("c", 1)], limits=LIMITS)
    assert report.violations == []
    assert report.limited_peak == 2


def test_sigkilled_holder_still_counts_while_it_provably_ran() -> None:
    """The rule can fail with a killed holder: C starting while A (killed later) and B
    both provably held their permits is three at once."""
    killed = [ev("start", "a", 0.0), ev("held", "a", 0.3), ev("held", "a", 0.6),
              ev("held", "a", 0.9)]
    events = killed + run("b", 0.1, 3.0) + run("c", 0.4, 3.0)
    report = check(["b", "c"], done("b", "c"), events, effects("b", "c"), limits=LIMITS)
    assert any("3 faultapp.limited held a permit at once at 0.400" in v
               for v in report.violations), report.violations


def test_sigstopped_holder_whose_late_end_follows_the_takeover_is_clean() -> None:
    """A commits its fenced effect at 2.0 and is SIGSTOPped before writing its end; its
    lease runs out, Recover takes it over and C gets the permit at 6; A resumes and
    writes its ``end`` at 8.5. The ``end`` proves nothing (written after the commit): A
    counts to its fenced mark. Counting to the end would flag A, B and C."""
    stopped = run("a", 0.0, 2.0, end=8.5)
    events = stopped + run("b", 1.0, 9.0) + run("c", 6.0, 9.5) + run("a", 9.1, 10.0, epoch=2)
    assert permit_intervals(stopped, LIMITED)[0].until == 2.0
    report = check(["a", "b", "c"], done("b", "c") + done("a", epoch=2), events,
                   effects("a", "b", "c"), limits=LIMITS)
    assert report.violations == []


def test_sigstopped_holder_stopped_by_lease_lost_counts_to_its_last_passed_check() -> None:
    """A is SIGSTOPped at 1.0 right after its held mark at 0.9; on SIGCONT (6.0) its
    check finds the lease lost and the body raises: no later event. Its mark at 0.9 is
    not proof (the check after it failed); 0.6 is (the mark at 0.9 followed it)."""
    stopped = [ev("start", "a", 0.0), ev("held", "a", 0.3), ev("held", "a", 0.6),
               ev("held", "a", 0.9)]
    events = stopped + run("b", 0.5, 7.0) + run("c", 4.5, 7.0)
    assert permit_intervals(stopped, LIMITED)[0].until == 0.6
    assert check(["b", "c"], done("b", "c"), events, effects("b", "c"),
                 limits=LIMITS).violations == []


def test_fenced_mark_of_a_rejected_or_failed_commit_is_no_proof() -> None:
    """A fenced mark proves the lock was held only if the block committed (an ``end``
    follows); a recheck that failed (``fence_rejected``) or a store error (nothing
    follows) leaves the run proven to its last ``held`` mark that a check passed."""
    rejected = [ev("start", "a", 0.0), ev("held", "a", 0.3), ev("fenced", "a", 0.5),
                ev("fence_rejected", "a", 4.0)]
    store_down = [ev("start", "b", 0.0), ev("held", "b", 0.3), ev("fenced", "b", 0.5)]
    held = {h.task_id: h.until for h in permit_intervals(rejected + store_down, LIMITED)}
    assert held == {"a": 0.3, "b": 0.3}


def test_two_runs_under_one_epoch_are_two_executions() -> None:
    """Executions pair their events by the body's marker: a task run twice under one
    epoch (a bug) is two runs, both counted."""
    events = [ev("start", "a", 0.0, attempt="x"), ev("fenced", "a", 2.0, attempt="x"),
              ev("end", "a", 2.1, attempt="x"), ev("start", "a", 0.5, attempt="y"),
              ev("fenced", "a", 2.0, attempt="y"), ev("end", "a", 2.1, attempt="y")]
    events += run("b", 1.0, 3.0)
    assert len(permit_intervals(events, LIMITED)) == 3
    assert check(["a", "b"], done("a", "b"), events, effects("a", "b"),
                 limits=LIMITS).violations


def test_permit_rows_of_claims_that_moved_on_are_not_leaks() -> None:
    """A completion leaves its rows (the next start of the key or retention drops
    them); a row of an older epoch holds nothing either."""
    claims = [ClaimState("a", "succeeded", 1, "redispatch"),
              ClaimState("b", "failed", 3, "redispatch"),
              ClaimState("c", "running", 4, "redispatch")]
    holds = [PermitHold("task:x", "a", 1, True), PermitHold("task:x", "b", 2, True),
             PermitHold("task:x", "c", 3, True), PermitHold("task:x", "gone", 1, True)]
    assert leaked_permits(holds, claims) == []


def test_a_permit_still_held_or_waited_for_at_the_end_is_a_leak() -> None:
    claims = [ClaimState("a", "running", 2, "redispatch"),
              ClaimState("b", "reserved", 1, "redispatch"),
              ClaimState("c", "succeeded", 1, "redispatch")]
    holds = [PermitHold("task:x", "a", 2, True), PermitHold("task:x", "b", 1, False),
             PermitHold("task:x", "c", 1, True)]
    leaks = leaked_permits(holds, claims)
    assert leaks == ["permit task:x still held by a epoch 2 (running) after everything settled",
                     "permit task:x still waited for by b epoch 1 (reserved) after "
                     "everything settled"]
    report = check([], claims, [], [], permit_holds=holds)
    assert report.violations == leaks
    assert report.permit_rows_left == 3


def _stats(waiting: int, awaiting: int | None = None) -> dict[str, object]:
    permits: dict[str, object] = {"waiting": waiting,
                                  "by_key": {"task:x": waiting} if waiting else {}}
    if awaiting is not None:
        permits["awaiting_process"] = awaiting
    return {"pulse": {"permits": permits}}


def test_a_worker_still_counting_a_waiter_at_the_end_is_a_violation() -> None:
    """A turn that never comes: the waiters behind it on that worker never start."""
    stats = {"f1@vm": _stats(3), "f2@vm": _stats(0, 0), "f3@vm": _stats(0, 1)}
    found = ghost_waiters(stats)
    assert found == ["f1@vm still counts 3 task(s) waiting for a permit {'task:x': 3} and "
                     "0 awaiting a pool process after everything settled",
                     "f3@vm still counts 0 task(s) waiting for a permit {} and 1 awaiting a "
                     "pool process after everything settled"]
    assert check([], [], [], [], worker_stats=stats).violations == found


def test_workers_counting_no_waiter_or_not_answering_are_clean() -> None:
    assert ghost_waiters({"f1@vm": _stats(0), "f2@vm": _stats(0, 0), "f3@vm": {}}) == []
