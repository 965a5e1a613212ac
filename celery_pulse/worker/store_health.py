"""Whether the store answers the intake's reservations, and what the intake does while not.

A reservation the store could not take (unreachable) pauses consumption until one is
taken again: nothing is acknowledged meanwhile (the broker still owns the message), and
the delivery is tried again with a backoff doubling from :data:`FIRST_BACKOFF` up to
:data:`MAX_BACKOFF`; its retry is what finds the store back. Contention is not an outage
(the store answered, after retrying while other workers held its rows): consumption goes
on and that one delivery goes again after :data:`CONTENDED_RETRY`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery_pulse.errors import Contended, PulseError
from celery_pulse.leases import Counters, LeaseKeeper
from celery_pulse.store.base import ReserveRequest
from celery_pulse.worker.gate import ConsumeGate

# Logger name kept from before the move (operators' logging configurations name it).
logger = logging.getLogger("celery_pulse.bootsteps.intake")

#: The consume gate's reason while the store can't take reservations.
STORE_UNREACHABLE = "store unreachable"
#: Seconds before a delivery whose reservation met contention is reserved again. The
#: store already retried it (other workers held its rows meanwhile): not an outage, so
#: consumption goes on and this one delivery waits a little.
CONTENDED_RETRY = 0.05
FIRST_BACKOFF = 0.1
MAX_BACKOFF = 2.0


class StoreHealth:
    """The intake's view of the store: down (consumption paused) or answering."""

    def __init__(self, gate: Callable[[], ConsumeGate]) -> None:
        self._gate = gate
        self.down = False
        #: Seconds before a reservation the store could not take is tried again.
        self.backoff = FIRST_BACKOFF

    def failed(self, exc: PulseError) -> None:
        """A reservation could not reach the store: pause consumption, back off."""
        if not self.down:
            self.down = True
            logger.error("pulse: cannot reserve tasks (%s): not acknowledging, "
                         "pausing consumption until the store answers", exc)
            self._gate().close(STORE_UNREACHABLE)
        self.backoff = min(self.backoff * 2, MAX_BACKOFF)

    def answered(self) -> None:
        """The store answered a reservation (whatever it said): consume again."""
        self.backoff = FIRST_BACKOFF
        if self.down:
            self.down = False
            logger.warning("pulse: store reachable again: reserving")
            self._gate().open(STORE_UNREACHABLE)


def count_contention(counters: Counters, request: ReserveRequest, exc: Contended) -> None:
    """A reservation met contention in the store: counted, logged, and tried again."""
    counters.contended += 1
    logger.warning("pulse: reserving %s[%s] met contention in the store, trying again: "
                   "%s", request.task_name, request.task_id, exc)


def reserve_blocking(keeper: LeaseKeeper, request: ReserveRequest,
                     on_result: Callable[[Any, float], None], health: StoreHealth,
                     stopping: Callable[[], bool]) -> None:
    """Without an event loop: reserve inline (backpressure by blocking the consumer)."""
    while True:
        try:
            results, sent = keeper.reserve_now([request])
            on_result(results[0], sent)
            return
        except Contended as exc:
            count_contention(keeper.counters, request, exc)
            if stopping():
                return
            time.sleep(CONTENDED_RETRY)
            continue
        except PulseError as exc:
            health.failed(exc)
            if stopping():
                return
            time.sleep(health.backoff)
