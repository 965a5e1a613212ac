"""Capabilities route tasks: a delivery goes only to an instance that declared it can run it.

The rules, before any code:

* **What a worker declares.** A gateway worker's ``worker.hello`` lists the tasks it has
  registered as capabilities (``handler`` = the task's name), at most 32. A worker with
  more declares them by module (``proj.billing.*``: every task whose name starts with
  ``proj.billing.``), and one with more than 32 modules declares ``*`` (everything).
  Celery's built-in tasks (``celery.*``) every worker has.
* **What the gateway does with it.** A delivery whose task no capability of the
  instance covers is never reserved for it (its worker would fail it as unregistered, as
  Celery's does): it is kept unacknowledged for :data:`ELSEWHERE_AFTER`, then handed
  back to the broker, so an instance that can run it (a newer deploy, another pool) gets
  it. Nothing is lost while none can: it goes round, and the gateway says so once per task
  name and instance.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

#: Seconds a delivery no capability of the instance covers is kept before it goes back.
ELSEWHERE_AFTER = 1.0
#: The capability that covers every task.
EVERYTHING = "*"
#: Task names every Celery worker has (its built-ins).
BUILT_IN = "celery."


def declared(handlers: Sequence[str], most: int, longest: int) -> list[str]:
    """The capabilities a worker with these tasks declares: the names when at most
    ``most`` (each at most ``longest`` characters), else their modules (``module.*``),
    else :data:`EVERYTHING`. A worker with none of its own declares only ``celery``."""
    names = sorted({h for h in handlers if not h.startswith(BUILT_IN)})
    if not names:
        return ["celery"]
    for choice in (names, sorted({n.rpartition(".")[0] + ".*" if "." in n else n
                                  for n in names})):
        if len(choice) <= most and all(len(c) <= longest for c in choice):
            return choice
    return [EVERYTHING]


class Capabilities:
    """Which task names an instance's capabilities cover."""

    def __init__(self, handlers: Iterable[str]) -> None:
        handlers = set(handlers)
        self.everything = EVERYTHING in handlers
        self.prefixes = tuple(sorted(h[:-1] for h in handlers if h.endswith(".*")))
        self.names = frozenset(h for h in handlers if not h.endswith("*"))

    def cover(self, task_name: str) -> bool:
        return (self.everything or task_name in self.names
                or task_name.startswith(BUILT_IN) or task_name.startswith(self.prefixes))


class Elsewhere:
    """Deliveries no capability of the instance covers, until they go back to the broker."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._order = itertools.count()
        #: Task names already said to be another instance's (once each).
        self.told: set[str] = set()

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, until: float, message: Any) -> None:
        heapq.heappush(self._heap, (until, next(self._order), message))

    def due(self, now: float) -> list[Any]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def wait(self, now: float, longest: float) -> float:
        return longest if not self._heap else max(0.0, min(longest, self._heap[0][0] - now))
