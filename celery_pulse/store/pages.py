"""The records of what operators read: a filter over claims, one page of them, and one
claim in detail (:meth:`~celery_pulse.store.contracts.ClaimStore.find_claims`,
:meth:`~celery_pulse.store.contracts.ClaimStore.claim_detail`). No behaviour: the rules
they follow (validation, the cursor) are :mod:`celery_pulse.store.views`'.
"""

from __future__ import annotations

import dataclasses

from celery_pulse.store.checkpoints import Checkpoint
from celery_pulse.store.records import ClaimInfo


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimQuery:
    """A filter over claims and one page of them (:meth:`ClaimStore.find_claims`): exact
    filters, combined with AND; ``states`` any of :data:`CLAIM_STATES` (``()``: all);
    ``after`` the opaque cursor of the previous page's ``next``."""

    states: tuple[str, ...] = ()
    queue: str | None = None
    task_name: str | None = None
    worker: str | None = None  # the holder, exact
    limit: int = 50  # rows per page, 1..MAX_PAGE
    after: str | None = None


MAX_PAGE = 500


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimPage:
    """One page of claims, newest first (``created_at`` desc, then ``task_id`` desc)."""

    rows: list[ClaimInfo]
    next: str | None  # the cursor of the next page (ClaimQuery.after); None at the end
    total: int  # claims matching the filter, on every page
    now: float  # the store clock when the page was read


@dataclasses.dataclass(frozen=True, slots=True)
class EvidenceRow:
    """A stale attempt's completion, kept for the record (never authoritative)."""

    epoch: int
    holder: str
    outcome: str
    error: str | None
    recorded_at: float
    #: What the stale attempt returned, as Celery shows it (its repr; None: a failure, a
    #: row kept before pulse recorded it, or a remote worker's).
    result: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class AuditRow:
    """A human decision on a claim (``review retry`` / ``review resolve``)."""

    action: str
    outcome: str | None
    note: str | None
    decided_by: str
    decided_at: float


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimDetail:
    """One claim with what an operator needs to judge it (:meth:`ClaimStore.claim_detail`)."""

    claim: ClaimInfo
    retries: int  # Celery's ``retries`` of the message the claim holds
    args_summary: str  # ``argsrepr kwargsrepr`` from its headers, at most 200 characters
    evidence: list[EvidenceRow]  # stale completions, oldest first
    reviews: list[AuditRow]  # review decisions, oldest first
    checkpoint: Checkpoint | None = None  # the last one an attempt committed
