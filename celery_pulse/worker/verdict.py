"""Celery's ``on_ack``/``on_reject`` of a leased request, bound to its claim.

The message was acknowledged to the broker at reservation; what Celery says through
these callbacks is how it ends the request (:meth:`Exits.verdict
<celery_pulse.worker.ports.Exits.verdict>`). The binding is also how the pool finds the
claim of a request (:func:`bound_claim`), never by task id alone.
"""

from __future__ import annotations

from typing import Any

from celery_pulse.leases import LocalClaim
from celery_pulse.worker.ports import Exits


class CeleryVerdict:
    """Celery's ``on_ack`` (``kind`` "ack") or ``on_reject`` ("reject") for one request.

    An ``ack`` before the job reached the pool means Celery dropped it (revoked or
    expired); a ``reject`` says requeue or drop.
    """

    __slots__ = ("claim", "exits", "kind")

    def __init__(self, exits: Exits, claim: LocalClaim, kind: str) -> None:
        self.exits = exits
        self.claim = claim
        self.kind = kind

    def __call__(self, _logger: Any = None, _errors: Any = None, requeue: bool = False) -> None:
        self.exits.verdict(self.claim, self.kind, requeue)


def bound_claim(request: Any) -> LocalClaim | None:
    """The claim a Celery request was created for (None: not a leased request)."""
    verdict = getattr(request, "_on_ack", None)
    return verdict.claim if isinstance(verdict, CeleryVerdict) else None
