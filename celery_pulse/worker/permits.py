"""Cluster-wide concurrency limits, declared the Celery way: which permits a request needs.

Declared by a task option (``@app.task(pulse_concurrency=5)``), partitioned by
``pulse_concurrency_key=lambda args, kwargs: ...`` (each value gets its own permits),
or by the ``pulse_concurrency_limits`` setting, which names tasks and queues
(``"queue:<routing key>"``) and overrides the option. The store takes a task's permits
in the transaction that starts it (a reservation folded with its start, where the store
can, is that transaction; a prefetched task holds none) and gives them back with
whatever ends that start. A task whose start finds no free permit waits in
:mod:`celery_pulse.worker.permit_waits`; other workers hear of freed permits through
:mod:`celery_pulse.worker.permit_signals`.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Mapping
from typing import Any

from celery import Task

from celery_pulse.errors import InvalidConfig
from celery_pulse.limits import (
    QUEUE_PREFIX,
    RATE_PREFIX,
    TASK_PREFIX,
    concurrency_limit,
    rate_limit,
)
from celery_pulse.store.base import Permit

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.permits")

#: Longest permit key kept as is (the store's column is 255 characters).
MAX_KEY = 200


def _keyer(task: Any, option: str = "pulse_concurrency_key") -> Any:
    """The task's ``pulse_concurrency_key`` (or ``pulse_rate_limit_key``) as declared:
    Celery makes task options class attributes, so a plain function comes back bound to
    the task."""
    keyer = (getattr(task, "pulse_rate_limit_key", None) if option == "pulse_rate_limit_key"
             else getattr(task, "pulse_concurrency_key", None))
    if inspect.ismethod(keyer) and isinstance(keyer.__self__, Task):
        return keyer.__func__
    return keyer


def _key(text: str) -> str:
    if len(text) <= MAX_KEY:
        return text
    return f"{text[:MAX_KEY - 17]}#{hashlib.sha1(text.encode()).hexdigest()[:16]}"


class PermitRules:
    """Which permits a request needs, from the setting and the tasks' options."""

    def __init__(self, limits: Mapping[str, int],
                 rates: Mapping[str, tuple[int, float]] | None = None) -> None:
        self.tasks = {k: v for k, v in limits.items() if not k.startswith(QUEUE_PREFIX)}
        self.queues = {k[len(QUEUE_PREFIX):]: v for k, v in limits.items()
                       if k.startswith(QUEUE_PREFIX)}
        rates = rates or {}
        self.task_rates = {k: v for k, v in rates.items() if not k.startswith(QUEUE_PREFIX)}
        self.queue_rates = {k[len(QUEUE_PREFIX):]: v for k, v in rates.items()
                            if k.startswith(QUEUE_PREFIX)}
        #: Some limit is declared (by the settings or a task's option).
        self.declared = bool(limits) or bool(rates)
        #: Some rate limit is declared.
        self.rated = bool(rates)
        self._fixed: dict[tuple[str, str | None], tuple[Permit, ...] | None] = {}

    @classmethod
    def for_app(cls, app: Any, limits: Mapping[str, int],
                rates: Mapping[str, tuple[int, float]] | None = None) -> PermitRules:
        """Check every registered task's options now: a bad one fails the worker's start."""
        rules = cls(limits, rates)
        for name, task in sorted(app.tasks.items()):
            rules.check(name, task)
        return rules

    def check(self, name: str, task: Any) -> None:
        rate = getattr(task, "pulse_rate_limit", None)
        if rate is not None:
            rate_limit(f"pulse_rate_limit of task {name}", rate, "pulse_rate_limit")
            self.declared = self.rated = True
        if ((rate is not None or name in self.task_rates)
                and getattr(task, "rate_limit", None)):
            logger.warning("pulse: task %s has both Celery's rate_limit (%s, per worker) "
                           "and a pulse rate limit (across the cluster): both apply",
                           name, task.rate_limit)
        rate_keyer = _keyer(task, "pulse_rate_limit_key")
        if rate_keyer is not None and not callable(rate_keyer):
            raise InvalidConfig(f"pulse_rate_limit_key of task {name}: expected a callable "
                                f"(args, kwargs) -> key, got {rate_keyer!r}",
                                setting="pulse_rate_limit_key")
        if rate_keyer is not None and rate is None and name not in self.task_rates:
            raise InvalidConfig(f"pulse_rate_limit_key of task {name}: partitions a rate "
                                f"limit, but the task has none (set pulse_rate_limit)",
                                setting="pulse_rate_limit_key")
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

    def _task_rate(self, task: Any) -> tuple[int, float] | None:
        rate = self.task_rates.get(task.name)
        if rate is None and getattr(task, "pulse_rate_limit", None) is not None:
            rate = rate_limit(task.name, task.pulse_rate_limit, "pulse_rate_limit")
        return rate

    def limited(self, task: Any, routing_key: str | None) -> bool:
        """Whether deliveries of ``task`` (by this routing key) may need a permit."""
        return self._task_limit(task) is not None or self._task_rate(task) is not None or (
            routing_key is not None and (routing_key in self.queues
                                         or routing_key in self.queue_rates))

    @staticmethod
    def _partitioned(base: str, task: Any, option: str, args: Any, kwargs: Any) -> str:
        keyer = _keyer(task, option)
        if keyer is None:
            return base
        try:
            return f"{base}[{keyer(args or (), kwargs or {})}]"
        except Exception:
            # Conservative: the whole kind's limit, never none (and never lost).
            logger.exception("pulse: %s of %s failed: the task waits for the unpartitioned "
                             "limit instead", option, task.name)
            return base

    def fixed_needs(self, task: Any, routing_key: str | None) -> tuple[Permit, ...] | None:
        """The permits every request of ``task`` by this routing key needs, known before
        its body is read (so its start can be folded into its reservation); None where
        a key function makes them depend on the arguments."""
        cache = (task.name, routing_key)
        if cache not in self._fixed:
            keyed = (_keyer(task) is not None
                     or _keyer(task, "pulse_rate_limit_key") is not None)
            self._fixed[cache] = None if keyed else self.needs(task, (), {}, routing_key)
        return self._fixed[cache]

    def needs(self, task: Any, args: Any, kwargs: Any, routing_key: str | None
              ) -> tuple[Permit, ...]:
        """The permits one request of ``task`` needs to start."""
        out: list[Permit] = []
        limit = self._task_limit(task)
        if limit is not None:
            key = self._partitioned(TASK_PREFIX + task.name, task, "pulse_concurrency_key",
                                    args, kwargs)
            out.append(Permit(_key(key), limit))
        if routing_key is not None and routing_key in self.queues:
            out.append(Permit(_key(QUEUE_PREFIX + routing_key), self.queues[routing_key]))
        rate = self._task_rate(task)
        if rate is not None:
            key = self._partitioned(RATE_PREFIX + TASK_PREFIX + task.name, task,
                                    "pulse_rate_limit_key", args, kwargs)
            out.append(Permit(_key(key), rate[0], rate[1]))
        if routing_key is not None and routing_key in self.queue_rates:
            count, window = self.queue_rates[routing_key]
            out.append(Permit(_key(RATE_PREFIX + QUEUE_PREFIX + routing_key), count, window))
        return tuple(out)
