"""Concurrency permits of a remote worker's start: the worker asks, the gateway decides.

The rules, before any code:

* **Asked by the worker, as a direct worker takes them.** A gateway worker computes the
  permits of a start as a direct worker does (``pulse_concurrency``,
  ``pulse_concurrency_key``, ``pulse_concurrency_limits``) and sends them in
  ``task.start``; the gateway takes them in the statement that starts the attempt, and
  a start that finds no free permit is answered ``WAITING`` (held, renewed, not run).
* **Only the attempt's own keys.** A permit names the attempt's task (``task:NAME``, or
  ``task:NAME[PARTITION]`` for a keyed limit) or the instance's queue (``queue:NAME``).
  Any other key would let one queue's credential count against, or raise, another
  queue's limit: it is refused ``FORBIDDEN`` (and the worker's session ends).
* **The gateway's configuration is the operator's word.** Where the gateway's own
  ``pulse_concurrency_limits`` (or a task option its app registered) names the task or the
  queue, its limit replaces the one asked, so a worker can't raise a limit the operator
  set; a start that leaves out a permit the gateway requires is refused ``FORBIDDEN``
  naming the setting (the worker must be configured as the gateway is), never run
  unlimited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_pulse.gateway.protocol import Code, PermitAsk, ProtocolError
from celery_pulse.store.base import Permit

QUEUE_PREFIX = "queue:"
TASK_PREFIX = "task:"


def _base(key: str, task_key: str) -> str:
    """The unpartitioned key a permit belongs to (``task:NAME[x]`` -> ``task:NAME``)."""
    return task_key if key.startswith(task_key + "[") else key


class StartPermits:
    """Which permits a remote start takes (see the module's rules)."""

    def __init__(self, limits: Mapping[str, int] | None = None, app: Any = None) -> None:
        limits = dict(limits or {})
        self.tasks = {k: v for k, v in limits.items() if not k.startswith(QUEUE_PREFIX)}
        self.queues = {k[len(QUEUE_PREFIX):]: v for k, v in limits.items()
                       if k.startswith(QUEUE_PREFIX)}
        self.app = app

    def _task_limit(self, name: str) -> int | None:
        limit = self.tasks.get(name)
        if limit is None and self.app is not None:
            task = self.app.tasks.get(name)
            option = getattr(task, "pulse_concurrency", None)
            if isinstance(option, int) and not isinstance(option, bool) and option >= 1:
                limit = option
        return limit

    def required(self, queue: str, task_name: str) -> dict[str, int]:
        """The gateway's own limits on a start of ``task_name`` from ``queue``."""
        out: dict[str, int] = {}
        limit = self._task_limit(task_name)
        if limit is not None:
            out[TASK_PREFIX + task_name] = limit
        if queue in self.queues:
            out[QUEUE_PREFIX + queue] = self.queues[queue]
        return out

    def decide(self, queue: str, task_name: str, asked: Sequence[PermitAsk]
               ) -> tuple[Permit, ...]:
        """The permits the start takes; ``FORBIDDEN`` for a key not the attempt's own, or
        a permit the gateway requires and the worker left out."""
        task_key, queue_key = TASK_PREFIX + task_name, QUEUE_PREFIX + queue
        required = self.required(queue, task_name)
        out: list[Permit] = []
        covered: set[str] = set()
        for ask in asked:
            base = _base(ask.key, task_key)
            if base not in (task_key, queue_key):
                raise ProtocolError(Code.FORBIDDEN, f"permit {ask.key[:80]!r} is neither this "
                                    f"attempt's task's nor its queue's")
            covered.add(base)
            out.append(Permit(ask.key, required.get(base, ask.limit)))
        missing = sorted(set(required) - covered)
        if missing:
            raise ProtocolError(Code.FORBIDDEN, f"the gateway's concurrency limits "
                                f"(pulse_concurrency_limits, pulse_concurrency) require "
                                f"permit {missing[0][:80]!r} for this start: configure "
                                f"the worker as the gateway is")
        return tuple(out)
