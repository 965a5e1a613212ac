"""The pulse.worker.v1 frame codec: text frames in, typed records out, and back.

Pure Python (no websockets, Celery or SQL), so the gateway and its client share one
reading of the protocol. Rules, checked in this order; every refusal is a
:class:`ProtocolError` with a stable :class:`Code` and a public message that names the
field but never echoes a secret or a long value:

* A binary frame (``bytes``) is refused (``INVALID_FRAME``). A text frame over
  ``MAX_FRAME_BYTES`` of UTF-8 is refused (``FRAME_TOO_LARGE``) before it is parsed.
* The text must be one JSON object. Duplicate keys at any depth, ``NaN`` / ``Infinity``
  (and floats that overflow to them, ``1e400``), integers outside int64, strings or keys
  with a lone surrogate (``"\\ud800"``) and nesting deeper than ``MAX_DEPTH`` are
  refused (``INVALID_FRAME``).
* Envelope: ``protocol_version`` must be ``"1"`` (another string: ``UNSUPPORTED_VERSION``,
  checked first so a newer peer hears that rather than "unknown field"); ``type`` must be
  known to the reader (``UNKNOWN_TYPE``); no field beyond the envelope's own.
  ``worker.hello`` carries no ``session_id``; every other client frame must.
* Fields are exact: unknown or missing ones, or a wrong JSON type (booleans are not
  integers), are ``INVALID_FRAME``. A string of the wrong form where an id belongs (32
  lowercase hex) is ``INVALID_ID``. epoch and sequence are decimal strings that fit int64.
* ``task.finish``'s ``result`` is any JSON but null, at most ``MAX_RESULT_BYTES`` as compact
  UTF-8 JSON (``RESULT_TOO_LARGE``); FAILED and UNKNOWN carry an ``error_code``, SUCCEEDED
  does not. Floats are accepted there only: no other field is a float.
* An error raised once the frame's ``message_id`` could be read carries it as
  ``reply_to``, so the gateway can answer the request that failed.

The message_id makes an operation idempotent: the gateway keeps :func:`canonical` of the
first frame with an id and compares later ones with it. The digest covers type and body
only, since a frame reported again after a reconnect keeps its message_id but carries the
new connection's session_id.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, NoReturn, TypeAlias

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
Body: TypeAlias = Hello | AttemptRef | CapacityUpdate | Finish

CLIENT_TYPES: Final[Mapping[str, type[Body]]] = MappingProxyType({
    "worker.hello": Hello,
    "worker.resume": AttemptRef,
    "worker.capacity": CapacityUpdate,
    "task.start": AttemptRef,
    "task.renew": AttemptRef,
    "task.finish": Finish,
})
SERVER_TYPES: Final = frozenset({"worker.welcome", "ack", "error", "task.assign"})
HELLO: Final = "worker.hello"

_ALWAYS = frozenset({"protocol_version", "type"})
_CLIENT_ENVELOPE = frozenset({"protocol_version", "type", "message_id", "session_id", "body"})
_SERVER_ENVELOPE = _CLIENT_ENVELOPE | {"reply_to", "error"}

# Explicit ASCII classes: ``\d`` and ``\w`` would let other scripts' digits through.
_ID = re.compile(r"[0-9a-f]{32}")
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")
_SECRET = re.compile(r"[A-Za-z0-9_-]{43}")
_LEASE_SECRET = re.compile(r"[A-Za-z0-9._~-]{1,128}")
_ERROR_CODE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_WHITESPACE = re.compile(r"\s")
_SURROGATE = re.compile("[\ud800-\udfff]")
#: A surrogate's escape (a valid pair matches too; json joins it into one character).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
#: Names a message may repeat; anything else the peer sent is described, not echoed.
_NAMEABLE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_LABEL: Final = 128
MAX_QUEUE_ID: Final = 255
MAX_ERROR_MESSAGE: Final = 1024


# -- parsing ---------------------------------------------------------------------------


def _fail(code: str, message: str) -> NoReturn:
    raise ProtocolError(code, message)


def _invalid(message: str) -> NoReturn:
    raise ProtocolError(Code.INVALID_FRAME, message)


def _name(value: object) -> str:
    return repr(value) if isinstance(value, str) and _NAMEABLE.fullmatch(value) else "(not shown)"


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        _invalid("duplicate key in a JSON object")
    return obj


def _parse_int(text: str) -> int:
    # Length first: int() of a 500,000-digit string is slow before it is refused.
    if len(text) > 20 or not INT64_MIN <= (value := int(text)) <= INT64_MAX:
        _invalid("integer outside the 64-bit range")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _invalid("non-finite number")
    return value


def _parse_constant(text: str) -> NoReturn:
    _invalid("non-finite number")


def _check_tree(root: dict[str, Any], strings: bool) -> None:
    """Depth, level by level without recursion; with ``strings``, lone surrogates too."""
    level: list[Any] = [root]
    depth = 1
    while level:
        if depth > MAX_DEPTH:
            _invalid(f"JSON nested deeper than {MAX_DEPTH} levels")
        below: list[Any] = []
        for container in level:
            values = container.values() if isinstance(container, dict) else container
            if strings and isinstance(container, dict):
                values = [*container, *values]
            for value in values:
                if isinstance(value, dict | list):
                    below.append(value)
                elif strings and isinstance(value, str) and _SURROGATE.search(value):
                    _invalid("invalid Unicode (lone surrogate)")
        level = below
        depth += 1


def _load(data: str | bytes) -> dict[str, Any]:
    if not isinstance(data, str):
        _invalid("binary frames are refused")
    # Every character is 1-4 bytes of UTF-8, so only the middle band needs encoding.
    if len(data) > MAX_FRAME_BYTES or (
            len(data) * 4 > MAX_FRAME_BYTES
            and len(data.encode("utf-8", "surrogatepass")) > MAX_FRAME_BYTES):
        _fail(Code.FRAME_TOO_LARGE, f"frame exceeds {MAX_FRAME_BYTES} bytes")
    try:
        value = json.loads(data, object_pairs_hook=_object_pairs, parse_int=_parse_int,
                           parse_float=_parse_float, parse_constant=_parse_constant)
    except ProtocolError:
        raise
    except RecursionError:
        _invalid(f"JSON nested deeper than {MAX_DEPTH} levels")
    except ValueError:
        _invalid("frame is not valid JSON")
    if not isinstance(value, dict):
        _invalid("frame must be a JSON object")
    # Where a decoded string can get a surrogate from: the character itself, or its escape.
    escaped = "\\u" in data and _SURROGATE_ESCAPE.search(data) is not None
    raw = not data.isascii() and _SURROGATE.search(data) is not None
    _check_tree(value, strings=escaped or raw)
    return value


def _exact(obj: Any, path: str, required: frozenset[str],
           optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        _invalid(f"{path} must be an object")
    if unknown := obj.keys() - required - optional:
        _invalid(f"{path} has an unknown field {_name(min(unknown))}")
    if missing := required - obj.keys():
        _invalid(f"{path}.{min(missing)} is required")
    return obj


def _string(obj: dict[str, Any], key: str, path: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        _invalid(f"{path}.{key} must be a string")
    return value


def _label(obj: dict[str, Any], key: str, path: str) -> str:
    value = _string(obj, key, path)
    # Printable: a NUL or control character would reach the store (PostgreSQL text holds no NUL).
    if not (1 <= len(value) <= MAX_LABEL and value.isprintable()):
        _invalid(f"{path}.{key} must be 1 to {MAX_LABEL} printable characters")
    return value


def _id(value: Any, where: str) -> str:
    if not isinstance(value, str):
        _invalid(f"{where} must be a string")
    if not _ID.fullmatch(value):
        _fail(Code.INVALID_ID, f"{where} must be 32 lowercase hex digits")
    return value


def _decimal(obj: dict[str, Any], key: str, path: str) -> int:
    value = _string(obj, key, path)
    if not _DECIMAL.fullmatch(value) or (number := int(value)) > INT64_MAX:
        _invalid(f"{path}.{key} must be a decimal string of a 64-bit integer")
    return number


def _integer(obj: dict[str, Any], key: str, path: str, low: int, high: int) -> int:
    value = obj[key]
    if type(value) is not int or not low <= value <= high:  # bool is an int subclass
        _invalid(f"{path}.{key} must be an integer from {low} to {high}")
    return value


def _boolean(obj: dict[str, Any], key: str, path: str) -> bool:
    value = obj[key]
    if not isinstance(value, bool):
        _invalid(f"{path}.{key} must be a boolean")
    return value


_HELLO_FIELDS = frozenset({"instance_id", "instance_secret", "queue_id", "capabilities", "capacity"})
_CAPABILITY_FIELDS = frozenset({"handler", "handler_version", "payload_version"})
_REF_FIELDS = frozenset({"task_id", "attempt_id", "epoch", "lease_secret"})
_CAPACITY_FIELDS = frozenset({"sequence", "capacity", "drain"})
_FINISH_FIELDS = frozenset({"ref", "outcome", "result"})
_FINISH_OPTIONAL = frozenset({"error_code"})


def _instance_secret(obj: dict[str, Any], path: str) -> str:
    value = _string(obj, "instance_secret", path)
    # 43 characters carry 258 bits; only the canonical spelling (last 2 bits zero) is
    # accepted, so one secret has one string and identities compare as strings.
    if not _SECRET.fullmatch(value) or base64.urlsafe_b64encode(
            base64.urlsafe_b64decode(value + "=")).decode("ascii") != value + "=":
        _invalid(f"{path}.instance_secret must be 32 bytes as unpadded base64url (43 characters)")
    return value


def _queue_id(obj: dict[str, Any], path: str) -> str:
    value = _string(obj, "queue_id", path)
    if not (1 <= len(value) <= MAX_QUEUE_ID and value.isprintable()
            and not _WHITESPACE.search(value)):
        _invalid(f"{path}.queue_id must be 1 to {MAX_QUEUE_ID} printable characters, no whitespace")
    return value


def _hello(obj: Any, path: str) -> Hello:
    body = _exact(obj, path, _HELLO_FIELDS)
    raw = body["capabilities"]
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_CAPABILITIES:
        _invalid(f"{path}.capabilities must be a list of 1 to {MAX_CAPABILITIES} entries")
    capabilities: set[Capability] = set()
    for index, item in enumerate(raw):
        where = f"{path}.capabilities[{index}]"
        entry = _exact(item, where, _CAPABILITY_FIELDS)
        capability = Capability(_label(entry, "handler", where),
                                _label(entry, "handler_version", where),
                                _label(entry, "payload_version", where))
        if capability in capabilities:
            _invalid(f"{where} repeats an earlier capability")
        capabilities.add(capability)
    return Hello(instance_id=_id(body["instance_id"], f"{path}.instance_id"),
                 instance_secret=_instance_secret(body, path),
                 queue_id=_queue_id(body, path),
                 capabilities=frozenset(capabilities),
                 capacity=_integer(body, "capacity", path, 1, MAX_CAPACITY))


def _ref(obj: Any, path: str) -> AttemptRef:
    body = _exact(obj, path, _REF_FIELDS)
    lease_secret = _string(body, "lease_secret", path)
    if not _LEASE_SECRET.fullmatch(lease_secret):
        _invalid(f"{path}.lease_secret must be 1 to 128 URL-safe characters")
    return AttemptRef(task_id=_id(body["task_id"], f"{path}.task_id"),
                      attempt_id=_id(body["attempt_id"], f"{path}.attempt_id"),
                      epoch=_decimal(body, "epoch", path),
                      lease_secret=lease_secret)


def _capacity(obj: Any, path: str) -> CapacityUpdate:
    body = _exact(obj, path, _CAPACITY_FIELDS)
    return CapacityUpdate(sequence=_decimal(body, "sequence", path),
                          capacity=_integer(body, "capacity", path, 0, MAX_CAPACITY),
                          drain=_boolean(body, "drain", path))


def _compact(value: Any, **options: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False, **options)


def _finish(obj: Any, path: str) -> Finish:
    body = _exact(obj, path, _FINISH_FIELDS, _FINISH_OPTIONAL)
    ref = _ref(body["ref"], f"{path}.ref")
    outcome = _string(body, "outcome", path)
    if outcome not in OUTCOMES:
        _invalid(f"{path}.outcome must be one of {', '.join(sorted(OUTCOMES))}")
    error_code = None
    if "error_code" in body:
        error_code = _string(body, "error_code", path)
        if not _ERROR_CODE.fullmatch(error_code):
            _invalid(f"{path}.error_code must be 1 to 64 characters of [A-Za-z0-9_.:-]")
    if outcome == SUCCEEDED and error_code is not None:
        _invalid(f"{path}.error_code must be absent when the outcome is SUCCEEDED")
    if outcome != SUCCEEDED and error_code is None:
        _invalid(f"{path}.error_code is required when the outcome is {outcome}")
    result = body["result"]
    if result is None:
        _invalid(f"{path}.result must not be null")
    if len(_compact(result).encode("utf-8")) > MAX_RESULT_BYTES:
        _fail(Code.RESULT_TOO_LARGE, f"{path}.result exceeds {MAX_RESULT_BYTES} bytes as compact JSON")
    return Finish(ref=ref, outcome=outcome, result=result, error_code=error_code)


_BODY_READERS: Mapping[type[Body], Callable[[Any, str], Body]] = MappingProxyType({
    Hello: _hello, AttemptRef: _ref, CapacityUpdate: _capacity, Finish: _finish,
})


def _envelope(data: str | bytes, types: Mapping[str, Any] | frozenset[str],
              fields: frozenset[str]) -> tuple[dict[str, Any], str, str]:
    """The checks both directions share; returns the object, its type and message_id."""
    frame = _load(data)
    message_id = frame.get("message_id")
    readable = message_id if isinstance(message_id, str) and _ID.fullmatch(message_id) else None
    try:
        if "protocol_version" not in frame:
            _invalid("protocol_version is required")
        version = frame["protocol_version"]
        if not isinstance(version, str):
            _invalid("protocol_version must be a string")
        if version != PROTOCOL_VERSION:
            _fail(Code.UNSUPPORTED_VERSION, f"protocol_version must be {PROTOCOL_VERSION!r}")
        kind = frame.get("type")
        if not isinstance(kind, str):
            _invalid("type is required and must be a string")
        if kind not in types:
            _fail(Code.UNKNOWN_TYPE, f"unknown frame type {_name(kind)}")
        _exact(frame, "frame", _ALWAYS, fields)
        if message_id is None:
            _invalid("message_id is required")
        return frame, kind, _id(message_id, "message_id")
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.message, reply_to=readable) from None


def decode_client(data: str | bytes) -> Frame:
    """Read one frame a worker sent; its body becomes the type's record (:data:`CLIENT_TYPES`).

    Raises :class:`ProtocolError` for anything the rules refuse, and nothing else.
    """
    frame, kind, message_id = _envelope(data, CLIENT_TYPES, _CLIENT_ENVELOPE)
    try:
        session_id = None
        if kind == HELLO:
            if "session_id" in frame:
                _invalid("worker.hello must not carry a session_id")
        elif "session_id" not in frame:
            _invalid(f"{kind} requires a session_id")
        else:
            session_id = _id(frame["session_id"], "session_id")
        if "body" not in frame:
            _invalid("body is required")
        body = _BODY_READERS[CLIENT_TYPES[kind]](frame["body"], "body")
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.message, reply_to=message_id) from None
    return Frame(type=kind, message_id=message_id, body=body, session_id=session_id)


def decode_server(data: str | bytes) -> Frame:
    """Read one frame the gateway sent: the envelope is checked, the body left a dict.

    ``ack`` and ``worker.welcome`` answer a request (``reply_to`` required); ``task.assign``
    answers none (``reply_to`` refused); ``error`` carries ``error`` instead of ``body``,
    and ``reply_to`` when the failed frame's message_id could be read.
    """
    frame, kind, message_id = _envelope(data, SERVER_TYPES, _SERVER_ENVELOPE)
    try:
        session_id = _id(frame["session_id"], "session_id") if "session_id" in frame else None
        reply_to = None if "reply_to" not in frame else _id(frame["reply_to"], "reply_to")
        if kind in ("ack", "worker.welcome") and reply_to is None:
            _invalid(f"{kind} requires a reply_to")
        if kind == "task.assign" and reply_to is not None:
            _invalid("task.assign must not carry a reply_to")
        error = None
        body = None
        if kind == "error":
            if "body" in frame:
                _invalid("an error frame carries no body")
            if "error" not in frame:
                _invalid("error is required")
            info = _exact(frame["error"], "error", frozenset({"code", "message"}))
            code, message = _string(info, "code", "error"), _string(info, "message", "error")
            if not _ERROR_CODE.fullmatch(code) or len(message) > MAX_ERROR_MESSAGE:
                _invalid("error must carry a short code and message")
            error = ErrorInfo(code, message)
        else:
            if "error" in frame:
                _invalid(f"{kind} carries no error")
            if "body" not in frame:
                _invalid("body is required")
            body = frame["body"]
            if not isinstance(body, dict):
                _invalid("body must be an object")
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.message, reply_to=message_id) from None
    return Frame(type=kind, message_id=message_id, body=body, session_id=session_id,
                 reply_to=reply_to, error=error)


# -- encoding --------------------------------------------------------------------------


def _wire_ref(ref: AttemptRef) -> dict[str, Any]:
    return {"task_id": ref.task_id, "attempt_id": ref.attempt_id, "epoch": str(ref.epoch),
            "lease_secret": ref.lease_secret}


def _wire_body(body: Any) -> Any:
    """A body in its wire form: records rendered (ints as decimal strings), dicts as they are."""
    if isinstance(body, Hello):
        capabilities = sorted(body.capabilities,
                              key=lambda c: (c.handler, c.handler_version, c.payload_version))
        return {"instance_id": body.instance_id, "instance_secret": body.instance_secret,
                "queue_id": body.queue_id,
                "capabilities": [{"handler": c.handler, "handler_version": c.handler_version,
                                  "payload_version": c.payload_version} for c in capabilities],
                "capacity": body.capacity}
    if isinstance(body, AttemptRef):
        return _wire_ref(body)
    if isinstance(body, CapacityUpdate):
        return {"sequence": str(body.sequence), "capacity": body.capacity, "drain": body.drain}
    if isinstance(body, Finish):
        wire = {"ref": _wire_ref(body.ref), "outcome": body.outcome, "result": body.result}
        if body.error_code is not None:
            wire["error_code"] = body.error_code
        return wire
    return body


def encode(frame: Frame) -> str:
    """One text frame, compact JSON; the fields that are None are left out.

    Not a validator: what the caller put in a dict body is sent as it is (a value JSON
    cannot hold, or a non-finite float, raises ``TypeError`` / ``ValueError``).
    """
    wire: dict[str, Any] = {"protocol_version": PROTOCOL_VERSION, "type": frame.type,
                            "message_id": frame.message_id}
    if frame.reply_to is not None:
        wire["reply_to"] = frame.reply_to
    if frame.session_id is not None:
        wire["session_id"] = frame.session_id
    if frame.body is not None:
        wire["body"] = _wire_body(frame.body)
    if frame.error is not None:
        wire["error"] = {"code": frame.error.code, "message": frame.error.message}
    return _compact(wire)


def new_id() -> str:
    """A fresh id: 32 lowercase hex digits (128 random bits)."""
    return secrets.token_hex(16)


def ack(reply_to: str, session_id: str | None, body: Mapping[str, Any]) -> Frame:
    """The gateway's success reply to the frame ``reply_to``."""
    return Frame(type="ack", message_id=new_id(), body=dict(body), session_id=session_id,
                 reply_to=reply_to)


def error_frame(exc: ProtocolError, session_id: str | None) -> Frame:
    """The gateway's refusal: code and public message only, in reply to the failed frame."""
    return Frame(type="error", message_id=new_id(), session_id=session_id, reply_to=exc.reply_to,
                 error=ErrorInfo(exc.code, exc.message))


def canonical(frame_or_body: Frame | Body | Mapping[str, Any]) -> str:
    """The sha256 hex digest of a frame's type and body in canonical JSON (keys sorted,
    capabilities in a fixed order). A bare body digests the body alone.

    Equal digests under one message_id mean the same operation reported again; different
    ones, an IDEMPOTENCY_CONFLICT. Envelope ids are left out: a frame resent after a
    reconnect has the new session_id.
    """
    if isinstance(frame_or_body, Frame):
        subject: dict[str, Any] = {"type": frame_or_body.type,
                                   "body": _wire_body(frame_or_body.body)}
    else:
        subject = {"body": _wire_body(frame_or_body)}
    return hashlib.sha256(_compact(subject, sort_keys=True).encode("utf-8")).hexdigest()
