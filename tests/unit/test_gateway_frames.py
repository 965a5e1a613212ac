"""The pulse.worker.v1 codec: every refusal rule with its code, round trips of every client
type, the server frames, and properties over generated frames (stable re-encoding, nothing
but ProtocolError out of any text, canonical() blind to key and capability order)."""

from __future__ import annotations

import base64
import copy
import json
import pickle
import random
import string
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from celery_pulse.errors import PulseError
from celery_pulse.gateway.frames import (
    CLIENT_TYPES,
    INT64_MAX,
    MAX_CAPABILITIES,
    MAX_DEPTH,
    MAX_FRAME_BYTES,
    MAX_RESULT_BYTES,
    SERVER_TYPES,
    AttemptRef,
    Capability,
    CapacityUpdate,
    Code,
    ErrorInfo,
    Finish,
    Frame,
    Hello,
    ProtocolError,
    Start,
    TaskQuery,
    ack,
    canonical,
    decode_client,
    decode_server,
    encode,
    error_frame,
    new_id,
)

MID = "4" * 32
SID = "3" * 32
TASK = "1" * 32
ATTEMPT = "2" * 32
INSTANCE = "a" * 32
SECRET = base64.urlsafe_b64encode(bytes(range(32))).rstrip(b"=").decode()
LEASE_SECRET = "lease-secret_0123456789"

REF = {"task_id": TASK, "attempt_id": ATTEMPT, "epoch": "1", "lease_secret": LEASE_SECRET}
BODIES: dict[str, dict[str, Any]] = {
    "worker.hello": {
        "instance_id": INSTANCE, "instance_secret": SECRET, "queue_id": "objects",
        "capabilities": [{"handler": "resize", "handler_version": "2", "payload_version": "1"},
                         {"handler": "crop", "handler_version": "1", "payload_version": "1"}],
        "capacity": 4,
    },
    "worker.resume": REF,
    "worker.capacity": {"sequence": "7", "capacity": 3, "drain": False},
    "task.start": REF,
    "task.renew": REF,
    "task.finish": {"ref": REF, "outcome": "SUCCEEDED", "result": {"ok": [1, 2.5, "é"]}},
    "task.query": {"task_id": TASK},
}


@pytest.fixture(autouse=True)
def hypothesis_home(tmp_path: Path) -> Iterator[None]:
    """No ``.hypothesis`` in the repo (tests/contract/test_claims_model.py does the same)."""
    set_hypothesis_home_dir(tmp_path / "hypothesis")
    try:
        yield
    finally:
        set_hypothesis_home_dir(None)


PROPERTY = settings(database=None, deadline=None, max_examples=150)


def wire(kind: str = "task.start", **envelope: Any) -> dict[str, Any]:
    frame: dict[str, Any] = {"protocol_version": "1", "type": kind, "message_id": MID}
    if kind != "worker.hello":
        frame["session_id"] = SID
    frame["body"] = copy.deepcopy(BODIES[kind])
    frame.update(envelope)
    return frame


def text(frame: Any) -> str:
    return json.dumps(frame, ensure_ascii=False)


def refused(data: str | bytes, decode: Callable[[str | bytes], Frame] = decode_client
            ) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    return info.value


def edit(kind: str, change: Callable[[dict[str, Any]], None]) -> str:
    frame = wire(kind)
    change(frame)
    return text(frame)


def body_set(kind: str, path: str, value: Any) -> str:
    """The valid ``kind`` frame with ``body.<path>`` (dotted) set to ``value``."""
    def change(frame: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = frame["body"]
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[last] = value
    return edit(kind, change)


def body_drop(kind: str, path: str) -> str:
    def change(frame: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = frame["body"]
        for key in parents:
            target = target[key]
        del target[last]
    return edit(kind, change)


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def caps(count: int) -> list[dict[str, str]]:
    return [{"handler": f"h{i}", "handler_version": "1", "payload_version": "1"} for i in range(count)]


# -- refusals: (text, code, reply_to) -------------------------------------------------------

_VALID = text(wire())
_B64URL = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
# The last character with one of its two unused low bits set: it decodes to the same 32 bytes.
_NOT_CANONICAL = SECRET[:-1] + _B64URL[_B64URL.index(SECRET[-1]) | 1]

REFUSALS: dict[str, tuple[str | bytes, str, str | None]] = {
    # transport and JSON
    "binary frame": (_VALID.encode(), Code.INVALID_FRAME, None),
    "binary empty": (b"", Code.INVALID_FRAME, None),
    "too large ascii": (_VALID + " " * (MAX_FRAME_BYTES - len(_VALID) + 1), Code.FRAME_TOO_LARGE, None),
    "too large by utf-8 bytes, not characters": (
        body_set("task.finish", "result", "é" * (MAX_FRAME_BYTES // 2 + 1)), Code.FRAME_TOO_LARGE, None),
    "not json": ("hello", Code.INVALID_FRAME, None),
    "empty text": ("", Code.INVALID_FRAME, None),
    "truncated": (_VALID[:-1], Code.INVALID_FRAME, None),
    "single quotes": ("{'type': 'task.start'}", Code.INVALID_FRAME, None),
    "byte order mark": ("\ufeff" + _VALID, Code.INVALID_FRAME, None),
    "top level array": ("[]", Code.INVALID_FRAME, None),
    "top level string": ('"task.start"', Code.INVALID_FRAME, None),
    "top level null": ("null", Code.INVALID_FRAME, None),
    "duplicate key at top": (_VALID[:-1] + ',"type":"task.renew"}', Code.INVALID_FRAME, None),
    "duplicate key in body": (_VALID.replace('"epoch":', '"epoch":"2","epoch":', 1), Code.INVALID_FRAME,
                              None),
    "duplicate key deep in result": (body_set("task.finish", "result", {"a": [{"b": 1}]}).replace(
        '{"b": 1}', '{"b": 1, "b": 1}'), Code.INVALID_FRAME, None),
    "NaN": (body_set("task.finish", "result", 0).replace('"result": 0', '"result": NaN'),
            Code.INVALID_FRAME, None),
    "Infinity": (body_set("task.finish", "result", [0]).replace("[0]", "[Infinity]"),
                 Code.INVALID_FRAME, None),
    "-Infinity": (body_set("task.finish", "result", {"x": 0}).replace('"x": 0', '"x": -Infinity'),
                  Code.INVALID_FRAME, None),
    "float overflowing to infinity": (
        body_set("task.finish", "result", 0).replace('"result": 0', '"result": 1e400'),
        Code.INVALID_FRAME, None),
    "lone surrogate escape in a string": (
        body_set("task.finish", "result", "x").replace('"result": "x"', '"result": "a\\ud800b"'),
        Code.INVALID_FRAME, None),
    "lone low surrogate escape in a key": (
        body_set("task.finish", "result", {"k": 1}).replace('"k"', '"\\udc00"'), Code.INVALID_FRAME, None),
    "lone surrogate escape in queue_id": (
        body_set("worker.hello", "queue_id", "q").replace('"queue_id": "q"', '"queue_id": "\\ud83d"'),
        Code.INVALID_FRAME, None),
    "lone surrogate escape in uppercase hex": (
        body_set("task.finish", "result", ["x"]).replace('["x"]', '["\\uDBFF"]'), Code.INVALID_FRAME, None),
    "lone surrogate escape after a valid pair": (
        body_set("task.finish", "result", "x").replace('"result": "x"', '"result": "\\ud83d\\ude00\\ude00"'),
        Code.INVALID_FRAME, None),
    "raw lone surrogate character": (
        body_set("task.finish", "result", "x").replace('"result": "x"', '"result": "\ud800"'),
        Code.INVALID_FRAME, None),
    "integer above int64": (body_set("task.finish", "result", INT64_MAX + 1), Code.INVALID_FRAME, None),
    "integer below int64": (body_set("task.finish", "result", -INT64_MAX - 2), Code.INVALID_FRAME, None),
    "integer of 5,000 digits": (body_set("task.finish", "result", 0).replace(
        '"result": 0', '"result": ' + "9" * 5000), Code.INVALID_FRAME, None),
    # Envelope and body are levels 1-2, so deep(MAX_DEPTH - 2) reaches MAX_DEPTH exactly.
    "nesting deeper than the limit": (body_set("task.finish", "result", deep(MAX_DEPTH - 1)),
                                      Code.INVALID_FRAME, None),
    "nesting past the parser's recursion": ("[" * 200_000, Code.INVALID_FRAME, None),
    # envelope
    "protocol_version 2": (text(wire(protocol_version="2")), Code.UNSUPPORTED_VERSION, MID),
    "protocol_version 2 with fields v1 does not know": (
        text(wire(protocol_version="2", trace="x")), Code.UNSUPPORTED_VERSION, MID),
    "protocol_version as a number": (text(wire(protocol_version=1)), Code.INVALID_FRAME, MID),
    "protocol_version missing": (edit("task.start", lambda f: f.pop("protocol_version")),
                                 Code.INVALID_FRAME, MID),
    "unknown type": (text(wire(type="task.pause")), Code.UNKNOWN_TYPE, MID),
    "a server type from a client": (text(wire(type="ack")), Code.UNKNOWN_TYPE, MID),
    "type missing": (edit("task.start", lambda f: f.pop("type")), Code.INVALID_FRAME, MID),
    "type not a string": (text(wire(type=7)), Code.INVALID_FRAME, MID),
    "unknown envelope field": (text(wire(trace="x")), Code.INVALID_FRAME, MID),
    "reply_to from a client": (text(wire(reply_to="5" * 32)), Code.INVALID_FRAME, MID),
    "error from a client": (text(wire(error={"code": "INTERNAL", "message": "x"})), Code.INVALID_FRAME,
                            MID),
    "message_id uppercase": (text(wire(message_id="A" * 32)), Code.INVALID_ID, None),
    "message_id 31 digits": (text(wire(message_id="4" * 31)), Code.INVALID_ID, None),
    "message_id a uuid with dashes": (text(wire(message_id="44444444-4444-4444-4444-444444444444")),
                                      Code.INVALID_ID, None),
    "message_id a number": (text(wire(message_id=4)), Code.INVALID_FRAME, None),
    "message_id missing": (edit("task.start", lambda f: f.pop("message_id")), Code.INVALID_FRAME, None),
    "hello with a session_id": (text(wire("worker.hello", session_id=SID)), Code.INVALID_FRAME, MID),
    "start without a session_id": (edit("task.start", lambda f: f.pop("session_id")),
                                   Code.INVALID_FRAME, MID),
    "capacity without a session_id": (edit("worker.capacity", lambda f: f.pop("session_id")),
                                      Code.INVALID_FRAME, MID),
    "session_id null": (text(wire(session_id=None)), Code.INVALID_FRAME, MID),
    "session_id not hex": (text(wire(session_id="z" * 32)), Code.INVALID_ID, MID),
    "body missing": (edit("task.start", lambda f: f.pop("body")), Code.INVALID_FRAME, MID),
    "body an array": (text(wire(body=[])), Code.INVALID_FRAME, MID),
    "body null": (text(wire(body=None)), Code.INVALID_FRAME, MID),
    # ids, decimals, secrets
    "task_id uppercase": (body_set("task.start", "task_id", "F" * 32), Code.INVALID_ID, MID),
    "attempt_id short": (body_set("task.renew", "attempt_id", "2" * 31), Code.INVALID_ID, MID),
    "instance_id not hex": (body_set("worker.hello", "instance_id", "g" * 32), Code.INVALID_ID, MID),
    "ref task_id in finish": (body_set("task.finish", "ref.task_id", "1" * 33), Code.INVALID_ID, MID),
    "task_id a number": (body_set("task.start", "task_id", 1), Code.INVALID_FRAME, MID),
    "epoch a number": (body_set("task.start", "epoch", 1), Code.INVALID_FRAME, MID),
    "epoch leading zero": (body_set("task.start", "epoch", "01"), Code.INVALID_FRAME, MID),
    "epoch negative": (body_set("task.start", "epoch", "-1"), Code.INVALID_FRAME, MID),
    "epoch empty": (body_set("task.start", "epoch", ""), Code.INVALID_FRAME, MID),
    "epoch with a space": (body_set("task.start", "epoch", " 1"), Code.INVALID_FRAME, MID),
    "epoch with a trailing newline": (body_set("task.start", "epoch", "1\n"), Code.INVALID_FRAME, MID),
    "epoch in another script's digits": (body_set("task.start", "epoch", "\u0661"), Code.INVALID_FRAME,
                                         MID),
    "epoch above int64": (body_set("task.start", "epoch", str(INT64_MAX + 1)), Code.INVALID_FRAME, MID),
    "epoch of 20 digits": (body_set("task.start", "epoch", "1" * 20), Code.INVALID_FRAME, MID),
    "sequence a number": (body_set("worker.capacity", "sequence", 7), Code.INVALID_FRAME, MID),
    "sequence a float string": (body_set("worker.capacity", "sequence", "7.0"), Code.INVALID_FRAME, MID),
    "instance_secret 42 characters": (body_set("worker.hello", "instance_secret", SECRET[:-1]),
                                      Code.INVALID_FRAME, MID),
    "instance_secret padded": (body_set("worker.hello", "instance_secret", SECRET + "="),
                               Code.INVALID_FRAME, MID),
    "instance_secret standard base64 alphabet": (
        body_set("worker.hello", "instance_secret", "+" + SECRET[1:]), Code.INVALID_FRAME, MID),
    "instance_secret not canonical": (body_set("worker.hello", "instance_secret", _NOT_CANONICAL),
                                      Code.INVALID_FRAME, MID),
    "instance_secret a number": (body_set("worker.hello", "instance_secret", 1), Code.INVALID_FRAME, MID),
    "lease_secret empty": (body_set("task.start", "lease_secret", ""), Code.INVALID_FRAME, MID),
    "lease_secret 129 characters": (body_set("task.start", "lease_secret", "s" * 129), Code.INVALID_FRAME,
                                    MID),
    "lease_secret with a slash": (body_set("task.start", "lease_secret", "a/b"), Code.INVALID_FRAME, MID),
    "lease_secret with a space": (body_set("task.renew", "lease_secret", "a b"), Code.INVALID_FRAME, MID),
    "queue_id empty": (body_set("worker.hello", "queue_id", ""), Code.INVALID_FRAME, MID),
    "queue_id with a space": (body_set("worker.hello", "queue_id", "my queue"), Code.INVALID_FRAME, MID),
    "queue_id with a tab": (body_set("worker.hello", "queue_id", "a\tb"), Code.INVALID_FRAME, MID),
    "queue_id with a no-break space": (body_set("worker.hello", "queue_id", "a\u00a0b"),
                                       Code.INVALID_FRAME, MID),
    "queue_id with a NUL": (body_set("worker.hello", "queue_id", "a\u0000b"), Code.INVALID_FRAME, MID),
    "queue_id 256 characters": (body_set("worker.hello", "queue_id", "q" * 256), Code.INVALID_FRAME, MID),
    "queue_id a list": (body_set("worker.hello", "queue_id", ["q"]), Code.INVALID_FRAME, MID),
    # capabilities and capacity
    "capabilities empty": (body_set("worker.hello", "capabilities", []), Code.INVALID_FRAME, MID),
    "capabilities 33": (body_set("worker.hello", "capabilities", caps(MAX_CAPABILITIES + 1)),
                        Code.INVALID_FRAME, MID),
    "capabilities an object": (body_set("worker.hello", "capabilities", caps(1)[0]), Code.INVALID_FRAME,
                               MID),
    "capability duplicated": (body_set("worker.hello", "capabilities", caps(2) + caps(1)),
                              Code.INVALID_FRAME, MID),
    "capability a string": (body_set("worker.hello", "capabilities", ["resize"]), Code.INVALID_FRAME,
                            MID),
    "capability unknown field": (body_set("worker.hello", "capabilities.0.extra", "x"),
                                 Code.INVALID_FRAME, MID),
    "capability missing field": (
        body_set("worker.hello", "capabilities", [{"handler": "h", "handler_version": "1"}]),
        Code.INVALID_FRAME, MID),
    "capability handler empty": (body_set("worker.hello", "capabilities.0.handler", ""),
                                 Code.INVALID_FRAME, MID),
    "capability handler 129 characters": (body_set("worker.hello", "capabilities.0.handler", "h" * 129),
                                          Code.INVALID_FRAME, MID),
    "capability handler a control character": (
        body_set("worker.hello", "capabilities.0.handler", "h\u0007"), Code.INVALID_FRAME, MID),
    "capability version a number": (body_set("worker.hello", "capabilities.1.handler_version", 1),
                                    Code.INVALID_FRAME, MID),
    "hello capacity 0": (body_set("worker.hello", "capacity", 0), Code.INVALID_FRAME, MID),
    "hello capacity 257": (body_set("worker.hello", "capacity", 257), Code.INVALID_FRAME, MID),
    "hello capacity true": (body_set("worker.hello", "capacity", True), Code.INVALID_FRAME, MID),
    "hello capacity 1.0": (body_set("worker.hello", "capacity", 1.0), Code.INVALID_FRAME, MID),
    "hello capacity a string": (body_set("worker.hello", "capacity", "4"), Code.INVALID_FRAME, MID),
    "capacity -1": (body_set("worker.capacity", "capacity", -1), Code.INVALID_FRAME, MID),
    "capacity 257": (body_set("worker.capacity", "capacity", 257), Code.INVALID_FRAME, MID),
    "capacity false": (body_set("worker.capacity", "capacity", False), Code.INVALID_FRAME, MID),
    "drain a string": (body_set("worker.capacity", "drain", "true"), Code.INVALID_FRAME, MID),
    "drain 1": (body_set("worker.capacity", "drain", 1), Code.INVALID_FRAME, MID),
    "drain null": (body_set("worker.capacity", "drain", None), Code.INVALID_FRAME, MID),
    # task.finish
    "finish outcome unknown": (body_set("task.finish", "outcome", "DONE"), Code.INVALID_FRAME, MID),
    "finish outcome lowercase": (body_set("task.finish", "outcome", "succeeded"), Code.INVALID_FRAME, MID),
    "finish SUCCEEDED with error_code": (body_set("task.finish", "error_code", "E1"), Code.INVALID_FRAME,
                                         MID),
    "finish FAILED without error_code": (body_set("task.finish", "outcome", "FAILED"), Code.INVALID_FRAME,
                                         MID),
    "finish UNKNOWN without error_code": (body_set("task.finish", "outcome", "UNKNOWN"),
                                          Code.INVALID_FRAME, MID),
    "finish error_code null": (edit("task.finish", lambda f: f["body"].update(
        outcome="FAILED", error_code=None)), Code.INVALID_FRAME, MID),
    "finish error_code empty": (edit("task.finish", lambda f: f["body"].update(
        outcome="FAILED", error_code="")), Code.INVALID_FRAME, MID),
    "finish error_code 65 characters": (edit("task.finish", lambda f: f["body"].update(
        outcome="FAILED", error_code="E" * 65)), Code.INVALID_FRAME, MID),
    "finish error_code with a space": (edit("task.finish", lambda f: f["body"].update(
        outcome="UNKNOWN", error_code="bad code")), Code.INVALID_FRAME, MID),
    "finish result null": (body_set("task.finish", "result", None), Code.INVALID_FRAME, MID),
    "finish result missing": (body_drop("task.finish", "result"), Code.INVALID_FRAME, MID),
    "finish ref not an object": (body_set("task.finish", "ref", TASK), Code.INVALID_FRAME, MID),
    "finish ref unknown field": (body_set("task.finish", "ref.extra", 1), Code.INVALID_FRAME, MID),
    "finish result too large": (body_set("task.finish", "result", "x" * (MAX_RESULT_BYTES - 1)),
                                Code.RESULT_TOO_LARGE, MID),
    "finish result too large by utf-8 bytes": (
        body_set("task.finish", "result", ["é" * (MAX_RESULT_BYTES // 2)]), Code.RESULT_TOO_LARGE, MID),
}


@pytest.mark.parametrize(("data", "code", "reply_to"), REFUSALS.values(), ids=REFUSALS.keys())
def test_each_rule_refuses_with_its_code(data: str | bytes, code: str, reply_to: str | None) -> None:
    exc = refused(data)
    assert (exc.code, exc.reply_to) == (code, reply_to), exc.message
    # Public messages: short, and never a secret or the value that was refused.
    assert isinstance(exc, PulseError)
    assert 0 < len(exc.message) <= 160
    for secret in (SECRET, _NOT_CANONICAL, SECRET[:-1], LEASE_SECRET, "s" * 129, "9" * 40, "my queue"):
        assert secret not in exc.message


UNKNOWN_FIELDS = [(kind, extra) for kind in CLIENT_TYPES for extra in ("extra", "x" * 200)]


@pytest.mark.parametrize(("kind", "extra"), UNKNOWN_FIELDS)
def test_an_unknown_body_field_is_refused_and_named_only_when_short(kind: str, extra: str) -> None:
    exc = refused(body_set(kind, extra, 1))
    assert (exc.code, exc.reply_to) == (Code.INVALID_FRAME, MID)
    if len(extra) < 64:
        assert repr(extra) in exc.message
    else:
        assert extra not in exc.message and "(not shown)" in exc.message


MISSING_FIELDS = [(kind, field) for kind, body in BODIES.items() for field in body
                  if field != "error_code"] + [("task.finish", f"ref.{field}") for field in REF]


@pytest.mark.parametrize(("kind", "field"), MISSING_FIELDS)
def test_a_missing_body_field_is_refused(kind: str, field: str) -> None:
    exc = refused(body_drop(kind, field))
    assert (exc.code, exc.reply_to) == (Code.INVALID_FRAME, MID)
    assert field.rsplit(".", 1)[-1] in exc.message


ACCEPTED = {
    "frame of exactly MAX_FRAME_BYTES": _VALID + " " * (MAX_FRAME_BYTES - len(_VALID)),
    "result of exactly MAX_RESULT_BYTES": body_set("task.finish", "result", "x" * (MAX_RESULT_BYTES - 2)),
    "result given in escapes, small as UTF-8": body_set("task.finish", "result", "x").replace(
        '"result": "x"', '"result": "' + "\\u00e9" * (MAX_RESULT_BYTES // 4) + '"'),
    "surrogate pair escape": body_set("task.finish", "result", "x").replace(
        '"result": "x"', '"result": "\\ud83d\\ude00"'),
    "an escaped backslash before ud800 (no surrogate)": body_set("task.finish", "result", "x").replace(
        '"result": "x"', '"result": "\\\\ud800"'),
    "result false": body_set("task.finish", "result", False),
    "result a float": body_set("task.finish", "result", -1.5e-300),
    "result int64 bounds": body_set("task.finish", "result", [INT64_MAX, -INT64_MAX - 1]),
    "result nested to the limit": body_set("task.finish", "result", deep(MAX_DEPTH - 2)),
    "FAILED with error_code": edit("task.finish", lambda f: f["body"].update(
        outcome="FAILED", error_code="billing.card:declined-2_x")),
    "UNKNOWN with 64-character error_code": edit("task.finish", lambda f: f["body"].update(
        outcome="UNKNOWN", error_code="E" * 64)),
    "epoch int64 max": body_set("task.start", "epoch", str(INT64_MAX)),
    "epoch 0": body_set("task.start", "epoch", "0"),
    "lease_secret 128 characters": body_set("task.start", "lease_secret", "s" * 128),
    "lease_secret unreserved punctuation": body_set("task.start", "lease_secret", "a.b~c_d-e"),
    "queue_id 255 non-ASCII characters": body_set("worker.hello", "queue_id", "队" * 255),
    "32 capabilities": body_set("worker.hello", "capabilities", caps(MAX_CAPABILITIES)),
    "capability label 128 characters": body_set("worker.hello", "capabilities.0.handler", "h" * 128),
    "hello capacity 1": body_set("worker.hello", "capacity", 1),
    "hello capacity 256": body_set("worker.hello", "capacity", 256),
    "capacity 0 with drain": edit("worker.capacity", lambda f: f["body"].update(capacity=0, drain=True)),
    "whitespace around the object": "\n\t " + _VALID + " \r\n",
}


@pytest.mark.parametrize("data", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_values_at_the_edges_are_accepted(data: str) -> None:
    assert isinstance(decode_client(data), Frame)


def test_the_parser_recursion_limit_is_not_what_bounds_depth() -> None:
    # 80 levels parse fine in json; the codec's own limit refuses them.
    assert isinstance(json.loads(text(deep(80))), list)
    assert refused(body_set("task.finish", "result", deep(80))).message.startswith("JSON nested deeper")


# -- round trips ---------------------------------------------------------------------------

EXPECTED_BODIES: dict[str, Any] = {
    "worker.hello": Hello(INSTANCE, SECRET, "objects",
                          frozenset({Capability("crop", "1", "1"), Capability("resize", "2", "1")}), 4),
    "worker.resume": AttemptRef(TASK, ATTEMPT, 1, LEASE_SECRET),
    "worker.capacity": CapacityUpdate(7, 3, False),
    "task.start": Start(TASK, ATTEMPT, 1, LEASE_SECRET),
    "task.renew": AttemptRef(TASK, ATTEMPT, 1, LEASE_SECRET),
    "task.finish": Finish(AttemptRef(TASK, ATTEMPT, 1, LEASE_SECRET), "SUCCEEDED",
                          {"ok": [1, 2.5, "é"]}, None),
    "task.query": TaskQuery(TASK),
}


def _normal(frame: dict[str, Any]) -> dict[str, Any]:
    """A wire frame with capabilities in a fixed order (the order is not part of a hello)."""
    frame = copy.deepcopy(frame)
    if frame.get("type") == "worker.hello":
        frame["body"]["capabilities"].sort(key=lambda c: json.dumps(c, sort_keys=True))
    return frame


@pytest.mark.parametrize("kind", CLIENT_TYPES)
def test_every_client_type_decodes_to_its_record_and_encodes_back(kind: str) -> None:
    frame = decode_client(text(wire(kind)))
    assert isinstance(frame.body, CLIENT_TYPES[kind])
    assert frame == Frame(kind, MID, EXPECTED_BODIES[kind],
                          session_id=None if kind == "worker.hello" else SID)
    encoded = encode(frame)
    assert _normal(json.loads(encoded)) == _normal(wire(kind))
    assert decode_client(encoded) == frame
    assert " " not in encoded.replace("objects", "")  # compact
    assert '"epoch":"1"' in encoded or kind in ("worker.hello", "worker.capacity", "task.query")


def test_a_failed_finish_round_trips_with_its_error_code() -> None:
    data = edit("task.finish", lambda f: f["body"].update(outcome="FAILED", error_code="E_TIMEOUT",
                                                            result={"evidence": "ref:1"}))
    frame = decode_client(data)
    assert frame.body.error_code == "E_TIMEOUT" and frame.body.outcome == "FAILED"
    assert json.loads(encode(frame))["body"]["error_code"] == "E_TIMEOUT"
    assert decode_client(encode(frame)) == frame


# -- server frames -------------------------------------------------------------------------

WELCOME = {"session_id": SID, "epoch": "2", "server_time": "2026-09-17T08:00:00Z",
           "expires_at": "2026-09-17T08:00:45Z", "lease_duration_ms": 30000, "draining": False}


def test_server_frames_decode_with_their_body_left_a_dict() -> None:
    welcome = Frame("worker.welcome", new_id(), dict(WELCOME), session_id=SID, reply_to=MID)
    assert decode_server(encode(welcome)) == welcome
    assign = Frame("task.assign", new_id(), {"task": {"id": TASK, "payload": [1.5]}, "epoch": "1"},
                   session_id=SID)
    assert decode_server(encode(assign)) == assign
    reply = ack(MID, SID, {"receipt": {"task_revision": "3"}, "deduplicated": False})
    assert (reply.type, reply.reply_to, reply.session_id) == ("ack", MID, SID)
    assert decode_server(encode(reply)) == reply


def test_an_error_frame_carries_code_message_and_the_failed_frames_id() -> None:
    exc = refused(text(wire(type="task.cancel")))
    frame = error_frame(exc, SID)
    assert frame.body is None and frame.error == ErrorInfo(Code.UNKNOWN_TYPE, exc.message)
    wire_form = json.loads(encode(frame))
    assert set(wire_form) == {"protocol_version", "type", "message_id", "reply_to", "session_id", "error"}
    assert wire_form["reply_to"] == MID
    assert decode_server(encode(frame)) == frame
    # An unreadable frame, and no session yet: neither id is sent.
    anonymous = error_frame(refused(b"\x00"), None)
    assert set(json.loads(encode(anonymous))) == {"protocol_version", "type", "message_id", "error"}
    assert decode_server(encode(anonymous)) == anonymous


def _server(**fields: Any) -> str:
    frame = {"protocol_version": "1", "message_id": "5" * 32, **fields}
    return text({k: v for k, v in frame.items() if v is not ...})


SERVER_REFUSALS: dict[str, tuple[str | bytes, str]] = {
    "binary": (b"{}", Code.INVALID_FRAME),
    "a client type": (_server(type="task.start", session_id=SID, body=REF), Code.UNKNOWN_TYPE),
    "unknown type": (_server(type="task.pause", body={}), Code.UNKNOWN_TYPE),
    "version 2": (_server(type="ack", protocol_version="2", reply_to=MID, body={}),
                  Code.UNSUPPORTED_VERSION),
    "ack without reply_to": (_server(type="ack", body={}), Code.INVALID_FRAME),
    "welcome without reply_to": (_server(type="worker.welcome", body=WELCOME), Code.INVALID_FRAME),
    "assign with reply_to": (_server(type="task.assign", reply_to=MID, body={}), Code.INVALID_FRAME),
    "ack without body": (_server(type="ack", reply_to=MID), Code.INVALID_FRAME),
    "ack body an array": (_server(type="ack", reply_to=MID, body=[]), Code.INVALID_FRAME),
    "ack with error": (_server(type="ack", reply_to=MID, body={}, error={"code": "X", "message": ""}),
                       Code.INVALID_FRAME),
    "error without error": (_server(type="error", reply_to=MID), Code.INVALID_FRAME),
    "error with body": (_server(type="error", body={}, error={"code": "INTERNAL", "message": "x"}),
                        Code.INVALID_FRAME),
    "error code not a string": (_server(type="error", error={"code": 1, "message": "x"}),
                                Code.INVALID_FRAME),
    "error with an extra field": (_server(type="error", error={"code": "X", "message": "x", "sql": "…"}),
                                  Code.INVALID_FRAME),
    "reply_to not an id": (_server(type="ack", reply_to="x", body={}), Code.INVALID_ID),
    "session_id not an id": (_server(type="ack", reply_to=MID, session_id="X" * 32, body={}),
                             Code.INVALID_ID),
    "unknown envelope field": (_server(type="ack", reply_to=MID, body={}, trace=1), Code.INVALID_FRAME),
    "duplicate key in the body": (_server(type="ack", reply_to=MID, body={"a": 1}).replace(
        '{"a": 1}', '{"a": 1, "a": 2}'), Code.INVALID_FRAME),
}


@pytest.mark.parametrize(("data", "code"), SERVER_REFUSALS.values(), ids=SERVER_REFUSALS.keys())
def test_server_frames_are_checked_by_the_client(data: str | bytes, code: str) -> None:
    assert refused(data, decode_server).code == code


def test_server_types_are_not_client_types() -> None:
    assert not SERVER_TYPES & CLIENT_TYPES.keys()


# -- small parts ---------------------------------------------------------------------------


def test_ids_are_fresh_lowercase_hex() -> None:
    ids = {new_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 and set(i) <= set("0123456789abcdef") for i in ids)
    assert ack(MID, None, {}).message_id != ack(MID, None, {}).message_id


def test_ack_copies_its_body() -> None:
    body = {"deduplicated": False}
    reply = ack(MID, SID, body)
    body["deduplicated"] = True
    assert reply.body == {"deduplicated": False}


def test_codes_are_their_names_and_all_are_listed() -> None:
    names = {name for name in vars(Code) if name.isupper() and name != "ALL"}
    assert len(names) == 18
    assert {getattr(Code, name) for name in names} == set(Code.ALL) == names


def test_protocol_error_keeps_its_fields_through_pickle_and_refuses_unknown_codes() -> None:
    exc = ProtocolError(Code.LEASE_LOST, "attempt no longer grants execution authority", reply_to=MID)
    copied = pickle.loads(pickle.dumps(exc))
    assert (copied.code, copied.message, copied.reply_to) == (exc.code, exc.message, MID)
    assert str(copied) == exc.message
    with pytest.raises(ValueError):
        ProtocolError("LEASE_GONE", "x")


def test_canonical_covers_type_and_body_but_not_envelope_ids() -> None:
    start = decode_client(text(wire("task.start")))
    resent = decode_client(text(wire("task.start", message_id="6" * 32, session_id="7" * 32)))
    assert canonical(start) == canonical(resent)
    assert canonical(start) != canonical(decode_client(text(wire("task.renew"))))
    assert canonical(start) != canonical(decode_client(body_set("task.start", "epoch", "2")))
    assert canonical(start.body) == canonical(dict(REF)) != canonical(start)
    assert len(canonical(start)) == 64 and set(canonical(start)) <= set(string.hexdigits.lower())


# -- properties ----------------------------------------------------------------------------

hex_ids = st.text("0123456789abcdef", min_size=32, max_size=32)
decimals = st.integers(0, INT64_MAX).map(str)
instance_secrets = st.binary(min_size=32, max_size=32).map(
    lambda raw: base64.urlsafe_b64encode(raw).rstrip(b"=").decode())
lease_secrets = st.text(string.ascii_letters + string.digits + "._~-", min_size=1, max_size=128)
printable = st.characters(exclude_categories=("C", "Z"))
labels = st.text(printable, min_size=1, max_size=128)
queue_ids = st.text(printable, min_size=1, max_size=255).filter(lambda s: not any(c.isspace() for c in s))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-INT64_MAX - 1, INT64_MAX)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=16)
results = json_values.filter(lambda v: v is not None)
error_codes = st.text(string.ascii_letters + string.digits + "_.:-", min_size=1, max_size=64)

refs = st.fixed_dictionaries({"task_id": hex_ids, "attempt_id": hex_ids, "epoch": decimals,
                              "lease_secret": lease_secrets})
capability_lists = st.lists(st.tuples(labels, labels, labels), min_size=1, max_size=MAX_CAPABILITIES,
                            unique=True).map(lambda items: [
    {"handler": h, "handler_version": hv, "payload_version": pv} for h, hv, pv in items])
hello_bodies = st.fixed_dictionaries({
    "instance_id": hex_ids, "instance_secret": instance_secrets, "queue_id": queue_ids,
    "capabilities": capability_lists, "capacity": st.integers(1, 256)})
capacity_bodies = st.fixed_dictionaries({"sequence": decimals, "capacity": st.integers(0, 256),
                                         "drain": st.booleans()})
finish_bodies = st.one_of(
    st.fixed_dictionaries({"ref": refs, "outcome": st.just("SUCCEEDED"), "result": results}),
    st.fixed_dictionaries({"ref": refs, "outcome": st.sampled_from(["FAILED", "UNKNOWN"]),
                           "result": results, "error_code": error_codes}))
BODY_STRATEGIES = {"worker.hello": hello_bodies, "worker.resume": refs, "worker.capacity": capacity_bodies,
                   "task.start": refs, "task.renew": refs, "task.finish": finish_bodies}


@st.composite
def client_frames(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(BODY_STRATEGIES)))
    frame: dict[str, Any] = {"protocol_version": "1", "type": kind, "message_id": draw(hex_ids)}
    if kind != "worker.hello":
        frame["session_id"] = draw(hex_ids)
    frame["body"] = draw(BODY_STRATEGIES[kind])
    return frame


def shuffled(value: Any, rnd: random.Random) -> Any:
    """The same JSON with every object's keys, and a hello's capabilities, in another order."""
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        out = {key: shuffled(value[key], rnd) for key in keys}
        if "capabilities" in out and "instance_secret" in out:
            rnd.shuffle(out["capabilities"])
        return out
    if isinstance(value, list):
        return [shuffled(item, rnd) for item in value]
    return value


@PROPERTY
@given(client_frames(), st.booleans())
def test_encoding_a_decoded_frame_is_stable(frame: dict[str, Any], ascii_only: bool) -> None:
    decoded = decode_client(json.dumps(frame, ensure_ascii=ascii_only))
    encoded = encode(decoded)
    assert decode_client(encoded) == decoded
    assert encode(decode_client(encoded)) == encoded
    assert _normal(json.loads(encoded)) == _normal(frame)


@PROPERTY
@given(client_frames(), st.randoms(use_true_random=False))
def test_canonical_ignores_key_and_capability_order(frame: dict[str, Any], rnd: random.Random) -> None:
    original = decode_client(text(frame))
    reordered = decode_client(text(shuffled(frame, rnd)))
    assert reordered == original
    assert canonical(reordered) == canonical(original)
    # encode() sends a result's keys in the order they came; only the digest sorts them.
    assert json.loads(encode(reordered)) == json.loads(encode(original))


@PROPERTY
@given(client_frames(), client_frames())
def test_canonical_differs_when_type_or_body_differs(one: dict[str, Any], other: dict[str, Any]) -> None:
    a, b = decode_client(text(one)), decode_client(text(other))
    same = (a.type == b.type
            and json.dumps(_normal(one)["body"], sort_keys=True) == json.dumps(_normal(other)["body"],
                                                                               sort_keys=True))
    assert (canonical(a) == canonical(b)) == same


@PROPERTY
@given(results)
def test_canonical_follows_a_changed_result(result: Any) -> None:
    finish = wire("task.finish")
    before = decode_client(text(finish))
    finish["body"]["result"] = result
    after = decode_client(text(finish))
    changed = json.dumps(result, sort_keys=True) != json.dumps(BODIES["task.finish"]["result"],
                                                               sort_keys=True)
    assert (canonical(before) != canonical(after)) == changed


def _only_protocol_errors(data: str | bytes) -> None:
    for decode in (decode_client, decode_server):
        try:
            frame = decode(data)
        except ProtocolError as exc:
            assert exc.code in Code.ALL and exc.message
        else:
            assert isinstance(frame, Frame)


@PROPERTY
@given(st.text(st.characters(exclude_categories=())) | st.binary(max_size=64))
def test_arbitrary_text_raises_only_protocol_errors(data: str | bytes) -> None:
    _only_protocol_errors(data)


ENVELOPE_KEYS = ["protocol_version", "type", "message_id", "session_id", "body", "reply_to", "error",
                 "extra"]
near_values = st.one_of(json_values, hex_ids, st.sampled_from(["1", "2", *CLIENT_TYPES, *SERVER_TYPES]),
                        refs, hello_bodies, capacity_bodies, finish_bodies)


@PROPERTY
@given(st.dictionaries(st.sampled_from(ENVELOPE_KEYS), near_values, max_size=7))
def test_frames_near_valid_ones_raise_only_protocol_errors(frame: dict[str, Any]) -> None:
    _only_protocol_errors(text(frame))


@PROPERTY
@given(client_frames(), st.data())
def test_corrupted_valid_frames_raise_only_protocol_errors(frame: dict[str, Any], data: st.DataObject
                                                           ) -> None:
    raw = text(frame)
    start = data.draw(st.integers(0, len(raw)))
    end = data.draw(st.integers(start, min(len(raw), start + 8)))
    insert = data.draw(st.text(st.characters(exclude_categories=()) | st.sampled_from('{}[]",:\\0eE-.'),
                               max_size=8))
    _only_protocol_errors(raw[:start] + insert + raw[end:])
