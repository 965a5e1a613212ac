"""The leader-elected beat: every periodic slot fires exactly once.

The mechanism only (no Celery). "Now" is the store's clock (``now``), so a leader
whose wall clock is off by an hour neither fires an hour of slots early nor stalls.
Entries come from an adapter as
:class:`Entry` objects whose ``next_due(after)`` gives the next due time (store-
independent, deterministic: two leaders computing from the same ``last_run_at``
get the same slot).

Per tick, and only while the elector says we lead (before its local deadline):

1. for each entry, the slots due since ``last_run_at`` (all of them with
   ``catchup="all"``, the latest one with ``"latest"``);
2. each slot is recorded by ``fire_slot`` — inserted only while our leader term is
   live by the store clock, unique per ``(entry, due_at)`` — then published with a
   task id derived from the slot, then marked published;
3. after gaining leadership, slots recorded but never marked published (the previous
   leader died in between) are published again with the same task id; the claim
   table drops the copy if the first publish did go out.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable

from celery_pulse.errors import PulseError
from celery_pulse.leader import LeaderElector
from celery_pulse.service import Service
from celery_pulse.store.base import BeatStore, LeaderGrant, Slot
from celery_pulse.timefmt import iso

logger = logging.getLogger(__name__)

SLOT_NAMESPACE = uuid.UUID("6f1c1d2e-4b9e-4f7a-9d0e-70756c736521")
#: Most slots fired per entry and tick with ``catchup="all"`` (the rest on the next tick).
MAX_CATCHUP = 1000
#: Most missed periods skipped per entry and tick with ``catchup="latest"``.
MAX_SKIP = 10_000_000
CATCHUP_MODES = ("latest", "all")


def slot_task_id(entry: str, due_at: float) -> str:
    """The deterministic task id of a slot."""
    return str(uuid.uuid5(SLOT_NAMESPACE, f"{entry}@{due_at:.3f}"))


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    task: str
    #: JSON publish spec (args, kwargs, options).
    payload: str
    #: Next due time (epoch seconds) strictly after ``after``.
    next_due: Callable[[float], float]


class Beat(Service):
    """Ticks the schedule while ``elector`` says we lead (thread ``pulse-beat``)."""

    def __init__(self, store: BeatStore, elector: LeaderElector, *,
                 entries: Callable[[], list[Entry]], publish: Callable[[Slot], None],
                 catchup: str = "latest", now: Callable[[], float] = time.time,
                 max_sleep: float = 1.0) -> None:
        if catchup not in CATCHUP_MODES:
            raise ValueError(f"catchup must be one of {CATCHUP_MODES}")
        super().__init__("pulse-beat", join_timeout=10)
        self.store = store
        self.elector = elector
        self.entries = entries
        self.publish = publish
        self.catchup = catchup
        self.now = now
        self.max_sleep = max_sleep
        self.fired = 0
        self._sweep = threading.Event()

    def on_gained(self, grant: LeaderGrant) -> None:
        self._sweep.set()
        self.wake()  # tick now, not after up to max_sleep (handover <= one interval)

    def run(self) -> None:
        while not self.stopping:
            delay = self.max_sleep
            try:
                delay = self.tick()
            except PulseError as exc:
                logger.warning("pulse: beat tick failed: %s", exc)
            except Exception:
                logger.exception("pulse: beat tick failed unexpectedly")
            self.sleep(max(0.01, min(delay, self.max_sleep)))

    def tick(self) -> float:
        """Fire what is due; returns seconds until the next due slot (capped)."""
        grant = self.elector.grant
        if grant is None or not self.elector.is_leader:
            return self.max_sleep
        if self._sweep.is_set():
            self._sweep.clear()
            self._republish_unpublished()
        entries = self.entries()
        last_runs = self.store.last_run()
        now = self.now()
        wake = now + self.max_sleep
        for entry in entries:
            last = last_runs.get(entry.name)
            if last is None:
                # A new entry: like celery beat, its first slot is one period from now.
                last = self.store.init_last_run(entry.name, now)
            due = entry.next_due(last)
            slots: list[float] = []
            if self.catchup == "latest":
                # Skip every missed period but the most recent one (not only the first
                # MAX_CATCHUP of them: that would fire one slot per batch).
                skipped = 0
                while due <= now and skipped < MAX_SKIP:
                    slots[:] = [due]
                    due = entry.next_due(due)
                    skipped += 1
            else:
                while due <= now and len(slots) < MAX_CATCHUP:
                    slots.append(due)
                    due = entry.next_due(due)
            wake = min(wake, due)
            for due_at in slots:
                if not self.elector.is_leader:
                    return self.max_sleep
                self._fire(grant, entry, due_at)
        return wake - self.now()

    def _fire(self, grant: LeaderGrant, entry: Entry, due_at: float) -> None:
        slot = Slot(entry.name, due_at, slot_task_id(entry.name, due_at), entry.task,
                    entry.payload)
        if not self.store.fire_slot(grant.key, grant.token, grant.epoch, slot):
            return
        self._publish(slot)

    def _publish(self, slot: Slot) -> None:
        try:
            self.publish(slot)
        except Exception as exc:
            # Recorded but not published: the next leader (or our next sweep) sends it.
            logger.error("pulse: publishing slot %s@%s failed: %r", slot.entry,
                         iso(slot.due_at, ms=True), exc)
            self._sweep.set()
            return
        self.fired += 1
        self.store.mark_slot_published(slot.entry, slot.due_at)
        logger.info("pulse: beat fired %s (%s) for %s as %s", slot.entry, slot.task,
                    iso(slot.due_at, ms=True), slot.task_id)

    def _republish_unpublished(self) -> None:
        for slot in self.store.unpublished_slots():
            logger.warning("pulse: re-publishing slot %s@%s left unpublished by a previous "
                           "leader", slot.entry, iso(slot.due_at, ms=True))
            self._publish(slot)
