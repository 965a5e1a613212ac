"""The I/O shapes a store may hand back: an exchange in flight on a socket, and the
channel on which workers announce permits given back.

Structural types (:class:`typing.Protocol`): the SQL store's pipeline and its
``LISTEN``/``NOTIFY`` connection satisfy them; the mechanism drives them without knowing
what is behind them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from celery_pulse.store.records import Exchanged


class PermitSignals(Protocol):
    """Announcements that permits of some keys were given back (a hint, never a grant)."""

    def send(self, keys: Sequence[str]) -> None: ...

    def receive(self, timeout: float) -> set[str]:
        """Keys announced since the last call, waiting up to ``timeout`` for one."""


class InFlightIO(Protocol):
    """The socket side of an exchange in flight (see :class:`PendingExchange`)."""

    @property
    def fileno(self) -> int:
        """The connection's socket: step when it is readable."""
        ...

    @property
    def writing(self) -> bool:
        """Some of the request is not sent yet: :meth:`send_more` soon, readable or not."""
        ...

    @property
    def done(self) -> bool: ...

    def step(self) -> bool:
        """Send what is left and read what came, never blocking; True once all is in."""
        ...

    def send_more(self) -> bool:
        """Send what is left of the request, never blocking, reading nothing; True while
        some of it is still unsent."""
        ...

    def wait(self, timeout: float | None) -> None:
        """Block until all is in (the store's error after ``timeout`` seconds)."""
        ...

    def abandon(self) -> None:
        """Give up on the answer (its effect unknown): the connection is dropped."""
        ...


class PendingExchange(Protocol):
    """An exchange sent by :meth:`ClaimStore.begin_exchange`, its answer not read yet.

    If :attr:`flight` (or :meth:`finish`) raises the store's error, none of the
    operations is known to have taken effect, as when :meth:`ClaimStore.exchange` raises.
    """

    @property
    def flight(self) -> InFlightIO:
        """The exchange's socket side."""
        ...

    def finish(self, *, blocking: bool) -> Exchanged | None:
        """The answers, once :attr:`flight` is done. Answering some of them may need a
        read of its own (rare: a stale completion, a refused reservation): with
        ``blocking`` False that is left undone and None returned, to be called again
        where blocking is allowed."""
        ...

