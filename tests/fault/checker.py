"""The history checker: invariants over what the tasks recorded and what the store says.

Pure functions over plain data, so the checker itself is unit-tested with
hand-made histories that break each rule.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable

TERMINAL = ("succeeded", "failed", "needs_review")


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str  # start | end | fence_rejected | tick
    task_id: str
    epoch: int
    #: Celery's retry count of the delivery (a task's own retry is a new run).
    retries: int = 0


@dataclasses.dataclass(frozen=True)
class ClaimState:
    task_id: str
    state: str
    epoch: int
    policy: str


@dataclasses.dataclass
class Report:
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    needs_review: int = 0
    stale_effects_rejected: int = 0
    ticks: int = 0
    duplicates_dropped: int = 0
    recoveries: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        return (f"submitted={self.submitted} succeeded={self.succeeded} failed={self.failed} "
                f"needs_review={self.needs_review} duplicates_dropped={self.duplicates_dropped} "
                f"recoveries={self.recoveries} stale_effects_rejected="
                f"{self.stale_effects_rejected} ticks={self.ticks} "
                f"violations={len(self.violations)}")


def check(submitted: Iterable[str], claims: Iterable[ClaimState], events: Iterable[Event],
          effects: Iterable[tuple[str, int]], slots: Iterable[tuple[str, str]] = (),
          slot_period: float | None = None) -> Report:
    """Every invariant the suite promises; returns counts and the violations found.

    * every submitted task ends succeeded, failed or needs_review (none lost, none stuck);
    * at most one fenced effect per task, and a succeeded task has exactly one;
    * a ``review`` task is started at most once per delivery of its own (a Celery
      retry is a new run the task asked for; a lost run is never re-run automatically);
    * a ``redispatch`` (acks_late) task never ends in needs_review;
    * every periodic slot fires at most once;
    * with ``slot_period`` (catch-up "all"): no slot skipped — consecutive due times of
      an entry are exactly one period apart.
    """
    report = Report()
    submitted = list(submitted)
    report.submitted = len(submitted)
    by_id = {c.task_id: c for c in claims}
    starts: Counter[tuple[str, int]] = Counter()
    ticks: Counter[str] = Counter()
    for e in events:
        if e.kind == "start":
            starts[(e.task_id, e.retries)] += 1
        elif e.kind == "fence_rejected":
            report.stale_effects_rejected += 1
        elif e.kind == "tick":
            ticks[e.task_id] += 1
    effect_count: dict[str, list[int]] = defaultdict(list)
    for task_id, epoch in effects:
        effect_count[task_id].append(epoch)

    for task_id in submitted:
        claim = by_id.get(task_id)
        if claim is None:
            report.violations.append(f"{task_id}: lost (no claim, never reserved)")
            continue
        if claim.state not in TERMINAL:
            report.violations.append(f"{task_id}: stuck in {claim.state} (epoch {claim.epoch})")
            continue
        setattr(report, claim.state, getattr(report, claim.state) + 1)
        done = effect_count.get(task_id, [])
        if len(done) > 1:
            report.violations.append(f"{task_id}: {len(done)} fenced effects (epochs {done})")
        if claim.state == "succeeded" and len(done) != 1:
            report.violations.append(f"{task_id}: succeeded with {len(done)} effects")
        if claim.policy == "review":
            for (tid, retries), n in starts.items():
                if tid == task_id and n > 1:
                    report.violations.append(
                        f"{task_id}: review task started {n} times (retry {retries})")
        if claim.policy == "redispatch" and claim.state == "needs_review":
            report.violations.append(f"{task_id}: acks_late task sent to review")
    report.ticks = sum(ticks.values())
    for task_id, n in ticks.items():
        if n > 1:
            report.violations.append(f"periodic slot task {task_id} ran {n} times")
    slots = list(slots)
    if slot_period is not None:
        by_entry: dict[str, list[float]] = defaultdict(list)
        for entry, due in slots:
            by_entry[entry].append(float(due))
        for entry, dues in by_entry.items():
            dues.sort()
            for a, b in itertools.pairwise(dues):
                if abs((b - a) - slot_period) > 0.01:
                    report.violations.append(f"slot(s) of {entry} skipped between {a} and {b}")
    slot_keys = Counter(slots)
    for key, n in slot_keys.items():
        if n > 1:
            report.violations.append(f"slot {key} recorded {n} times")
    return report
