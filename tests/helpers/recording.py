"""A store whose calls a unit test can see, around a real one (the memory store).

What the mechanism asked for is part of what a unit test checks ("a stopped elector
never campaigns again": no call at all). :class:`Recorded` forwards every attribute to
the store it wraps and notes each call, as the store would have received it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_pulse.store.memory import MemoryStore
from tests.helpers.clock import FakeClock

#: Reads of the store clock are not calls the mechanism makes of its own accord.
_UNRECORDED = frozenset({"now"})


class Recorded:
    """``store``, recording: ``calls`` (method names, in order) and ``releases``
    (``(key, token)`` of each ``release_leader``). ``latency`` seconds pass on ``clock``
    while ``try_acquire`` runs (its answer arrives after the request left)."""

    def __init__(self, store: MemoryStore, clock: FakeClock) -> None:
        self.store = store
        self.clock = clock
        self.calls: list[str] = []
        self.releases: list[tuple[str, str]] = []
        self.latency = 0.0

    @property
    def down(self) -> bool:
        return self.store.down

    @down.setter
    def down(self, value: bool) -> None:
        self.store.down = value

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name.startswith("_") or name in _UNRECORDED or not callable(attr):
            return attr
        return self._recording(name, attr)

    def _recording(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == "try_acquire" and not self.store.down:
                self.clock.advance(self.latency)
            result = method(*args, **kwargs)
            if name == "release_leader":  # one the store took (up), whatever its answer
                self.releases.append((args[0], args[1]))
            return result
        return call
