"""The history checker: invariants over what the tasks recorded and what the store says.

Pure functions over plain data, so the checker itself is unit-tested with
hand-made histories that break each rule.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

TERMINAL = ("succeeded", "failed", "needs_review")
#: Claim states in which a claim's permit rows under its current epoch still mean
#: something (held while running, waited for while reserved).
LIVE = ("reserved", "running")


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str  # start | held | fenced | end | fence_rejected | tick
    task_id: str
    epoch: int
    #: Celery's retry count of the delivery (a task's own retry is a new run).
    retries: int = 0
    #: The task's name, e.g. ``faultapp.limited`` ("" for events that don't say).
    name: str = ""
    #: When it was recorded, in seconds, by the history server's clock (one clock).
    at: float = 0.0
    #: Marker of the body's execution: the events of one run of a body share it.
    attempt: str = ""
    worker: str = ""


@dataclasses.dataclass(frozen=True)
class PermitHold:
    """A row of ``pulse_permit_holds``."""

    key: str
    task_id: str
    epoch: int
    held: bool


@dataclasses.dataclass(frozen=True)
class Held:
    """The part of one execution during which it provably held its permit."""

    task_id: str
    epoch: int
    attempt: str
    worker: str
    start: float
    until: float


def permit_intervals(events: Iterable[Event], name: str) -> list[Held]:
    """When each execution of task ``name`` provably held its permit: from its ``start``
    to the last of its marks that the body is known to have got past.

    The rule, and why it never flags a correct system:

    * The body runs only once the store started the claim (``running`` under the
      attempt's epoch, the permit taken in that statement), so at ``start`` the permit
      had been taken. A claim is ``running`` under one epoch for one stretch of time:
      every way out of it (completion, release, requeue, Recover's takeover, a new
      reservation) moves on for good, and the permit goes back with it.
    * A ``held`` mark is written just *before* a ``lease.check()``. A check that passes
      proves the lease unexpired in the store (the local deadline is the renewal's send
      time + TTL - margin, ahead of the store's expiry), so nothing took the claim over:
      it still held its permit at the mark. The check passed iff the body recorded any
      later event (a failed check raises out of the body and records nothing).
    * A ``fenced`` mark is written inside ``lease.fenced()``: the guard had locked the
      claim row under this epoch, unexpired, and it stays locked until the commit, so no
      takeover could be granted in between. Proof iff the block committed, which the
      ``end`` recorded after it says (``fence_rejected``, or a store error, says not).
    * The ``end`` itself proves nothing: a worker paused (SIGSTOP) after its commit may
      write it long after its lease ran out and Recover gave the permit to another.

    An execution whose worker was SIGKILLed or SIGSTOPped past its lease counts up to its
    last proven mark only: its permit went back with Recover's takeover, at a time the
    history cannot see, and another task may take it before this task's own re-run does
    (the re-run needs a permit too). Counting it "until the next start of the same task"
    would flag a correct system; counting it to its own late ``end`` would too.

    Each returned interval lies inside a stretch of real time during which the store
    counted that execution's claim among the key's holders, so correct starts never
    make more than the limit overlap; an over-limit start does, as soon as three
    executions overlap by more than the spacing of their marks.
    """
    runs: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if e.name == name and e.kind in ("start", "held", "fenced", "end", "fence_rejected"):
            runs[e.attempt or f"{e.task_id}/{e.epoch}"].append(e)
    out: list[Held] = []
    for attempt, found in runs.items():
        found.sort(key=lambda e: e.at)  # stable: one process wrote them in order
        start = next((e for e in found if e.kind == "start"), None)
        if start is None:
            continue
        until = start.at
        for mark, after in itertools.pairwise(found):
            proven = (mark.kind == "held"
                      or (mark.kind == "fenced" and after.kind == "end"))
            if proven and mark.at >= start.at:
                until = max(until, mark.at)
        out.append(Held(start.task_id, start.epoch, attempt, start.worker, start.at, until))
    return sorted(out, key=lambda h: (h.start, h.until))


def _edges(held: Iterable[Held]) -> tuple[list[Held], list[tuple[float, int, int]]]:
    """The non-empty intervals, and their edges in time order; at one instant an end
    comes before a start (the permit went back before the next start took it)."""
    items = [h for h in held if h.until > h.start]
    edges = [(h.start, 1, i) for i, h in enumerate(items)]
    edges += [(h.until, -1, i) for i, h in enumerate(items)]
    return items, sorted(edges, key=lambda edge: (edge[0], edge[1]))


def over_limit(held: Iterable[Held], limit: int) -> list[tuple[float, list[Held]]]:
    """Each start that made more than ``limit`` intervals overlap: (when, the intervals
    open then)."""
    items, edges = _edges(held)
    running: set[int] = set()
    found: list[tuple[float, list[Held]]] = []
    for at, delta, i in edges:
        if delta < 0:
            running.discard(i)
            continue
        running.add(i)
        if len(running) > limit:
            found.append((at, [items[j] for j in sorted(running)]))
    return found


def peak(held: Iterable[Held]) -> int:
    """The most intervals open at once."""
    depth = deepest = 0
    for _, delta, _ in _edges(held)[1]:
        depth += delta
        deepest = max(deepest, depth)
    return deepest


def leaked_permits(holds: Iterable[PermitHold], claims: Iterable[ClaimState]) -> list[str]:
    """Once every task settled: a permit row whose claim is still live under the row's
    epoch is a permit held (``running``) or waited for (``reserved``) by nothing that
    will end. Rows of claims that moved on are not leaks: the store never counts them
    (it joins rows to ``running`` claims at the same epoch), the next start of their key
    or retention drops them, and a completion leaves them in place."""
    by_id = {c.task_id: c for c in claims}
    out = []
    for h in holds:
        claim = by_id.get(h.task_id)
        if claim is not None and claim.epoch == h.epoch and claim.state in LIVE:
            what = "held" if h.held else "waited for"
            out.append(f"permit {h.key} still {what} by {h.task_id} epoch {h.epoch} "
                       f"({claim.state}) after everything settled")
    return out


def ghost_waiters(stats: Mapping[str, Any]) -> list[str]:
    """Once every task settled, no worker may still count a task waiting for a permit
    (or a retried start waiting for a pool process): ``stats`` is ``inspect stats`` by
    worker name. A waiter whose claim was dropped leaves the count when its turn comes
    (backoff at most 1 s), so a count that stays means a turn that never comes: waiters
    behind it on that worker never start, and nothing (no Recover: the worker renews
    them; no wait warning: its timer is gone) ever says so."""
    out = []
    for worker, found in sorted(stats.items()):
        permits = ((found or {}).get("pulse") or {}).get("permits") or {}
        waiting = int(permits.get("waiting") or 0)
        awaiting = int(permits.get("awaiting_process") or 0)
        if waiting or awaiting:
            out.append(f"{worker} still counts {waiting} task(s) waiting for a permit "
                       f"{permits.get('by_key')} and {awaiting} awaiting a pool process "
                       f"after everything settled")
    return out


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
    #: Executions of limited tasks seen, and the most that provably held a permit at once.
    limited_runs: int = 0
    limited_peak: int = 0
    #: Rows left in ``pulse_permit_holds`` at the end (of claims that moved on: harmless).
    permit_rows_left: int = 0
    #: Tasks the broker lost before any worker received them (``lost_by_broker``).
    broker_lost: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        return (f"submitted={self.submitted} succeeded={self.succeeded} failed={self.failed} "
                f"needs_review={self.needs_review} duplicates_dropped={self.duplicates_dropped} "
                f"recoveries={self.recoveries} stale_effects_rejected="
                f"{self.stale_effects_rejected} ticks={self.ticks} "
                f"limited_runs={self.limited_runs} limited_peak={self.limited_peak} "
                f"permit_rows_left={self.permit_rows_left} broker_lost={self.broker_lost} "
                f"violations={len(self.violations)}")


def check(submitted: Iterable[str], claims: Iterable[ClaimState], events: Iterable[Event],
          effects: Iterable[tuple[str, int]], slots: Iterable[tuple[str, str]] = (),
          slot_period: float | None = None, limits: Mapping[str, int] | None = None,
          permit_holds: Iterable[PermitHold] = (),
          worker_stats: Mapping[str, Any] | None = None,
          lost_by_broker: Iterable[str] = ()) -> Report:
    """Every invariant the suite promises; returns counts and the violations found.

    * every submitted task ends succeeded, failed or needs_review (none lost, none stuck),
      except those in ``lost_by_broker``: shown by the test never to have reached a
      worker (no claim, or ``open`` since its re-publication; nowhere in the broker; in
      no worker's log since), counted apart;
    * at most one fenced effect per task, and a succeeded task has exactly one;
    * a ``review`` task is started at most once per delivery of its own (a Celery
      retry is a new run the task asked for; a lost run is never re-run automatically);
    * a ``redispatch`` (acks_late) task never ends in needs_review;
    * every periodic slot fires at most once;
    * with ``slot_period`` (catch-up "all"): no slot skipped — consecutive due times of
      an entry are exactly one period apart;
    * with ``limits`` (task name -> ``pulse_concurrency``): never more executions of a
      limited task provably holding a permit at once than its limit (see
      :func:`permit_intervals` for what "provably" means and why it is sound);
    * no permit leaked: at the end no row of ``permit_holds`` belongs to a claim still
      live under that epoch (see :func:`leaked_permits`), and with ``worker_stats`` no
      worker still counts a waiter (see :func:`ghost_waiters`).
    """
    report = Report()
    lost_by_broker = set(lost_by_broker)
    submitted = list(submitted)
    report.submitted = len(submitted)
    claims = list(claims)
    events = list(events)
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
            if task_id in lost_by_broker:
                report.broker_lost += 1
            else:
                report.violations.append(f"{task_id}: lost (no claim, never reserved)")
            continue
        if claim.state == "open" and task_id in lost_by_broker:
            report.broker_lost += 1
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
    for name, limit in (limits or {}).items():
        held = permit_intervals(events, name)
        report.limited_runs += len(held)
        report.limited_peak = max(report.limited_peak, peak(held))
        for at, together in over_limit(held, limit)[:5]:
            report.violations.append(
                f"{len(together)} {name} held a permit at once at {at:.3f} (limit {limit}): "
                + ", ".join(f"{h.task_id}@{h.epoch} on {h.worker or '?'} "
                            f"[{h.start:.3f}, {h.until:.3f}]" for h in together))
    holds = list(permit_holds)
    report.permit_rows_left = len(holds)
    report.violations += leaked_permits(holds, claims)
    report.violations += ghost_waiters(worker_stats or {})
    return report

