"""The bodies the gateway answers with: receipts, leases, welcomes and assignments.

Protocol core (no I/O, no Celery, no SQL): given what the store and the session rules
decided, these say how pulse.worker.v1 writes it (seed 003's ``CommandResult``, its
times in RFC 3339 UTC with milliseconds, its ids and epochs as decimal strings). The
server (:mod:`celery_pulse.gateway.server`) decides; this module only spells.
"""

from __future__ import annotations

import base64
import functools
import math
from datetime import datetime, timezone
from typing import Any

from celery_pulse.gateway.protocol import AttemptRef, Finish
from celery_pulse.gateway.session import Attempt, Instance, Session
from celery_pulse.store.credentials import Credential

#: ``task.finish`` outcomes as the task's state in a receipt.
OUTCOME_STATES = {"SUCCEEDED": "SUCCEEDED", "FAILED": "FAILED", "UNKNOWN": "NEEDS_REVIEW"}
#: The store's answer to a completion, as the receipt's disposition.
DISPOSITIONS = {"applied": "APPLIED", "duplicate": "DUPLICATE", "evidence": "EVIDENCE_ONLY"}


def holder_name(credential: Credential, instance_id: str) -> str:
    """The claims' holder for an instance: who holds a task, read in ``pulse claims``."""
    return f"gw:{credential.name}:{instance_id}"


def attempt_ref(body: Any) -> AttemptRef | None:
    """The attempt a frame's body names (a finish's is inside it), if any."""
    ref = body.ref if isinstance(body, Finish) else body
    return ref if isinstance(ref, AttemptRef) else None


def attempt_key(ref: AttemptRef) -> tuple[str, str, int, str]:
    """What :meth:`Instance.attempt` looks an attempt up by."""
    return ref.task_id, ref.attempt_id, ref.epoch, ref.lease_secret


def lease_body(active: bool, state: str, lease_until: float | None, now: float
               ) -> dict[str, Any]:
    return {"active": active, "state": state,
            "lease_until": None if lease_until is None else timestamp(lease_until),
            "server_time": timestamp(now)}


def command_result(operation: str, task_state: str, attempt_state: str, attempt: Attempt,
                   lease_until: float | None, disposition: str, lease: dict[str, Any]
                   ) -> dict[str, Any]:
    """The seed's CommandResult: the operation's receipt (immutable) and the lease as
    checked now (a receipt never stands in for it)."""
    return {"receipt": {"operation": operation, "task_state": task_state,
                        "attempt_state": attempt_state, "task_revision": str(attempt.epoch),
                        "lease_until": None if lease_until is None else timestamp(lease_until),
                        "disposition": disposition},
            "lease": lease, "deduplicated": False}


def welcome_body(instance: Instance, session: Session, now: float, session_ttl: float,
                 lease_ttl: float) -> dict[str, Any]:
    """``worker.welcome`` (and the answer to ``worker.capacity``), at the store's ``now``."""
    return {"session_id": session.session_id, "epoch": str(session.epoch),
            "server_time": timestamp(now),
            "expires_at": timestamp(now + session_ttl),
            "lease_duration_ms": round(lease_ttl * 1000),
            "draining": instance.capacity.drain}


def assign_body(attempt: Attempt, message: Any, lease_ttl: float) -> dict[str, Any]:
    """``task.assign``: the Celery message as the broker delivered it, and the grant."""
    return {"task": {"id": attempt.task_id, "name": attempt.task_name,
                     "body": base64.b64encode(message.body).decode(),
                     "content_type": message.content_type,
                     "content_encoding": message.content_encoding,
                     "headers": dict(message.headers),
                     "properties": dict(message.properties),
                     "delivery_info": dict(message.delivery_info)},
            "task_id": attempt.wire_task_id, "attempt_id": attempt.attempt_id,
            "epoch": str(attempt.epoch), "lease_secret": attempt.token,
            "lease_until": timestamp(attempt.lease_until),
            "server_time": timestamp(attempt.lease_until - lease_ttl)}


def timestamp(seconds: float) -> str:
    """RFC 3339 UTC with milliseconds, as the seed writes times (``...T08:00:30.000Z``)."""
    fraction, whole = math.modf(seconds)  # rounded as datetime.fromtimestamp rounds
    micros = round(fraction * 1e6)
    if micros >= 1_000_000:
        whole, micros = whole + 1, micros - 1_000_000
    elif micros < 0:
        whole, micros = whole - 1, micros + 1_000_000
    return f"{_second(int(whole))}.{micros // 1000:03d}Z"


@functools.lru_cache(maxsize=256)
def _second(whole: int) -> str:
    """The part before the fraction (``strftime`` is a gateway's hot spot: every answer
    carries two times, most within the same few seconds)."""
    return datetime.fromtimestamp(whole, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
