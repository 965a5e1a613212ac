"""pulse.worker.v1's vocabulary: its constants, error codes and the records frames become.

The protocol core's bottom layer (no websockets, Celery or SQL, and no parsing): the codec
(:mod:`celery_pulse.gateway.frames`, which re-exports every name here), the session rules
and both ends of a connection name the same things by the same names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, TypeAlias

from celery_pulse.errors import PulseError

PROTOCOL_VERSION: Final = "1"
SUBPROTOCOL: Final = "pulse.worker.v1"
MAX_FRAME_BYTES: Final = 512 * 1024
MAX_RESULT_BYTES: Final = 256 * 1024
MAX_CAPABILITIES: Final = 32
#: Containers nested deeper than this are refused. The envelope and body are two levels, which
#: leaves a result plenty; the bound is ours rather than the parser's recursion limit, which
#: depends on the thread's stack and the caller's own depth.
MAX_DEPTH: Final = 64
MAX_CAPACITY: Final = 256
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

SUCCEEDED, FAILED, UNKNOWN = "SUCCEEDED", "FAILED", "UNKNOWN"
OUTCOMES: Final = frozenset({SUCCEEDED, FAILED, UNKNOWN})


class Code:
    """The stable error codes: what a peer may branch on (the message is for people)."""

    INVALID_FRAME: Final = "INVALID_FRAME"
    FRAME_TOO_LARGE: Final = "FRAME_TOO_LARGE"
    RESULT_TOO_LARGE: Final = "RESULT_TOO_LARGE"
    UNSUPPORTED_VERSION: Final = "UNSUPPORTED_VERSION"
    UNKNOWN_TYPE: Final = "UNKNOWN_TYPE"
    INVALID_ID: Final = "INVALID_ID"
    HELLO_REQUIRED: Final = "HELLO_REQUIRED"
    HELLO_TIMEOUT: Final = "HELLO_TIMEOUT"
    UNAUTHENTICATED: Final = "UNAUTHENTICATED"
    FORBIDDEN: Final = "FORBIDDEN"
    SESSION_MISMATCH: Final = "SESSION_MISMATCH"
    LEASE_LOST: Final = "LEASE_LOST"
    IDEMPOTENCY_CONFLICT: Final = "IDEMPOTENCY_CONFLICT"
    STATE_CONFLICT: Final = "STATE_CONFLICT"
    NOT_FOUND: Final = "NOT_FOUND"
    OVERLOADED: Final = "OVERLOADED"
    UNAVAILABLE: Final = "UNAVAILABLE"
    INTERNAL: Final = "INTERNAL"

    ALL: Final = frozenset({
        INVALID_FRAME, FRAME_TOO_LARGE, RESULT_TOO_LARGE, UNSUPPORTED_VERSION, UNKNOWN_TYPE,
        INVALID_ID, HELLO_REQUIRED, HELLO_TIMEOUT, UNAUTHENTICATED, FORBIDDEN, SESSION_MISMATCH,
        LEASE_LOST, IDEMPOTENCY_CONFLICT, STATE_CONFLICT, NOT_FOUND, OVERLOADED, UNAVAILABLE,
        INTERNAL,
    })


class ProtocolError(PulseError):
    """The peer broke pulse.worker.v1."""

    def __init__(self, code: str, message: str, *, reply_to: str | None = None) -> None:
        if code not in Code.ALL:
            raise ValueError(f"unknown protocol error code {code!r}")
        #: One of :class:`Code`; :attr:`message` is public (safe to send to the peer).
        self.code = code
        #: The offending frame's message_id, when it could be read.
        self.reply_to = reply_to
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (self.code, self.message, self.reply_to))


def _rebuild_error(code: str, message: str, reply_to: str | None) -> ProtocolError:
    return ProtocolError(code, message, reply_to=reply_to)


# -- records ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Capability:
    """One exact handler / handler_version / payload_version a worker can run."""

    handler: str
    handler_version: str
    payload_version: str


@dataclass(frozen=True, slots=True)
class Hello:
    instance_id: str
    instance_secret: str
    queue_id: str
    #: A set: the order a worker lists them in is not part of its identity.
    capabilities: frozenset[Capability]
    capacity: int


@dataclass(frozen=True, slots=True)
class CapacityUpdate:
    sequence: int
    capacity: int
    drain: bool


@dataclass(frozen=True, slots=True)
class AttemptRef:
    """Which attempt a frame is about, and the secret proving the sender was given it."""

    task_id: str
    attempt_id: str
    epoch: int
    lease_secret: str


@dataclass(frozen=True, slots=True)
class PermitAsk:
    """A concurrency permit a start needs: at most ``limit`` running attempts hold ``key``
    across every worker of the store (the worker's ``pulse_concurrency`` declarations);
    with ``window_ms``, a rate: at most ``limit`` starts of ``key`` in any window of that
    length (``pulse_rate_limit``)."""

    key: str
    limit: int
    window_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Start(AttemptRef):
    """``task.start``: the attempt, and the permits it needs (none: unlimited)."""

    permits: tuple[PermitAsk, ...] = ()


@dataclass(frozen=True, slots=True)
class TaskQuery:
    """``task.query``: a task's attempts and the late outcomes kept of them, as this
    instance may see them (read-only)."""

    task_id: str


@dataclass(frozen=True, slots=True)
class Finish:
    ref: AttemptRef
    outcome: str
    result: Any
    error_code: str | None


@dataclass(frozen=True, slots=True)
class Frame:
    type: str
    message_id: str
    #: The typed record for a known client type; a dict for server->client types.
    body: Any = None
    session_id: str | None = None
    reply_to: str | None = None
    error: ErrorInfo | None = None


#: The records a client frame's body becomes.
Body: TypeAlias = Hello | AttemptRef | Start | CapacityUpdate | Finish | TaskQuery

CLIENT_TYPES: Final[Mapping[str, type[Body]]] = MappingProxyType({
    "worker.hello": Hello,
    "worker.resume": AttemptRef,
    "worker.capacity": CapacityUpdate,
    "task.start": Start,
    "task.renew": AttemptRef,
    "task.finish": Finish,
    "task.query": TaskQuery,
})
#: The error code of a ``FAILED`` finish that is Celery's revoke (``terminate``, or
#: revoked before it ran): the claim ends ``revoked`` and the result ``REVOKED``.
REVOKED_CODE: Final = "celery.revoked"
#: The error code of a ``FAILED`` finish that is Celery's retry (``self.retry()``): the
#: next attempt is in the finish's ``publish``, and the claim stays open for it.
RETRY_CODE: Final = "celery.retry"

SERVER_TYPES: Final = frozenset({"worker.welcome", "ack", "error", "task.assign",
                                  "task.cancel"})
HELLO: Final = "worker.hello"
MAX_LABEL: Final = 128
MAX_QUEUE_ID: Final = 255
#: The most permits one start may ask for, the longest key, the highest limit.
MAX_PERMITS: Final = 8
MAX_PERMIT_KEY: Final = 255
MAX_PERMIT_LIMIT: Final = 1_000_000
#: A rate's window: Celery's units, a second to an hour.
RATE_WINDOWS_MS: Final = (1000, 60_000, 3_600_000)
MAX_ERROR_MESSAGE: Final = 1024


def is_revoke(outcome: str, error_code: str | None) -> bool:
    """Whether a finish is Celery's revoke (see :data:`REVOKED_CODE`)."""
    return outcome == "FAILED" and error_code == REVOKED_CODE


def is_retry(outcome: str, error_code: str | None) -> bool:
    """Whether a finish is Celery's retry (see :data:`RETRY_CODE`)."""
    return outcome == "FAILED" and error_code == RETRY_CODE
