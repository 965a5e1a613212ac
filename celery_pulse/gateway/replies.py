"""What a worker instance makes of the gateway's answers: assignments, replies, deadlines.

The remote-worker side's records, with no I/O (the connection is
:class:`~celery_pulse.gateway.client.GatewayClient`'s): a ``task.assign`` as the worker
keeps it, an operation waiting for its answer, and the answer with its local deadline.
A deadline is this host's monotonic clock: when the request was *sent*, plus the lease's
duration, minus :data:`SAFETY_MARGIN`; nothing compares a wall clock with
``lease_until``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

from celery_pulse.errors import PulseError
from celery_pulse.gateway.protocol import Code

#: Subtracted from every lease's duration for the local deadline (request time is
#: deducted too: the deadline counts from when the request was sent).
SAFETY_MARGIN = 2.0
FATAL = (Code.UNAUTHENTICATED, Code.FORBIDDEN)
#: The gateway could not answer (its store, or itself): the operation may be sent again.
UNANSWERED = (Code.UNAVAILABLE, Code.INTERNAL)
#: Assignments remembered (a lost one's late finish still goes out as evidence).
KEPT = 4096


class GatewayClosed(PulseError):
    """The gateway client is closed (or lost its authority for good)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Assigned:
    """A ``task.assign``: the Celery message and the attempt's reference."""

    task_id: str  # the Celery task id
    name: str
    #: The Celery message: body (base64), content_type, content_encoding, headers,
    #: properties, delivery_info.
    message: Mapping[str, Any]
    ref: Mapping[str, str]  # task_id, attempt_id, epoch, lease_secret (wire form)
    lease_until: str
    received: float  # monotonic


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """A reply to one operation; ``deadline`` (monotonic) while its lease is active."""

    body: Mapping[str, Any]
    deadline: float | None

    @property
    def active(self) -> bool:
        lease = self.body.get("lease") or {}
        return bool(lease.get("active"))

    @property
    def disposition(self) -> str | None:
        receipt = self.body.get("receipt") or {}
        value = receipt.get("disposition")
        return None if value is None else str(value)


class Pending:
    """One operation sent until it is answered (its frame without the session_id)."""

    __slots__ = ("answer", "done", "error", "first_sent", "frame", "sent")

    def __init__(self, frame: dict[str, Any]) -> None:
        self.frame = frame
        self.done = threading.Event()
        self.answer: dict[str, Any] | None = None
        self.error: PulseError | None = None
        #: When it was last sent, and first (monotonic): a repeat answered with the
        #: original receipt (``deduplicated``) was applied after the first send only.
        self.sent = 0.0
        self.first_sent = 0.0

