"""What an operator does to a task in review, once, for every front end (CLI, Flower).

A review action is three things that must go together, in this order:

1. the store's decision (``review_retry`` / ``review_resolve``), which is the only
   authority: with ``expected_epoch`` it refuses (``Moved``) a claim that moved on since
   the operator looked, and changes nothing;
2. the Celery task events that move the task on in Flower, sent on behalf of the claim's
   last holder (so no phantom node appears): ``task-retried``, ``task-succeeded`` or
   ``task-failed`` naming who resolved it and why;
3. for a retry, the stored message re-published as it first came, then marked published
   (what Recover does for a re-dispatch). After the event, so the new attempt's events
   follow it in Flower. Should the publish fail, the claim stays ``open`` and Recover
   publishes it again once ``PUBLISH_TTL`` has passed.

Events are a view: failing to send them never undoes the decision (a WARNING says so).
Every action is logged (who, what, which task) on ``celery_pulse.operator``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from celery_pulse.errors import InvalidConfig
from celery_pulse.store.contracts import Store
from celery_pulse.store.records import FAILED, SUCCEEDED, Recovered
from celery_pulse.worker.publish import republish

logger = logging.getLogger(__name__)

#: How long a retried claim stays ``open`` waiting for its publish to be marked before
#: Recover publishes it again (the CLI's value).
PUBLISH_TTL = 60.0
OUTCOMES = (SUCCEEDED, FAILED)


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What one review action did: the task, the action, the epoch it left the claim at."""

    task_id: str
    action: str
    epoch: int
    outcome: str | None = None


def retry_review(app: Any, store: Store, task_id: str, *, who: str, note: str | None = None,
                 expected_epoch: int | None = None) -> Decision:
    """Run a task in review (or failed) once more: re-open, re-publish, mark published.

    Raises ``NotFound`` (no such claim) or ``Moved`` (it moved on) and changes nothing.
    """
    item = store.review_retry(task_id, f"review:{who}", PUBLISH_TTL, who, note,
                              expected_epoch=expected_epoch)
    # Before the re-publish: the new attempt's events (received, started, succeeded) must
    # come after this one, or Flower would file the retry over the new attempt's end.
    # Who and why as a reason, and the exception emptied: Flower keeps a task's last
    # exception through later events, and the NeedsReview that put the task in review
    # would still show on the new attempt's success.
    _send(app, item.holder, "task-retried", task_id, item,
          reason=_said("retried from review", who, note), exception="", traceback="")
    republish(app, item)
    store.mark_published([(item.task_id, item.epoch, item.token or "")])
    logger.info("pulse: review retry of %s [%s] by %s: re-published at epoch %d%s",
                item.task_name, task_id, who, item.epoch, _noted(note))
    return Decision(task_id, "retry", item.epoch)


def resolve_review(app: Any, store: Store, task_id: str, outcome: str, *, who: str,
                   note: str | None = None, expected_epoch: int | None = None) -> Decision:
    """Close a task in review as ``succeeded`` or ``failed``, by hand.

    Raises ``InvalidConfig`` for another outcome, ``NotFound`` or ``Moved`` as the store
    does, and changes nothing then.
    """
    if outcome not in OUTCOMES:
        raise InvalidConfig(f"unknown outcome {outcome!r}; valid outcomes: "
                            f"{', '.join(OUTCOMES)}")
    detail = store.claim_detail(task_id)
    holder = None if detail is None else detail.claim.holder
    store.review_resolve(task_id, outcome, who, note, expected_epoch=expected_epoch)
    epoch = 0 if detail is None else detail.claim.epoch
    name = "?" if detail is None else detail.claim.task_name
    logger.info("pulse: review resolve of %s [%s] by %s: %s%s", name, task_id, who, outcome,
                _noted(note))
    said = _said(f"resolved {outcome}", who, note)
    if outcome == SUCCEEDED:
        _send(app, holder, "task-succeeded", task_id, None, result=repr(said), runtime=0.0,
              pulse_epoch=epoch)
    else:
        _send(app, holder, "task-failed", task_id, None,
              exception=f"ResolvedFailed({said!r})", traceback="", pulse_epoch=epoch)
    return Decision(task_id, "resolve", epoch, outcome)


def _said(what: str, who: str, note: str | None) -> str:
    return f"{what} by {who}" + (f": {note}" if note else "")


def _noted(note: str | None) -> str:
    return f" (note: {note})" if note else ""


def _send(app: Any, holder: str | None, event: str, task_id: str, item: Recovered | None,
          **fields: Any) -> None:
    """One task event as the claim's last holder (Flower files it under that worker)."""
    if item is not None:
        fields.setdefault("pulse_epoch", item.epoch)
    try:
        with app.events.default_dispatcher(hostname=holder or None) as dispatcher:
            dispatcher.send(event, uuid=task_id, **fields)
    except Exception as exc:  # the decision stands; only Flower's view lags
        logger.warning("pulse: %s for %s not sent (%s: %s); the store's decision stands",
                       event, task_id, type(exc).__name__, exc)
