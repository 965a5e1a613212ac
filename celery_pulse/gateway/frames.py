"""The pulse.worker.v1 frame codec: text frames in, typed records out, and back.

Pure Python (no websockets, Celery or SQL: the protocol core), so the gateway and its
client share one reading of the protocol. Rules, checked in this order; every refusal is a
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

Its vocabulary (constants, :class:`Code`, :class:`ProtocolError`, the records) is
:mod:`celery_pulse.gateway.protocol` and the JSON rules and field readers are
:mod:`celery_pulse.gateway.wire`; this module re-exports the vocabulary, so both ends of a
connection import the protocol from here.

The message_id makes an operation idempotent: the gateway keeps :func:`canonical` of the
first frame with an id and compares later ones with it. The digest covers type and body
only, since a frame reported again after a reconnect keeps its message_id but carries the
new connection's session_id.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from celery_pulse.gateway.protocol import (
    CLIENT_TYPES,
    FAILED,
    HELLO,
    INT64_MAX,
    INT64_MIN,
    MAX_CAPABILITIES,
    MAX_CAPACITY,
    MAX_DEPTH,
    MAX_ERROR_MESSAGE,
    MAX_FRAME_BYTES,
    MAX_LABEL,
    MAX_QUEUE_ID,
    MAX_RESULT_BYTES,
    OUTCOMES,
    PROTOCOL_VERSION,
    SERVER_TYPES,
    SUBPROTOCOL,
    SUCCEEDED,
    UNKNOWN,
    AttemptRef,
    Body,
    Capability,
    CapacityUpdate,
    Code,
    ErrorInfo,
    Finish,
    Frame,
    Hello,
    PermitAsk,
    ProtocolError,
    Start,
    TaskQuery,
)
from celery_pulse.gateway.refs import read_query, read_ref, read_start, wire_ref
from celery_pulse.gateway.wire import (
    ID_FORM,
    boolean,
    compact,
    decimal,
    exact,
    fail,
    identifier,
    integer,
    invalid,
    label,
    load,
    nameable,
    string,
)

#: The vocabulary, re-exported: this module is the protocol's public face.
__all__ = [
    "CLIENT_TYPES", "FAILED", "HELLO", "INT64_MAX", "INT64_MIN", "MAX_CAPABILITIES",
    "MAX_CAPACITY", "MAX_DEPTH", "MAX_ERROR_MESSAGE", "MAX_FRAME_BYTES", "MAX_LABEL",
    "MAX_QUEUE_ID", "MAX_RESULT_BYTES", "OUTCOMES", "PROTOCOL_VERSION", "SERVER_TYPES",
    "SUBPROTOCOL", "SUCCEEDED", "UNKNOWN", "AttemptRef", "Body", "Capability", "CapacityUpdate",
    "Code", "ErrorInfo", "Finish", "Frame", "Hello", "PermitAsk", "ProtocolError", "Start",
    "TaskQuery",
    "ack", "canonical",
    "decode_client", "decode_server", "encode", "error_frame", "new_id",
]

_ALWAYS = frozenset({"protocol_version", "type"})
_CLIENT_ENVELOPE = frozenset({"protocol_version", "type", "message_id", "session_id", "body"})
_SERVER_ENVELOPE = _CLIENT_ENVELOPE | {"reply_to", "error"}

_SECRET = re.compile(r"[A-Za-z0-9_-]{43}")
_ERROR_CODE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_WHITESPACE = re.compile(r"\s")


_HELLO_FIELDS = frozenset({"instance_id", "instance_secret", "queue_id", "capabilities", "capacity"})
_CAPABILITY_FIELDS = frozenset({"handler", "handler_version", "payload_version"})
_CAPACITY_FIELDS = frozenset({"sequence", "capacity", "drain"})
_FINISH_FIELDS = frozenset({"ref", "outcome", "result"})
_FINISH_OPTIONAL = frozenset({"error_code"})


def _instance_secret(obj: dict[str, Any], path: str) -> str:
    value = string(obj, "instance_secret", path)
    # 43 characters carry 258 bits; only the canonical spelling (last 2 bits zero) is
    # accepted, so one secret has one string and identities compare as strings.
    if not _SECRET.fullmatch(value) or base64.urlsafe_b64encode(
            base64.urlsafe_b64decode(value + "=")).decode("ascii") != value + "=":
        invalid(f"{path}.instance_secret must be 32 bytes as unpadded base64url (43 characters)")
    return value


def _queue_id(obj: dict[str, Any], path: str) -> str:
    value = string(obj, "queue_id", path)
    if not (1 <= len(value) <= MAX_QUEUE_ID and value.isprintable()
            and not _WHITESPACE.search(value)):
        invalid(f"{path}.queue_id must be 1 to {MAX_QUEUE_ID} printable characters, no whitespace")
    return value


def _hello(obj: Any, path: str) -> Hello:
    body = exact(obj, path, _HELLO_FIELDS)
    raw = body["capabilities"]
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_CAPABILITIES:
        invalid(f"{path}.capabilities must be a list of 1 to {MAX_CAPABILITIES} entries")
    capabilities: set[Capability] = set()
    for index, item in enumerate(raw):
        where = f"{path}.capabilities[{index}]"
        entry = exact(item, where, _CAPABILITY_FIELDS)
        capability = Capability(label(entry, "handler", where),
                                label(entry, "handler_version", where),
                                label(entry, "payload_version", where))
        if capability in capabilities:
            invalid(f"{where} repeats an earlier capability")
        capabilities.add(capability)
    return Hello(instance_id=identifier(body["instance_id"], f"{path}.instance_id"),
                 instance_secret=_instance_secret(body, path),
                 queue_id=_queue_id(body, path),
                 capabilities=frozenset(capabilities),
                 capacity=integer(body, "capacity", path, 1, MAX_CAPACITY))


def _capacity(obj: Any, path: str) -> CapacityUpdate:
    body = exact(obj, path, _CAPACITY_FIELDS)
    return CapacityUpdate(sequence=decimal(body, "sequence", path),
                          capacity=integer(body, "capacity", path, 0, MAX_CAPACITY),
                          drain=boolean(body, "drain", path))



def _finish(obj: Any, path: str) -> Finish:
    body = exact(obj, path, _FINISH_FIELDS, _FINISH_OPTIONAL)
    ref = read_ref(body["ref"], f"{path}.ref")
    outcome = string(body, "outcome", path)
    if outcome not in OUTCOMES:
        invalid(f"{path}.outcome must be one of {', '.join(sorted(OUTCOMES))}")
    error_code = None
    if "error_code" in body:
        error_code = string(body, "error_code", path)
        if not _ERROR_CODE.fullmatch(error_code):
            invalid(f"{path}.error_code must be 1 to 64 characters of [A-Za-z0-9_.:-]")
    if outcome == SUCCEEDED and error_code is not None:
        invalid(f"{path}.error_code must be absent when the outcome is SUCCEEDED")
    if outcome != SUCCEEDED and error_code is None:
        invalid(f"{path}.error_code is required when the outcome is {outcome}")
    result = body["result"]
    if result is None:
        invalid(f"{path}.result must not be null")
    if len(compact(result).encode("utf-8")) > MAX_RESULT_BYTES:
        fail(Code.RESULT_TOO_LARGE, f"{path}.result exceeds {MAX_RESULT_BYTES} bytes as compact JSON")
    return Finish(ref=ref, outcome=outcome, result=result, error_code=error_code)


_BODY_READERS: Mapping[type[Body], Callable[[Any, str], Body]] = MappingProxyType({
    Hello: _hello, AttemptRef: read_ref, Start: read_start, TaskQuery: read_query,
    CapacityUpdate: _capacity, Finish: _finish,
})


def _envelope(data: str | bytes, types: Mapping[str, Any] | frozenset[str],
              fields: frozenset[str]) -> tuple[dict[str, Any], str, str]:
    """The checks both directions share; returns the object, its type and message_id."""
    frame = load(data)
    message_id = frame.get("message_id")
    readable = message_id if isinstance(message_id, str) and ID_FORM.fullmatch(message_id) else None
    try:
        if "protocol_version" not in frame:
            invalid("protocol_version is required")
        version = frame["protocol_version"]
        if not isinstance(version, str):
            invalid("protocol_version must be a string")
        if version != PROTOCOL_VERSION:
            fail(Code.UNSUPPORTED_VERSION, f"protocol_version must be {PROTOCOL_VERSION!r}")
        kind = frame.get("type")
        if not isinstance(kind, str):
            invalid("type is required and must be a string")
        if kind not in types:
            fail(Code.UNKNOWN_TYPE, f"unknown frame type {nameable(kind)}")
        exact(frame, "frame", _ALWAYS, fields)
        if message_id is None:
            invalid("message_id is required")
        return frame, kind, identifier(message_id, "message_id")
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
                invalid("worker.hello must not carry a session_id")
        elif "session_id" not in frame:
            invalid(f"{kind} requires a session_id")
        else:
            session_id = identifier(frame["session_id"], "session_id")
        if "body" not in frame:
            invalid("body is required")
        body = _BODY_READERS[CLIENT_TYPES[kind]](frame["body"], "body")
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.message, reply_to=message_id) from None
    return Frame(type=kind, message_id=message_id, body=body, session_id=session_id)


def decode_server(data: str | bytes) -> Frame:
    """Read one frame the gateway sent: the envelope is checked, the body left a dict.

    ``ack`` and ``worker.welcome`` answer a request (``reply_to`` required); ``task.assign``
    and ``task.cancel`` answer none (``reply_to`` refused); ``error`` carries ``error`` instead of ``body``,
    and ``reply_to`` when the failed frame's message_id could be read.
    """
    frame, kind, message_id = _envelope(data, SERVER_TYPES, _SERVER_ENVELOPE)
    try:
        session_id = identifier(frame["session_id"], "session_id") if "session_id" in frame else None
        reply_to = None if "reply_to" not in frame else identifier(frame["reply_to"], "reply_to")
        if kind in ("ack", "worker.welcome") and reply_to is None:
            invalid(f"{kind} requires a reply_to")
        if kind in ("task.assign", "task.cancel") and reply_to is not None:
            invalid(f"{kind} must not carry a reply_to")
        error = None
        body = None
        if kind == "error":
            if "body" in frame:
                invalid("an error frame carries no body")
            if "error" not in frame:
                invalid("error is required")
            info = exact(frame["error"], "error", frozenset({"code", "message"}))
            code, message = string(info, "code", "error"), string(info, "message", "error")
            if not _ERROR_CODE.fullmatch(code) or len(message) > MAX_ERROR_MESSAGE:
                invalid("error must carry a short code and message")
            error = ErrorInfo(code, message)
        else:
            if "error" in frame:
                invalid(f"{kind} carries no error")
            if "body" not in frame:
                invalid("body is required")
            body = frame["body"]
            if not isinstance(body, dict):
                invalid("body must be an object")
    except ProtocolError as exc:
        raise ProtocolError(exc.code, exc.message, reply_to=message_id) from None
    return Frame(type=kind, message_id=message_id, body=body, session_id=session_id,
                 reply_to=reply_to, error=error)


# -- encoding --------------------------------------------------------------------------


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
    if isinstance(body, TaskQuery):
        return {"task_id": body.task_id}
    if isinstance(body, AttemptRef):
        return wire_ref(body)
    if isinstance(body, CapacityUpdate):
        return {"sequence": str(body.sequence), "capacity": body.capacity, "drain": body.drain}
    if isinstance(body, Finish):
        wire = {"ref": wire_ref(body.ref), "outcome": body.outcome, "result": body.result}
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
    return compact(wire)


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
    return hashlib.sha256(compact(subject, sort_keys=True).encode("utf-8")).hexdigest()
