"""Concurrency permits of a remote worker's start: the worker asks, the gateway decides.

The rules, before any code:

* **Asked by the worker, as a direct worker takes them.** A gateway worker computes the
  permits of a start as a direct worker does (``pulse_concurrency``,
  ``pulse_concurrency_key``, ``pulse_concurrency_limits``) and sends them in
  ``task.start``; the gateway takes them in the statement that starts the attempt, and
  a start that finds no free permit is answered ``WAITING`` (held, renewed, not run).
* **Only the attempt's own keys.** A permit names the attempt's task (``task:NAME``, or
  ``task:NAME[PARTITION]`` for a keyed limit) or the instance's queue (``queue:NAME``);
  a rate (one with a window: ``pulse_rate_limit``) the same behind ``rate:``.
  Any other key would let one queue's credential count against, or raise, another
  queue's limit: it is refused ``FORBIDDEN`` (and the worker's session ends).
* **The gateway's configuration is the operator's word.** Where the gateway's own
  ``pulse_concurrency_limits`` / ``pulse_rate_limits`` (or a task option its app
  registered) names the task or the queue, its limit replaces the one asked, so a
  worker can't raise a limit the operator set; a start that leaves out a permit the
  gateway requires is refused ``FORBIDDEN`` naming the setting (the worker must be
  configured as the gateway is), never run unlimited.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_pulse.gateway.protocol import Code, PermitAsk, ProtocolError
from celery_pulse.limits import QUEUE_PREFIX, RATE_PREFIX, TASK_PREFIX, rate_limit
from celery_pulse.store.base import Permit

#: A limit: ``(count, window seconds)``, the window None for a concurrency limit.
Limit = tuple[int, float | None]


def _base(key: str, task_key: str) -> str:
    """The unpartitioned key a permit belongs to (``task:NAME[x]`` -> ``task:NAME``)."""
    return task_key if key.startswith(task_key + "[") else key


class StartPermits:
    """Which permits a remote start takes (see the module's rules)."""

    def __init__(self, limits: Mapping[str, int] | None = None, app: Any = None,
                 rates: Mapping[str, tuple[int, float]] | None = None) -> None:
        #: Base key -> limit, as the gateway's settings name them.
        self.named: dict[str, Limit] = {}
        for name, count in (limits or {}).items():
            self.named[name if name.startswith(QUEUE_PREFIX) else TASK_PREFIX + name] = (
                count, None)
        for name, (count, window) in (rates or {}).items():
            base = name if name.startswith(QUEUE_PREFIX) else TASK_PREFIX + name
            self.named[RATE_PREFIX + base] = (count, window)
        self.app = app

    def _options(self, task_name: str) -> dict[str, Limit]:
        """The task options the gateway's app registered for the task, as base keys."""
        task = None if self.app is None else self.app.tasks.get(task_name)
        out: dict[str, Limit] = {}
        option = getattr(task, "pulse_concurrency", None)
        if isinstance(option, int) and not isinstance(option, bool) and option >= 1:
            out[TASK_PREFIX + task_name] = (option, None)
        rate = getattr(task, "pulse_rate_limit", None)
        if rate is not None:
            count, window = rate_limit(task_name, rate, "pulse_rate_limit")
            out[RATE_PREFIX + TASK_PREFIX + task_name] = (count, window)
        return out

    def required(self, queue: str, task_name: str) -> dict[str, Limit]:
        """The gateway's own limits on a start of ``task_name`` from ``queue``: base
        key -> ``(count, window)`` (the settings override the options)."""
        out = self._options(task_name)
        for base in (TASK_PREFIX + task_name, QUEUE_PREFIX + queue,
                     RATE_PREFIX + TASK_PREFIX + task_name, RATE_PREFIX + QUEUE_PREFIX + queue):
            if base in self.named:
                out[base] = self.named[base]
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
            rated = ask.key.startswith(RATE_PREFIX)
            own = RATE_PREFIX + task_key if rated else task_key
            base = _base(ask.key, own)
            if base not in ((RATE_PREFIX + task_key, RATE_PREFIX + queue_key) if rated
                            else (task_key, queue_key)):
                raise ProtocolError(Code.FORBIDDEN, f"permit {ask.key[:80]!r} is neither this "
                                    f"attempt's task's nor its queue's")
            if rated != (ask.window_ms is not None):
                raise ProtocolError(Code.FORBIDDEN, f"permit {ask.key[:80]!r}: a rate (rate:) "
                                    f"and only a rate carries window_ms")
            covered.add(base)
            count, window = required.get(base, (
                ask.limit, None if ask.window_ms is None else ask.window_ms / 1000))
            out.append(Permit(ask.key, count, window))
        missing = sorted(set(required) - covered)
        if missing:
            raise ProtocolError(Code.FORBIDDEN, f"the gateway's limits "
                                f"(pulse_concurrency_limits, pulse_rate_limits, or the "
                                f"task's options) require permit {missing[0][:80]!r} for "
                                f"this start: configure the worker as the gateway is")
        return tuple(out)
