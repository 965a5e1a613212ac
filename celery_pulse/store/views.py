"""What operators read of the store, as rules every store shares: a claim query's
validation and its keyset cursor, a message's argument summary, why a claim waits for a
human, what a claim that moved on is now, and a claim as the JSON they read (Flower's
API, ``pulse review show --json``).

Pages list claims newest first, ``(created_at, task_id)`` descending. A cursor is that
pair of the last row shown, so the next page starts strictly after it, whatever was
inserted meanwhile: no offset, no row seen twice (the opaque text is base64 of JSON,
its float kept exact). No storage here: the memory and the SQL stores both call these.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from typing import Any

from celery_pulse.errors import InvalidConfig
from celery_pulse.store.pages import MAX_PAGE, ClaimDetail, ClaimQuery
from celery_pulse.store.records import CLAIM_STATES, FAILED, NEEDS_REVIEW, ClaimInfo
from celery_pulse.timefmt import iso

#: The states a review listing may ask for: those ``review retry`` takes.
REVIEWABLE_STATES = (NEEDS_REVIEW, FAILED)
#: Longest argument summary kept (``argsrepr kwargsrepr``).
SUMMARY_CHARS = 200


def check_query(query: ClaimQuery, states: tuple[str, ...] = CLAIM_STATES
                ) -> tuple[float, str] | None:
    """Raise :class:`InvalidConfig` naming the valid values for an unknown state, a
    limit out of range or a cursor this module did not write; the cursor's position."""
    unknown = [s for s in query.states if s not in states]
    if unknown:
        raise InvalidConfig(f"unknown claim state {unknown[0]!r}: valid states are "
                            f"{', '.join(states)}", setting="state")
    if isinstance(query.limit, bool) or not isinstance(query.limit, int) \
            or not 1 <= query.limit <= MAX_PAGE:
        raise InvalidConfig(f"limit must be an integer from 1 to {MAX_PAGE}, got "
                            f"{query.limit!r}", setting="limit")
    for name in ("queue", "task_name", "worker"):
        value = getattr(query, name)
        if value is not None and not isinstance(value, str):
            raise InvalidConfig(f"{name} must be a string, got {value!r}", setting=name)
    return None if query.after is None else decode_cursor(query.after)


def encode_cursor(created_at: float, task_id: str) -> str:
    """The cursor of a page ending at the claim ``(created_at, task_id)``."""
    raw = json.dumps([created_at, task_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """The position :func:`encode_cursor` wrote; :class:`InvalidConfig` for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, task_id = json.loads(raw)
        if isinstance(created_at, (int, float)) and not isinstance(created_at, bool) \
                and isinstance(task_id, str):
            return float(created_at), task_id
    except (ValueError, TypeError, binascii.Error):
        pass
    raise InvalidConfig(f"invalid page cursor {cursor[:40]!r}: pass the `next` of a "
                        f"previous page, or none for the first page", setting="after")


def args_summary(headers: str) -> str:
    """``argsrepr kwargsrepr`` of a message's headers (JSON text), at most 200 characters."""
    try:
        parsed: Any = json.loads(headers)
        summary = f"{parsed.get('argsrepr', '')} {parsed.get('kwargsrepr', '')}".strip()
    except (ValueError, AttributeError, TypeError):
        summary = "<unreadable headers>"
    return summary[:SUMMARY_CHARS]


def review_reason(outcome: str | None, error: str | None, holder: str | None, epoch: int,
                  max_attempts: int) -> str:
    """Why a claim waits for a human, from its row.

    Recover's move leaves outcome ``unknown`` under the next epoch (the lost attempt's is
    one less); a spent budget ``exhausted``; a completion its own outcome and error.
    """
    if outcome == "unknown":
        return (f"holder {holder or '?'} lost its lease at epoch {epoch - 1} after it "
                f"started; outcome unknown")
    if outcome == "exhausted":
        return f"budget of {max_attempts} attempts exhausted"
    if error:
        return error.strip().splitlines()[-1][:SUMMARY_CHARS] if error.strip() else error
    return f"holder {holder or '?'} reported {outcome or 'no outcome'} at epoch {epoch}"


def moved_message(task_id: str, state: str, epoch: int,
                  last: tuple[str, str | None, str, float] | None) -> str:
    """What a claim that moved on is now, for :class:`~celery_pulse.errors.Moved`;
    ``last`` is its latest review decision ``(action, outcome, decided_by, decided_at)``."""
    text = f"task {task_id} is {state} at epoch {epoch}"
    if last is not None:
        action, outcome, who, at = last
        done = "retried" if action == "retry" else f"resolved {outcome or ''}".strip()
        text += f" ({done} by {who} at {iso(at)})"
    return text + ": nothing was changed"


def claim_row(claim: ClaimInfo) -> dict[str, Any]:
    """A claim as JSON, its lease's remaining seconds to the millisecond."""
    row = dataclasses.asdict(claim)
    row["lease_remaining"] = (None if claim.lease_remaining is None
                              else round(claim.lease_remaining, 3))
    return row


def detail_row(detail: ClaimDetail) -> dict[str, Any]:
    """One claim as a reviewer judges it: the claim, the late outcomes of its stale
    attempts (``evidence``: result or error, at their epoch) and the review decisions."""
    return {"claim": claim_row(detail.claim), "retries": detail.retries,
            "args_summary": detail.args_summary,
            "evidence": [dataclasses.asdict(e) for e in detail.evidence],
            "reviews": [dataclasses.asdict(r) for r in detail.reviews],
            "checkpoint": None if detail.checkpoint is None else dataclasses.asdict(
                detail.checkpoint)}
