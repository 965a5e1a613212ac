"""Celery's ``on_ack``/``on_reject`` of a leased request, bound to its claim.

The message was acknowledged to the broker at reservation; what Celery says through
these callbacks is how it ends the request (:meth:`Exits.verdict
<celery_pulse.worker.ports.Exits.verdict>`). The binding is also how the pool finds the
claim of a request (:func:`bound_claim`), never by task id alone.

Celery also counts these callbacks: after a broker reconnect it lowers the prefetch count
(``worker_enable_prefetch_count_reduction``) and raises it one step per request it
acknowledges or rejects among those it received since, by a step chained on the
``ack``/``reject`` it hands the strategy. The intake hands the strategy these verdicts
instead, so they take that step (:func:`restore_prefetch`), or the count would stay
lowered for good.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_pulse.leases import LocalClaim
from celery_pulse.worker.ports import Exits

logger = logging.getLogger(__name__)


class CeleryVerdict:
    """Celery's ``on_ack`` (``kind`` "ack") or ``on_reject`` ("reject") for one request.

    An ``ack`` before the job reached the pool means Celery dropped it (revoked or
    expired); a ``reject`` says requeue or drop.
    """

    __slots__ = ("claim", "consumer", "exits", "kind")

    def __init__(self, exits: Exits, claim: LocalClaim, kind: str,
                 consumer: Any = None) -> None:
        self.exits = exits
        self.claim = claim
        self.kind = kind
        # As Celery chains its step: only on requests received while the count is lowered.
        self.consumer = None if getattr(consumer, "_maximum_prefetch_restored", True) else consumer

    def __call__(self, _logger: Any = None, _errors: Any = None, requeue: bool = False) -> None:
        self.exits.verdict(self.claim, self.kind, requeue)
        restore_prefetch(self.consumer)


def restore_prefetch(consumer: Any) -> None:
    """One step of Celery's own restoration of the prefetch count after a reconnect.

    Celery's consumer does it in ``_restore_prefetch_count_after_connection_restart``
    (up by ``worker_prefetch_multiplier``, never above ``concurrency x multiplier``; a
    no-op once restored or with the reduction off). It runs on the consumer's loop,
    where Celery calls ``on_ack``/``on_reject``. A failure (the channel is gone again)
    must not end the request: the next reconnect sets the count anew.
    """
    if consumer is None or getattr(consumer, "_maximum_prefetch_restored", True):
        return
    step = getattr(consumer, "_restore_prefetch_count_after_connection_restart", None)
    if step is None:
        return
    try:
        step(None)
    except Exception as exc:
        logger.debug("pulse: could not restore the prefetch count: %r", exc)


def bound_claim(request: Any) -> LocalClaim | None:
    """The claim a Celery request was created for (None: not a leased request)."""
    verdict = getattr(request, "_on_ack", None)
    return verdict.claim if isinstance(verdict, CeleryVerdict) else None
