"""Cluster-wide concurrency limits, declared the Celery way, and the tasks waiting for one.

Declared by a task option (``@app.task(pulse_concurrency=5)``), partitioned by
``pulse_concurrency_key=lambda args, kwargs: ...`` (each value gets its own permits),
or by the ``pulse_concurrency_limits`` setting, which names tasks and queues
(``"queue:<routing key>"``) and overrides the option. The store takes a task's permits
in the statement that starts it (never at reservation: a prefetched task holds none)
and gives them back with whatever ends that start.

A task whose start finds no free permit gives its pool process back and waits here,
still reserved and renewed, until a permit of its keys frees: a task of this worker
holding one ends (at once), or the next retry (backoff from :data:`FIRST_RETRY` to
:data:`MAX_RETRY`: the permit may be freed by another worker). Tasks waiting for the same
keys start in arrival order, one start in flight per keys at a time.
"""

from __future__ import annotations

import collections
import hashlib
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery import Task

from celery_pulse.bootsteps.loop import LoopCaller
from celery_pulse.errors import InvalidConfig, PulseError
from celery_pulse.leases import LocalClaim
from celery_pulse.settings import concurrency_limit
from celery_pulse.store.base import ClaimStore, Permit

logger = logging.getLogger(__name__)

#: Seconds before a task that found no permit asks again, doubling up to MAX_RETRY.
FIRST_RETRY = 0.05
MAX_RETRY = 1.0
#: Longest permit key kept as is (the store's column is 255 characters).
MAX_KEY = 200
QUEUE_PREFIX = "queue:"
#: Seconds the signal thread waits for an announcement before sending its own.
SIGNAL_POLL = 0.05


def _keyer(task: Any) -> Any:
    """The task's ``pulse_concurrency_key`` as declared: Celery makes task options class
    attributes, so a plain function comes back bound to the task."""
    keyer = getattr(task, "pulse_concurrency_key", None)
    if inspect.ismethod(keyer) and isinstance(keyer.__self__, Task):
        return keyer.__func__
    return keyer


def _key(text: str) -> str:
    if len(text) <= MAX_KEY:
        return text
    return f"{text[:MAX_KEY - 17]}#{hashlib.sha1(text.encode()).hexdigest()[:16]}"


class PermitRules:
    """Which permits a request needs, from the setting and the tasks' options."""

    def __init__(self, limits: Mapping[str, int]) -> None:
        self.tasks = {k: v for k, v in limits.items() if not k.startswith(QUEUE_PREFIX)}
        self.queues = {k[len(QUEUE_PREFIX):]: v for k, v in limits.items()
                       if k.startswith(QUEUE_PREFIX)}
        #: Some limit is declared (by the setting or a task's option).
        self.declared = bool(limits)

    @classmethod
    def for_app(cls, app: Any, limits: Mapping[str, int]) -> PermitRules:
        """Check every registered task's options now: a bad one fails the worker's start."""
        rules = cls(limits)
        for name, task in sorted(app.tasks.items()):
            rules.check(name, task)
        return rules

    def check(self, name: str, task: Any) -> None:
        option = getattr(task, "pulse_concurrency", None)
        if option is not None:
            concurrency_limit(f"pulse_concurrency of task {name}", option, "pulse_concurrency")
            self.declared = True
        keyer = _keyer(task)
        if keyer is not None:
            if not callable(keyer):
                raise InvalidConfig(f"pulse_concurrency_key of task {name}: expected a callable "
                                    f"(args, kwargs) -> key, got {keyer!r}",
                                    setting="pulse_concurrency_key")
            if option is None and name not in self.tasks:
                raise InvalidConfig(f"pulse_concurrency_key of task {name}: partitions a limit, "
                                    f"but the task has none (set pulse_concurrency)",
                                    setting="pulse_concurrency_key")

    def _task_limit(self, task: Any) -> int | None:
        limit = self.tasks.get(task.name)
        return limit if limit is not None else getattr(task, "pulse_concurrency", None)

    def limited(self, task: Any, routing_key: str | None) -> bool:
        """Whether deliveries of ``task`` (by this routing key) may need a permit."""
        return self._task_limit(task) is not None or (
            routing_key is not None and routing_key in self.queues)

    def needs(self, task: Any, args: Any, kwargs: Any, routing_key: str | None
              ) -> tuple[Permit, ...]:
        """The permits one request of ``task`` needs to start."""
        out: list[Permit] = []
        limit = self._task_limit(task)
        if limit is not None:
            key = f"task:{task.name}"
            keyer = _keyer(task)
            if keyer is not None:
                try:
                    key = f"{key}[{keyer(args or (), kwargs or {})}]"
                except Exception:
                    # Conservative: the whole kind's limit, never none (and never lost).
                    logger.exception("pulse: pulse_concurrency_key of %s failed: the task "
                                     "waits for the unpartitioned limit instead", task.name)
            out.append(Permit(_key(key), limit))
        if routing_key is not None and routing_key in self.queues:
            out.append(Permit(_key(QUEUE_PREFIX + routing_key), self.queues[routing_key]))
        return tuple(out)


class _Keys:
    """The tasks waiting for one set of permit keys, in arrival order."""

    __slots__ = ("delay", "entries", "freed", "in_flight", "timer")

    def __init__(self) -> None:
        self.entries: collections.deque[tuple[LocalClaim, Any]] = collections.deque()
        self.delay = FIRST_RETRY
        #: A start of one of them is in flight (or waits for a pool process).
        self.in_flight: LocalClaim | None = None
        #: A permit of these keys was given back while that start was in flight: if it
        #: answers "waiting", it may have looked before the permit came back.
        self.freed = False
        self.timer = False


class PermitWaits:
    """Tasks whose start found no free permit, until one frees. On the consumer loop."""

    def __init__(self, loop: Callable[[], LoopCaller], resume: Callable[[LocalClaim, Any], Any],
                 emit: Callable[..., None], wait_event: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._loop = loop
        #: ``resume(claim, job)``: ask for the start again (the pool's).
        self.resume = resume
        self.emit = emit
        self.wait_event = wait_event
        self.monotonic = monotonic
        self.groups: dict[tuple[str, ...], _Keys] = {}
        self.count = 0
        self._warned: set[int] = set()
        self._asks: collections.deque[tuple[str, ...]] = collections.deque()
        self._asking = False

    @staticmethod
    def _group(claim: LocalClaim) -> tuple[str, ...]:
        return tuple(sorted(p.key for p in claim.permits or ()))

    def by_key(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for keys, group in self.groups.items():
            for key in keys:
                out[key] = out.get(key, 0) + len(group.entries) + (group.in_flight is not None)
        return out

    def settled(self, claim: LocalClaim, job: Any, outcome: str) -> None:
        """The answer to a start of a task that needs permits: ``started``, ``waiting``
        (no free permit: it waits here) or ``gone`` (lost, refused, revoked)."""
        keys = self._group(claim)
        group = self.groups.get(keys)
        resumed = group is not None and group.in_flight is claim
        if outcome == "waiting":
            if group is None:
                group = self.groups[keys] = _Keys()
            if resumed:
                group.in_flight = None
                group.entries.appendleft((claim, job))  # still first in line
                if group.freed:  # ask again now: no wake-up lost to the race
                    group.freed = False
                    self._next(keys)
                    return
                group.delay = min(group.delay * 2, MAX_RETRY)
            else:
                group.entries.append((claim, job))
                self.count += 1
                claim.parked_at = self.monotonic()
            self._schedule(keys, group, group.delay)
            return
        if not resumed or group is None:
            return
        group.in_flight = None
        group.freed = False
        self.count -= 1
        self._warned.discard(id(claim))
        if claim.parked_at is not None and outcome == "started":
            logger.info("pulse: task %s got its concurrency permit after %.3fs", claim.task_id,
                        self.monotonic() - claim.parked_at)
        claim.parked_at = None
        group.delay = FIRST_RETRY
        self._next(keys)  # a permit was free: maybe another one too

    def freed(self, freed: set[str]) -> None:
        """Permits of these keys were given back (by a task of this worker that ended, or
        announced by another worker): their waiters ask again now."""
        for keys, group in list(self.groups.items()):
            if freed.intersection(keys):
                group.delay = FIRST_RETRY
                if group.in_flight is not None:
                    group.freed = True  # answered when that start comes back
                self._next(keys)

    def _schedule(self, keys: tuple[str, ...], group: _Keys, delay: float) -> None:
        if not group.timer:
            group.timer = True
            self._loop().later_kept(delay, self._tick, keys)

    def _tick(self, keys: tuple[str, ...]) -> None:
        group = self.groups.get(keys)
        if group is None:
            return
        group.timer = False
        self._warn_long_waits(group)
        self._next(keys)

    def _next(self, keys: tuple[str, ...]) -> None:
        """Let the first waiter of ``keys`` ask. A resume may answer at once (a lost claim
        is ``gone``, a loop without a hub starts inline) and ask for the next: those asks
        are queued and run here, one after another, never nested (a reconnect that drops
        hundreds of waiters must not recurse once per waiter)."""
        self._asks.append(keys)
        if self._asking:
            return
        self._asking = True
        try:
            while self._asks:
                self._ask(self._asks.popleft())
        finally:
            self._asking = False

    def _ask(self, keys: tuple[str, ...]) -> None:
        group = self.groups.get(keys)
        if group is None or group.in_flight is not None:
            return
        if group.entries:
            # A lost one too: the pool drops it when it asks again (and says ``gone``).
            claim, job = group.entries.popleft()
            group.in_flight = claim
            self.resume(claim, job)
        elif not group.timer:
            del self.groups[keys]

    def _warn_long_waits(self, group: _Keys) -> None:
        now = self.monotonic()
        for claim, _job in group.entries:
            if (claim.parked_at is not None and now - claim.parked_at >= self.wait_event
                    and id(claim) not in self._warned):
                self._warned.add(id(claim))
                waited = round(now - claim.parked_at, 3)
                logger.warning("pulse: task %s has waited %.0fs for a concurrency permit (%s)",
                               claim.task_id, waited, ", ".join(p.key for p in claim.permits or ()))
                self.emit("pulse-permit-wait", uuid=claim.task_id, waited=waited,
                          permits=[p.key for p in claim.permits or ()])


class PermitSignals:
    """Tells the other workers when this one gives permits back, and hears when they do
    (PostgreSQL's NOTIFY; without it, waiting tasks only poll). A thread of its own: a
    hint that wakes waiters at once instead of at their next retry, never a grant."""

    def __init__(self, store: ClaimStore, on_freed: Callable[[set[str]], None]) -> None:
        self.store = store
        self.on_freed = on_freed
        self._out: queue.SimpleQueue[tuple[str, ...]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.store.permit_signals() is None:
            return
        self._thread = threading.Thread(target=self._run, name="pulse-permits", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def announce(self, permits: tuple[Permit, ...]) -> None:
        if self._thread is not None:
            self._out.put(tuple(p.key for p in permits))

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            channel = self.store.permit_signals()
            if channel is None:
                return
            try:
                with channel as signals:
                    backoff = 0.5
                    while not self._stop.is_set():
                        keys: set[str] = set()
                        while not self._out.empty():
                            keys.update(self._out.get_nowait())
                        if keys:
                            signals.send(sorted(keys))
                        heard = signals.receive(SIGNAL_POLL)
                        if heard:
                            self.on_freed(heard)
            except PulseError as exc:
                logger.warning("pulse: permit signals unavailable (%s): waiting tasks poll", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            except Exception:
                logger.exception("pulse: permit signals failed")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
