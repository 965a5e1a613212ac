"""The memory store's tables: one mutable row class per SQL table, and their holder.

The rows mirror the SQL store's columns (:mod:`celery_pulse.store.sql.tables`) by name,
so a contract test that reads a row directly reads the same fields on either store. The
message's mappings are kept as the SQL store keeps them, JSON text (sorted keys, values
JSON cannot hold as their ``str``): a memory store re-publishes what a SQL one would.
Only :class:`~celery_pulse.store.memory.MemoryStore` writes these, under its lock;
tests may read them (and, to stage what no contract call can, change them).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from celery_pulse.store.records import ScheduleRow

#: Built once, as the SQL store encodes a message's headers, properties and delivery info.
_ENCODER = json.JSONEncoder(sort_keys=True, default=str)


def dumps(value: Any) -> str:
    """A mapping as the store keeps it (JSON text, keys sorted)."""
    return _ENCODER.encode(dict(value))


def new_token() -> str:
    """A fresh credential: 128 bits of randomness, as 32 hex digits."""
    return secrets.token_hex(16)


@dataclasses.dataclass(slots=True)
class WorkerRow:
    token: str
    labels: dict[str, Any]
    registered_at: float
    last_heartbeat: float
    expires_at: float
    draining: bool = False


@dataclasses.dataclass(slots=True)
class ClaimRow:
    """One task's claim (``pulse_claims``)."""

    task_id: str
    task_name: str
    state: str
    holder: str | None
    token: str | None
    epoch: int
    lease_until: float | None
    attempts: int
    max_attempts: int
    policy: str
    retries: int
    body: bytes
    headers: str
    properties: str
    delivery_info: str
    content_type: str
    content_encoding: str
    publication: str | None
    created_at: float
    reserved_at: float | None
    started_at: float | None = None
    finished_at: float | None = None
    outcome: str | None = None
    error: str | None = None
    queue: str | None = None
    #: The latest checkpoint (JSON), the attempt and its write that made it, when.
    checkpoint: str | None = None
    checkpoint_epoch: int | None = None
    checkpoint_seq: int | None = None
    checkpoint_at: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class EvidenceRow:
    """A stale completion, kept for the record, never authoritative (``pulse_evidence``)."""

    task_id: str
    epoch: int
    holder: str
    outcome: str
    error: str | None
    recorded_at: float
    result: str | None = None  # what the stale attempt returned, as Celery shows it


@dataclasses.dataclass(frozen=True, slots=True)
class ReviewRow:
    """A human decision on a task (``pulse_reviews``), for audit."""

    task_id: str
    action: str
    outcome: str | None
    note: str | None
    decided_by: str
    decided_at: float


@dataclasses.dataclass(slots=True)
class PermitRow:
    max_running: int
    updated_at: float
    window_s: float | None = None


@dataclasses.dataclass(slots=True)
class HoldRow:
    """A claim's relation to a permit key under one epoch (``pulse_permit_holds``):
    ``held`` while it runs with the permit, not held while it waits for it."""

    epoch: int
    held: bool


@dataclasses.dataclass(slots=True)
class ResultRow:
    """A value of the ``pulse://`` backend's table (``pulse_results``)."""

    value: bytes | None
    counter: int | None
    #: The backend's state of the value; a counter's nonce for a counter.
    state: str | None
    updated_at: float
    expires_at: float | None


@dataclasses.dataclass(slots=True)
class LeaderRow:
    holder: str
    token: str
    epoch: int
    lease_until: float
    acquired_at: float


@dataclasses.dataclass(slots=True)
class SlotRow:
    entry: str
    due_at: float
    task_id: str
    task: str
    payload: str
    leader_epoch: int
    created_at: float
    published_at: float | None = None


@dataclasses.dataclass(slots=True)
class Tables:
    """Every table of one memory store, keyed as the SQL tables' primary keys."""

    workers: dict[str, WorkerRow] = dataclasses.field(default_factory=dict)
    drains: set[str] = dataclasses.field(default_factory=set)
    claims: dict[str, ClaimRow] = dataclasses.field(default_factory=dict)
    evidence: list[EvidenceRow] = dataclasses.field(default_factory=list)
    reviews: list[ReviewRow] = dataclasses.field(default_factory=list)
    permits: dict[str, PermitRow] = dataclasses.field(default_factory=dict)
    #: ``(key, task_id) -> hold``.
    holds: dict[tuple[str, str], HoldRow] = dataclasses.field(default_factory=dict)
    #: ``(key, task_id, epoch) -> started_at``: starts a rate limit granted.
    rate_starts: dict[tuple[str, str, int], float] = dataclasses.field(default_factory=dict)
    results: dict[str, ResultRow] = dataclasses.field(default_factory=dict)
    leaders: dict[str, LeaderRow] = dataclasses.field(default_factory=dict)
    #: ``(entry, due_at) -> slot``.
    slots: dict[tuple[str, float], SlotRow] = dataclasses.field(default_factory=dict)
    #: ``entry -> last_run_at``.
    beat_state: dict[str, float] = dataclasses.field(default_factory=dict)
    schedule: dict[str, ScheduleRow] = dataclasses.field(default_factory=dict)
