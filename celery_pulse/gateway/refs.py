"""The frames that name an attempt: its ref (``worker.resume``, ``task.renew``, a finish's
``ref``) and ``task.start``, whose ref may carry the concurrency permits the start needs;
and ``task.query``, which names a task.

Read by :mod:`celery_pulse.gateway.frames` (whose rules apply: exact fields, ids of 32
lowercase hex, epochs as decimal strings); pure Python.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Any

from celery_pulse.gateway.protocol import (
    MAX_PERMIT_KEY,
    MAX_PERMIT_LIMIT,
    MAX_PERMITS,
    RATE_WINDOWS_MS,
    AttemptRef,
    PermitAsk,
    Start,
    TaskQuery,
)
from celery_pulse.gateway.wire import decimal, exact, identifier, integer, invalid, string

_LEASE_SECRET = re.compile(r"[A-Za-z0-9._~-]{1,128}")
REF_FIELDS = frozenset({"task_id", "attempt_id", "epoch", "lease_secret"})
PERMIT_FIELDS = frozenset({"key", "limit"})
PERMIT_OPTIONAL = frozenset({"window_ms"})
QUERY_FIELDS = frozenset({"task_id"})


def read_ref(obj: Any, path: str) -> AttemptRef:
    body = exact(obj, path, REF_FIELDS)
    lease_secret = string(body, "lease_secret", path)
    if not _LEASE_SECRET.fullmatch(lease_secret):
        invalid(f"{path}.lease_secret must be 1 to 128 URL-safe characters")
    return AttemptRef(task_id=identifier(body["task_id"], f"{path}.task_id"),
                      attempt_id=identifier(body["attempt_id"], f"{path}.attempt_id"),
                      epoch=decimal(body, "epoch", path),
                      lease_secret=lease_secret)


def read_start(obj: Any, path: str) -> Start:
    """``task.start``: an attempt ref, and optionally ``permits`` (1 to ``MAX_PERMITS``
    distinct keys of printable characters, each with its limit)."""
    permits: dict[str, PermitAsk] = {}
    if isinstance(obj, dict) and "permits" in obj:
        raw, obj = obj["permits"], {k: v for k, v in obj.items() if k != "permits"}
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_PERMITS:
            invalid(f"{path}.permits must be a list of 1 to {MAX_PERMITS} entries")
        for index, item in enumerate(raw):
            where = f"{path}.permits[{index}]"
            entry = exact(item, where, PERMIT_FIELDS, PERMIT_OPTIONAL)
            key = string(entry, "key", where)
            if not (1 <= len(key) <= MAX_PERMIT_KEY and key.isprintable()) or key in permits:
                invalid(f"{where}.key must be 1 to {MAX_PERMIT_KEY} printable characters, "
                        f"each key once")
            window = None
            if "window_ms" in entry:
                window = integer(entry, "window_ms", where, 1, RATE_WINDOWS_MS[-1])
                if window not in RATE_WINDOWS_MS:
                    invalid(f"{where}.window_ms must be one of {RATE_WINDOWS_MS}")
            permits[key] = PermitAsk(key, integer(entry, "limit", where, 1, MAX_PERMIT_LIMIT),
                                     window)
    ref = read_ref(obj, path)
    return Start(ref.task_id, ref.attempt_id, ref.epoch, ref.lease_secret,
                 tuple(permits.values()))

def read_query(obj: Any, path: str) -> TaskQuery:
    body = exact(obj, path, QUERY_FIELDS)
    return TaskQuery(identifier(body["task_id"], f"{path}.task_id"))


def wire_ref(ref: AttemptRef) -> dict[str, Any]:
    """A ref in its wire form (a :class:`Start`'s permits included)."""
    wire: dict[str, Any] = {"task_id": ref.task_id, "attempt_id": ref.attempt_id,
                            "epoch": str(ref.epoch), "lease_secret": ref.lease_secret}
    if isinstance(ref, Start) and ref.permits:
        wire["permits"] = [{"key": p.key, "limit": p.limit} | (
            {} if p.window_ms is None else {"window_ms": p.window_ms}) for p in ref.permits]
    return wire


def wire_task_id(task_id: str) -> str:
    """The 32-hex id the protocol names a Celery task by: its UUID's hex when it is one
    (Celery's own ids), else 128 bits of its SHA-256 (ids chosen by the publisher)."""
    try:
        parsed = uuid.UUID(task_id)
    except ValueError:
        parsed = None
    if parsed is not None and str(parsed) == task_id:
        return parsed.hex
    return hashlib.sha256(task_id.encode()).hexdigest()[:32]
