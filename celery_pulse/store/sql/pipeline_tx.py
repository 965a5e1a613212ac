"""A transaction in two round trips on the PostgreSQL pipeline, driven as one flight.

A start under a permit decides in Python between its two round trips (the keys locked
and counted first, then the starts written), so it is one transaction of two trips. It
used to run as its own blocking transaction after the exchange's (three trips in all,
on the committer thread, the worker's event loop waiting for it). :class:`TwoTrips`
sends the exchange's statements and the first half in one trip, then the second half
with the ``COMMIT``, and looks to its driver like one :class:`~.pipeline.InFlight`: the
event loop steps it when its socket is readable, a thread waits for it. Nothing is
committed until the second trip's ``COMMIT``; any failure closes the connection, which
rolls the transaction back on the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from celery_pulse.store.sql.pipeline import COMMIT, InFlight, Pipeline

Statement = tuple[str, Sequence[Any]]
Rows = list[list[tuple[Any, ...]]]


class TwoTrips:
    """``first``'s rows decide the statements ``then`` returns, which go out with the
    ``COMMIT``; :meth:`rows` gives both trips' rows, in order (the ``COMMIT``'s left
    out). Made by :meth:`begin` (blocking for the pipeline) or :meth:`begin_now`."""

    def __init__(self, flight: InFlight, then: Callable[[Rows], Sequence[Statement]]) -> None:
        self._flight = flight
        self._then: Callable[[Rows], Sequence[Statement]] | None = then
        self._first: Rows = []
        self._rows: Rows | None = None

    @classmethod
    def begin(cls, pipeline: Pipeline, where: str, first: Sequence[Statement],
              then: Callable[[Rows], Sequence[Statement]]) -> TwoTrips:
        return cls(pipeline.begin(where, first, opens=True), then)

    @classmethod
    def begin_now(cls, pipeline: Pipeline, where: str, first: Sequence[Statement],
                  then: Callable[[Rows], Sequence[Statement]]) -> TwoTrips | None:
        """None where taking the pipeline could block (see :meth:`Pipeline.begin_now`)."""
        flight = pipeline.begin_now(where, first, opens=True)
        return None if flight is None else cls(flight, then)

    # -- what an InFlight offers its driver ---------------------------------------------
    @property
    def fileno(self) -> int:
        return self._flight.fileno

    @property
    def writing(self) -> bool:
        return self._flight.writing

    @property
    def done(self) -> bool:
        return self._then is None and self._flight.done

    def step(self) -> bool:
        """Read what arrived (never blocks); at the first trip's end, send the second."""
        if self._flight.step() and self._then is not None:
            self._second()
        return self.done

    def send_more(self) -> bool:
        return self._flight.send_more()

    def wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._flight.wait(timeout)
        if self._then is not None:
            self._second()
            self._flight.wait(None if deadline is None
                              else max(0.0, deadline - time.monotonic()))

    def abandon(self) -> None:
        self._flight.abandon()

    def rows(self) -> Rows:
        """Both trips' rows, once :attr:`done` (raises the store's error if it failed)."""
        if self._rows is None:
            assert self.done, "rows() before the transaction ended"
            self._rows = [*self._first, *self._flight.rows()[:-1]]
        return self._rows

    def _second(self) -> None:
        then, self._then = self._then, None
        assert then is not None
        first = self._flight.rows(keep=True)  # (a failure closes the connection)
        try:
            statements = [*then(first), (COMMIT, ())]
        except BaseException:
            self._flight.abandon()
            raise
        self._first = first
        self._flight = self._flight.follow(self._flight.where, statements)
