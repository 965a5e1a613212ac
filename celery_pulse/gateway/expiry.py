"""Deliveries past Celery's ``expires`` (or revoked), ended at the gateway, never assigned.

Seed 003 §5: a task still waiting past its deadline ends; it is not dispatched. Celery's
deadline is the message's ``expires`` header, and a Celery worker judges it on receipt,
by its own clock, marking the task ``REVOKED`` ("expired") without running it. The
gateway judges it the same way, after reserving the delivery and before assigning it:

* A remote worker told to run an expired task would decline it, and its finish of an
  attempt it never started is evidence only (seed 003 §4): the claim would stay
  reserved, expire, and be dispatched again by Recover at every lease expiry, its result
  ``PENDING`` for good.
* So the gateway ends the claim ``revoked`` (the store's completion of the reservation it
  holds, fenced as any) and writes Celery's ``REVOKED`` to the app's result backend, in
  the completion's transaction when the backend is the store's (``pulse://``). A task
  that expires after it was assigned comes back through Recover and ends here then.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from celery_pulse.deferral import carried_by_completions, deferred_result
from celery_pulse.errors import PulseError
from celery_pulse.gateway.session import Attempt
from celery_pulse.store.base import REVOKED, Completion, Store

logger = logging.getLogger(__name__)

#: The reasons stored with the task's ``TaskRevokedError``, as a Celery worker writes
#: them; the claim keeps "<reason> before it ran".
EXPIRED, REVOKED_REASON = "expired", "revoked"


def expired(headers: Mapping[str, Any], tz: Any, now: datetime | None = None) -> bool:
    """Whether a delivery's ``expires`` has passed, as Celery's worker decides it: an
    ISO 8601 time, naive ones in the app's ``timezone`` (``tz``). A value Celery could not
    read is not judged here: the remote worker's Celery refuses the message as invalid."""
    value = headers.get("expires")
    if value is None:
        return False
    from celery.utils.time import maybe_iso8601, maybe_make_aware

    try:
        deadline = maybe_make_aware(maybe_iso8601(value), tz)
    except (AttributeError, ValueError, TypeError):
        return False
    return bool((now or datetime.now(timezone.utc)) > deadline)


class NeverRun:
    """Ends reservations of one holder that must not run: expired ones here, revoked ones
    (:mod:`.revokes`) the same way (blocking: call it from a thread)."""

    def __init__(self, app: Any, store: Store, holder: str) -> None:
        self.app, self.store, self.holder = app, store, holder
        self._carried: bool | None = None

    def end(self, attempts: Sequence[Attempt], reason: str = EXPIRED) -> list[Attempt]:
        """Each attempt's claim ``revoked`` and its result ``REVOKED`` (see the rules);
        those the store ended (the others had started, or ended, meanwhile)."""
        backend: Any = getattr(self.app, "backend", None)
        if self._carried is None:
            url = getattr(self.store, "url", None)
            self._carried = (backend is not None and url is not None
                             and carried_by_completions(backend, url))
        completions = []
        for attempt in attempts:
            record = None
            if self._carried and backend is not None:
                with deferred_result(attempt.task_id) as deferral:
                    backend.mark_as_revoked(attempt.task_id, reason)
                record = deferral.record
            completions.append(Completion(attempt.task_id, attempt.epoch, attempt.token,
                                          REVOKED, f"{reason} before it ran", record))
        try:
            answers = self.store.complete(self.holder, completions)
        except PulseError as exc:  # the leases expire; Recover brings them back here
            logger.warning("pulse gateway: could not end %d %s task(s) (%s)",
                           len(attempts), reason, exc)
            return []
        ended = []
        for attempt in attempts:
            applied = answers.get(attempt.task_id) == "applied"
            logger.info("pulse gateway: %s[%s] %s before it ran: revoked%s",
                        attempt.task_name, attempt.task_id, reason,
                        "" if applied else " (not: it had started or ended)")
            if applied:
                ended.append(attempt)
            if applied and backend is not None and not self._carried:
                try:
                    backend.mark_as_revoked(attempt.task_id, reason)
                except Exception as exc:  # the claim is settled; the result is lost: say so
                    logger.warning("pulse gateway: result of %s %s not stored: %r",
                                   reason, attempt.task_id, exc)
        return ended
