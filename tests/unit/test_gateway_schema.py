"""The published JSON Schema of pulse.worker.v1 and the codec agree (issue 37).

* The field sets, types, enums and bounds the codec knows are the schema's, both ways:
  a field, a code or a bound added to one and not the other fails here.
* Every frame the codec and the receipt functions write is valid by the schema.
* Generated frames, valid or broken one field at a time, get the same verdict from the
  schema and from the decoder; a catalogue of broken frames is refused by both.
* What JSON Schema can't say (a frame's size in bytes, 1.0 as an integer, int64's top,
  Unicode printability outside the listed ranges) is a documented gap, each asserted as
  one: the schema is never stricter than the codec.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import re
import string
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tomllib
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from jsonschema import Draft202012Validator

from celery_pulse.gateway import frames, refs
from celery_pulse.gateway.cancels import cancel_body, revoke_control
from celery_pulse.gateway.frames import (
    CLIENT_TYPES,
    INT64_MAX,
    MAX_CAPABILITIES,
    MAX_CAPACITY,
    MAX_ERROR_MESSAGE,
    MAX_LABEL,
    MAX_QUEUE_ID,
    OUTCOMES,
    PROTOCOL_VERSION,
    SERVER_TYPES,
    AttemptRef,
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
    ack,
    decode_client,
    decode_server,
    encode,
    error_frame,
    new_id,
)
from celery_pulse.gateway.link import Limits
from celery_pulse.gateway.protocol import (
    MAX_PERMIT_KEY,
    MAX_PERMIT_LIMIT,
    MAX_PERMITS,
    RATE_WINDOWS_MS,
)
from celery_pulse.gateway.receipts import (
    DISPOSITIONS,
    OUTCOME_STATES,
    assign_body,
    command_result,
    lease_body,
    timestamp,
    welcome_body,
)
from celery_pulse.store.records import Message
from tests.helpers.schema import (
    DEFS,
    SCHEMA,
    SCHEMA_FILE,
    assert_client,
    assert_server,
    client_valid,
    frame_definitions,
    properties,
    required,
    schema_text,
    server_valid,
)

ROOT = Path(__file__).resolve().parents[2]
MID, SID, TASK, ATTEMPT, INSTANCE = "4" * 32, "3" * 32, "1" * 32, "2" * 32, "a" * 32
SECRET = base64.urlsafe_b64encode(bytes(range(32))).rstrip(b"=").decode()
REF = {"task_id": TASK, "attempt_id": ATTEMPT, "epoch": "1", "lease_secret": "lease-secret_0"}
BODIES: dict[str, dict[str, Any]] = {
    "worker.hello": {"instance_id": INSTANCE, "instance_secret": SECRET, "queue_id": "objects",
                     "capabilities": [{"handler": "resize", "handler_version": "2",
                                       "payload_version": "1"}], "capacity": 4},
    "worker.resume": REF,
    "worker.capacity": {"sequence": "7", "capacity": 3, "drain": False},
    "task.start": REF,
    "task.renew": REF,
    "task.finish": {"ref": REF, "outcome": "SUCCEEDED", "result": {"ok": [1, 2.5, "é"]}},
    "task.query": {"task_id": TASK},
}
PROPERTY = settings(database=None, deadline=None, max_examples=300)


@pytest.fixture(autouse=True)
def hypothesis_home(tmp_path: Path) -> Iterator[None]:
    set_hypothesis_home_dir(tmp_path / "hypothesis")
    try:
        yield
    finally:
        set_hypothesis_home_dir(None)


def wire(kind: str, **envelope: Any) -> dict[str, Any]:
    frame: dict[str, Any] = {"protocol_version": "1", "type": kind, "message_id": MID}
    if kind != "worker.hello":
        frame["session_id"] = SID
    frame["body"] = copy.deepcopy(BODIES[kind])
    frame.update(envelope)
    return frame


def codec_accepts(frame: Any, decode: Callable[[str], Frame] = decode_client) -> bool:
    try:
        decode(json.dumps(frame, ensure_ascii=False))
    except ProtocolError:
        return False
    return True


# -- the file ----------------------------------------------------------------------------
def test_the_schema_is_draft_2020_12_and_valid() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(SCHEMA)


def test_the_schema_ships_as_package_data_and_is_published_in_the_docs() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = [Path("celery_pulse", *package.split(".")[1:], pattern)
               for package, patterns in data.items() for pattern in patterns]
    target = Path("celery_pulse/gateway/schema") / SCHEMA_FILE
    assert any(target.match(str(glob)) for glob in shipped), data
    page = (ROOT / "docs" / "gateway-schema.md").read_text()
    embedded = re.search(r"<!-- schema:begin -->\n```json\n(.*?)```\n<!-- schema:end -->", page,
                         re.S)
    assert embedded is not None, "docs/gateway-schema.md lost its schema markers"
    assert embedded.group(1) == schema_text(), (
        f"docs/gateway-schema.md is out of date: copy celery_pulse/gateway/schema/{SCHEMA_FILE} "
        "between its markers")
    assert "gateway-schema.md" in (ROOT / "mkdocs.yml").read_text()


# -- the codec's vocabulary is the schema's ------------------------------------------------
def _fields(record: type) -> set[str]:
    return {field.name for field in dataclasses.fields(record)}


BODY_DEFINITIONS = {"worker.hello": "hello_body", "worker.resume": "attempt_ref",
                    "worker.capacity": "capacity_body", "task.start": "start_body",
                    "task.renew": "attempt_ref", "task.finish": "finish_body",
                    "task.query": "query_body"}


def test_frame_types_are_the_codecs() -> None:
    assert set(frame_definitions("client")) == set(CLIENT_TYPES)
    assert set(frame_definitions("server")) == set(SERVER_TYPES)


@pytest.mark.parametrize("kind", CLIENT_TYPES)
def test_each_client_body_has_the_records_fields(kind: str) -> None:
    definition = frame_definitions("client")[kind]
    assert DEFS[definition]["properties"]["body"] == {"$ref": f"#/$defs/{BODY_DEFINITIONS[kind]}"}
    fields = _fields(CLIENT_TYPES[kind])
    assert properties(BODY_DEFINITIONS[kind]) == fields
    # What encode() writes for a record is what the schema lists.
    written = json.loads(encode(decode_client(json.dumps(wire(kind)))))["body"]
    assert set(written) == fields - {"error_code", "permits"}  # optional, absent here


def test_body_field_sets_are_the_codecs_readers() -> None:
    assert properties("hello_body") == required("hello_body") == frames._HELLO_FIELDS
    assert properties("capability") == required("capability") == frames._CAPABILITY_FIELDS
    assert _fields(Capability) == frames._CAPABILITY_FIELDS
    assert properties("attempt_ref") == required("attempt_ref") == refs.REF_FIELDS
    assert required("start_body") == refs.REF_FIELDS
    assert properties("start_body") == refs.REF_FIELDS | {"permits"} == _fields(Start)
    assert required("permit") == refs.PERMIT_FIELDS
    assert properties("permit") == refs.PERMIT_FIELDS | refs.PERMIT_OPTIONAL == _fields(PermitAsk)
    assert DEFS["permit"]["properties"]["window_ms"]["enum"] == list(RATE_WINDOWS_MS)
    assert properties("capacity_body") == required("capacity_body") == frames._CAPACITY_FIELDS
    assert required("finish_body") == frames._FINISH_FIELDS
    assert properties("finish_body") == frames._FINISH_FIELDS | frames._FINISH_OPTIONAL
    assert properties("error_info") == required("error_info") == _fields(ErrorInfo)


def test_envelopes_are_the_codecs() -> None:
    client = frame_definitions("client").values()
    assert set().union(*(properties(d) for d in client)) == frames._CLIENT_ENVELOPE
    server = frame_definitions("server").values()
    assert set().union(*(properties(d) for d in server)) == frames._SERVER_ENVELOPE
    for definition in [*client, *server]:
        assert DEFS[definition]["additionalProperties"] is False
        assert DEFS[definition]["properties"]["protocol_version"] == {"const": PROTOCOL_VERSION}
        assert {"protocol_version", "type", "message_id"} <= required(definition)
    assert "session_id" not in properties("worker.hello")
    assert all("session_id" in required(d) for d in client if d != "worker.hello")
    assert {"reply_to", "body"} <= required("ack") & required("worker.welcome")
    assert "reply_to" not in properties("task.assign")
    assert "body" not in properties("error") and "error" in required("error")


def test_enums_and_bounds_are_the_codecs() -> None:
    assert set(DEFS["error_info"]["properties"]["code"]["enum"]) == Code.ALL
    assert set(DEFS["finish_body"]["properties"]["outcome"]["enum"]) == OUTCOMES
    receipt = DEFS["receipt"]["properties"]
    # BUSY: a renewal the store could not make while a fenced block held the row.
    # WAITING: a start (and its renewals) with no free concurrency permit yet.
    assert set(receipt["disposition"]["enum"]) == set(DISPOSITIONS.values()) | {"BUSY", "WAITING"}
    permits = DEFS["start_body"]["properties"]["permits"]
    assert permits["maxItems"] == MAX_PERMITS
    assert DEFS["permit"]["properties"]["key"]["maxLength"] == MAX_PERMIT_KEY
    assert DEFS["permit"]["properties"]["limit"]["maximum"] == MAX_PERMIT_LIMIT
    assert set(OUTCOME_STATES.values()) < set(receipt["task_state"]["enum"])
    hello = DEFS["hello_body"]["properties"]
    assert hello["capabilities"]["maxItems"] == MAX_CAPABILITIES
    assert hello["capacity"]["maximum"] == DEFS["capacity_body"]["properties"]["capacity"][
        "maximum"] == MAX_CAPACITY
    assert DEFS["label"]["maxLength"] == MAX_LABEL
    assert DEFS["queue_id"]["maxLength"] == MAX_QUEUE_ID
    assert DEFS["error_info"]["properties"]["message"]["maxLength"] == MAX_ERROR_MESSAGE
    assert DEFS["decimal"]["maxLength"] == len(str(INT64_MAX))
    assert (DEFS["welcome_fields"]["properties"]["lease_duration_ms"]["maximum"]
            == Limits().lease_ttl * 1000)


# -- what the codec and the receipts write ---------------------------------------------------
def _hello_record() -> Hello:
    return Hello(INSTANCE, SECRET, "objects", frozenset({Capability("crop", "1", "1"),
                                                         Capability("resize", "2", "1")}), 4)


RECORDS: dict[str, Any] = {
    "worker.hello": _hello_record(),
    "worker.resume": AttemptRef(TASK, ATTEMPT, 3, "tok"),
    "worker.capacity": CapacityUpdate(INT64_MAX, 0, True),
    "task.start": Start(TASK, ATTEMPT, 0, "a" * 128, (PermitAsk("task:app.x[1]", 3),
                                                      PermitAsk("queue:q", MAX_PERMIT_LIMIT),
                                                      PermitAsk("rate:task:app.x", 5, 60_000))),
    "task.renew": AttemptRef(TASK, ATTEMPT, INT64_MAX, "x"),
    "task.finish": Finish(AttemptRef(TASK, ATTEMPT, 1, "t"), "FAILED", {"why": None}, "E.x:1-_"),
    "task.query": TaskQuery(TASK),
}


@pytest.mark.parametrize("kind", CLIENT_TYPES)
def test_every_client_frame_the_codec_writes_is_valid(kind: str) -> None:
    session = None if kind == "worker.hello" else new_id()
    written = json.loads(encode(Frame(kind, new_id(), RECORDS[kind], session_id=session)))
    assert_client(written)
    # And the frame read back and written again.
    assert_client(json.loads(encode(decode_client(json.dumps(wire(kind))))))


@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
def test_every_finish_outcome_the_codec_writes_is_valid(outcome: str) -> None:
    code = None if outcome == "SUCCEEDED" else "E_CODE"
    for result in ({"a": [1, 2.5]}, "text", 0, False, [], {}):
        assert_client(json.loads(encode(Frame("task.finish", new_id(), Finish(
            AttemptRef(TASK, ATTEMPT, 9, "t"), outcome, result, code), session_id=SID))))


NOW = 1_789_632_000.123
_ATTEMPT = SimpleNamespace(task_id="5f1a9c3e-0000-4000-8000-00000000abcd",
                           wire_task_id="5f1a9c3e000040008000" + "00000000abcd",
                           attempt_id=new_id(), epoch=12, token="tok_en-1.2~", task_name="app.add",
                           lease_until=NOW + 30)
_MESSAGE = Message(body=b'[[2, 2], {}, {"callbacks": null}]',
                   headers={"lang": "py", "task": "app.add", "id": _ATTEMPT.task_id,
                            "retries": 0, "eta": None, "argsrepr": "(2, 2)", "timelimit": [None, None]},
                   properties={"correlation_id": _ATTEMPT.task_id, "priority": 0,
                               "delivery_tag": "x", "body_encoding": "base64"},
                   delivery_info={"exchange": "", "routing_key": "objects"},
                   content_type="application/json", content_encoding="utf-8")


def _receipts() -> dict[str, dict[str, Any]]:
    """Every body the gateway's receipt functions write, as operations use them."""
    lease = lease_body(True, "RUNNING", NOW + 30, NOW)
    lost = lease_body(False, "LOST", None, NOW)
    instance = SimpleNamespace(capacity=SimpleNamespace(drain=True))
    session = SimpleNamespace(session_id=new_id(), epoch=7)
    welcome = welcome_body(instance, session, NOW, 45.0, 30.0)
    bodies = {
        "start": command_result("start", "RUNNING", "RUNNING", _ATTEMPT, NOW + 30, "APPLIED", lease),
        "renew busy": command_result("renew", "RUNNING", "RUNNING", _ATTEMPT, NOW + 30, "BUSY", lease),
        "start waiting": command_result("start", "WAITING", "LEASED", _ATTEMPT, NOW + 30, "WAITING",
                                        lease_body(True, "WAITING", NOW + 30, NOW)),
        "renew waiting": command_result("renew", "WAITING", "LEASED", _ATTEMPT, NOW + 30, "APPLIED",
                                        lease_body(True, "WAITING", NOW + 30, NOW)),
        "resume": {"lease": lost, "deduplicated": False},
        "capacity": welcome,
        "capacity repeated": {**welcome, "deduplicated": True},
    }
    for answer, disposition in DISPOSITIONS.items():
        for outcome, state in OUTCOME_STATES.items():
            task_state = state if answer != "evidence" else "UNKNOWN"
            bodies[f"finish {outcome} {answer}"] = command_result(
                "finish", task_state, "FINISHED", _ATTEMPT, None, disposition,
                {"active": False, "state": task_state, "lease_until": None,
                 "server_time": lease["server_time"]})
    bodies["finish repeated"] = {**bodies["finish SUCCEEDED applied"], "deduplicated": True}
    bodies["query"] = {"task_id": TASK, "task_state": "NEEDS_REVIEW", "epoch": "2",
                       "attempts": [{"attempt_id": ATTEMPT, "epoch": "1",
                                     "assigned_at": timestamp(NOW), "current": False,
                                     "mine": True}],
                       "evidence": [{"epoch": "1", "outcome": "SUCCEEDED", "error": "",
                                     "recorded_at": timestamp(NOW), "mine": True}],
                       "deduplicated": False}
    return bodies


@pytest.mark.parametrize("name", _receipts())
def test_every_ack_the_gateway_writes_is_valid(name: str) -> None:
    assert_server(json.loads(encode(ack(MID, SID, _receipts()[name]))))
    assert_server(json.loads(encode(ack(MID, None, _receipts()[name]))))


def test_the_cancels_the_gateway_writes_are_valid_and_the_worker_reads_them() -> None:
    for terminate, signal in ((False, None), (True, None), (True, "SIGKILL")):
        body = cancel_body(new_id(), new_id(), 3, terminate, signal)
        assert set(body) <= properties("cancel_body")
        frame = json.loads(encode(Frame("task.cancel", new_id(), body, SID)))
        assert_server(frame)
        control = revoke_control("celery-id", frames.decode_server(json.dumps(frame)).body)
        assert control["arguments"] == {"task_id": "celery-id", "terminate": terminate,
                                        **({"signal": signal} if signal else {})}
    with pytest.raises(ProtocolError):  # the gateway sends it on its own
        frames.decode_server(json.dumps(
            {**json.loads(encode(Frame("task.cancel", new_id(), body, SID))), "reply_to": MID}))


def test_the_welcome_and_the_assignment_the_gateway_writes_are_valid() -> None:
    instance = SimpleNamespace(capacity=SimpleNamespace(drain=False))
    session = SimpleNamespace(session_id=new_id(), epoch=1)
    welcome = welcome_body(instance, session, NOW, 45.0, 30.0)
    assert set(welcome) == properties("welcome_fields")
    assert_server(json.loads(encode(Frame("worker.welcome", new_id(), welcome,
                                          session.session_id, MID))))
    body = assign_body(_ATTEMPT, _MESSAGE, 30.0)
    assert set(body) == properties("assign_body")
    assert set(body["task"]) == properties("celery_message")
    assert_server(json.loads(encode(Frame("task.assign", new_id(), body, SID))))
    start = command_result("start", "RUNNING", "RUNNING", _ATTEMPT, NOW, "APPLIED",
                           lease_body(True, "RUNNING", NOW, NOW))
    assert set(start) == properties("command_result")
    assert set(start["receipt"]) == properties("receipt")
    assert set(start["lease"]) == properties("lease_status")


ERRORS = {f"{code} {where}": (code, reply_to, session)
          for code in sorted(Code.ALL)
          for where, reply_to, session in [("in reply", MID, SID), ("before a session", MID, None),
                                           ("unreadable", None, None)]}


@pytest.mark.parametrize(("code", "reply_to", "session"), ERRORS.values(), ids=ERRORS.keys())
def test_every_error_frame_is_valid(code: str, reply_to: str | None, session: str | None) -> None:
    exc = ProtocolError(code, "m" * MAX_ERROR_MESSAGE, reply_to=reply_to)
    assert_server(json.loads(encode(error_frame(exc, session))))


def test_the_errors_the_decoder_raises_make_valid_error_frames() -> None:
    for data in ["", "[]", "{}", json.dumps(wire("task.start", type="task.cancel")),
                 json.dumps(wire("task.start", protocol_version="2")),
                 json.dumps(wire("task.finish", body={**REF})), "x" * (frames.MAX_FRAME_BYTES + 1)]:
        with pytest.raises(ProtocolError) as info:
            decode_client(data)
        assert_server(json.loads(encode(error_frame(info.value, SID))))


# -- refused by both ------------------------------------------------------------------------
def _set(kind: str, path: str, value: Any) -> dict[str, Any]:
    frame = wire(kind)
    *parents, last = path.split(".")
    target: Any = frame
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    index: Any = int(last) if isinstance(target, list) else last
    if value is ...:
        del target[index]
    else:
        target[index] = value
    return frame


def _failed(**fields: Any) -> dict[str, Any]:
    frame = wire("task.finish")
    frame["body"].update({"outcome": "FAILED", "error_code": "E1", **fields})
    return frame


CLIENT_INVALID: dict[str, dict[str, Any]] = {
    # unknown fields
    "unknown envelope field": wire("task.start", trace="x"),
    "reply_to from a worker": wire("task.start", reply_to=MID),
    "error from a worker": wire("task.start", error={"code": "INTERNAL", "message": "x"}),
    "unknown hello field": _set("worker.hello", "body.labels", {}),
    "unknown capability field": _set("worker.hello", "body.capabilities.0.os", "linux"),
    "unknown ref field": _set("task.start", "body.queue", "q"),
    "unknown capacity field": _set("worker.capacity", "body.free", 1),
    "unknown finish ref field": _set("task.finish", "body.ref.extra", 1),
    "unknown finish field": _set("task.finish", "body.traceback", "..."),
    # ids
    "message_id uppercase": wire("task.start", message_id="A" * 32),
    "message_id 31 digits": wire("task.start", message_id="4" * 31),
    "message_id 33 digits": wire("task.start", message_id="4" * 33),
    "message_id with a newline": wire("task.start", message_id="4" * 31 + "\n"),
    "message_id a uuid": wire("task.start", message_id="44444444-4444-4444-4444-444444444444"),
    "message_id a number": wire("task.start", message_id=4),
    "session_id not hex": wire("task.renew", session_id="z" * 32),
    "session_id null": wire("task.renew", session_id=None),
    "task_id uppercase": _set("task.start", "body.task_id", "F" * 32),
    "attempt_id short": _set("task.renew", "body.attempt_id", "2" * 31),
    "instance_id not hex": _set("worker.hello", "body.instance_id", "g" * 32),
    "finish ref task_id long": _set("task.finish", "body.ref.task_id", "1" * 33),
    # decimals
    "epoch a number": _set("task.start", "body.epoch", 1),
    "epoch leading zero": _set("task.start", "body.epoch", "01"),
    "epoch negative": _set("task.start", "body.epoch", "-1"),
    "epoch plus": _set("task.start", "body.epoch", "+1"),
    "epoch empty": _set("task.start", "body.epoch", ""),
    "epoch with a space": _set("task.start", "body.epoch", " 1"),
    "epoch with a trailing newline": _set("task.start", "body.epoch", "1\n"),
    "epoch in another script's digits": _set("task.start", "body.epoch", "\u0661"),
    "epoch of 20 digits": _set("task.start", "body.epoch", "1" * 20),
    "epoch hex": _set("task.start", "body.epoch", "0x1"),
    "sequence a float string": _set("worker.capacity", "body.sequence", "7.0"),
    "sequence an exponent": _set("worker.capacity", "body.sequence", "7e2"),
    "sequence a number": _set("worker.capacity", "body.sequence", 7),
    # wrong types
    "hello capacity a string": _set("worker.hello", "body.capacity", "4"),
    "hello capacity true": _set("worker.hello", "body.capacity", True),
    "hello capacity 1.5": _set("worker.hello", "body.capacity", 1.5),
    "capacity false": _set("worker.capacity", "body.capacity", False),
    "drain a string": _set("worker.capacity", "body.drain", "true"),
    "drain 1": _set("worker.capacity", "body.drain", 1),
    "drain null": _set("worker.capacity", "body.drain", None),
    "body an array": wire("task.start", body=[]),
    "body null": wire("task.start", body=None),
    "capabilities an object": _set("worker.hello", "body.capabilities", {"handler": "h"}),
    "capability a string": _set("worker.hello", "body.capabilities.0", "resize"),
    "capability version a number": _set("worker.hello", "body.capabilities.0.handler_version", 1),
    "queue_id a list": _set("worker.hello", "body.queue_id", ["q"]),
    "instance_secret a number": _set("worker.hello", "body.instance_secret", 1),
    "finish ref a string": _set("task.finish", "body.ref", TASK),
    "protocol_version a number": wire("task.start", protocol_version=1),
    "type a number": wire("task.start", type=7),
    # missing fields
    **{f"{kind} without {field}": _set(kind, f"body.{field}", ...)
       for kind, fields in [("worker.hello", frames._HELLO_FIELDS), ("task.start", refs.REF_FIELDS),
                            ("worker.capacity", frames._CAPACITY_FIELDS),
                            ("task.finish", frames._FINISH_FIELDS)]
       for field in sorted(fields)},
    "capability without payload_version": _set("worker.hello", "body.capabilities.0.payload_version",
                                               ...),
    "finish ref without epoch": _set("task.finish", "body.ref.epoch", ...),
    "start without session_id": _set("task.start", "session_id", ...),
    "capacity without session_id": _set("worker.capacity", "session_id", ...),
    "without message_id": _set("task.start", "message_id", ...),
    "without body": _set("task.start", "body", ...),
    "without protocol_version": _set("task.start", "protocol_version", ...),
    "without type": _set("task.start", "type", ...),
    "FAILED without error_code": _set("task.finish", "body.outcome", "FAILED"),
    "UNKNOWN without error_code": _set("task.finish", "body.outcome", "UNKNOWN"),
    # too large, too small, out of range
    "queue_id 256 characters": _set("worker.hello", "body.queue_id", "q" * 256),
    "permits empty": _set("task.start", "body.permits", []),
    "permits 9": _set("task.start", "body.permits", [{"key": f"k{i}", "limit": 1} for i in range(9)]),
    "permit limit 0": _set("task.start", "body.permits", [{"key": "task:x", "limit": 0}]),
    "permit limit a string": _set("task.start", "body.permits", [{"key": "task:x", "limit": "1"}]),
    "permit key empty": _set("task.start", "body.permits", [{"key": "", "limit": 1}]),
    "permit key 256 characters": _set("task.start", "body.permits", [{"key": "k" * 256, "limit": 1}]),
    "permit key with a newline": _set("task.start", "body.permits", [{"key": "a\nb", "limit": 1}]),
    "permit with another field": _set("task.start", "body.permits",
                                      [{"key": "task:x", "limit": 1, "x": 1}]),
    "permit window_ms 2000": _set("task.start", "body.permits",
                                  [{"key": "rate:task:x", "limit": 1, "window_ms": 2000}]),
    "permit window_ms a string": _set("task.start", "body.permits",
                                      [{"key": "rate:task:x", "limit": 1, "window_ms": "1000"}]),
    "permits on a renewal": _set("task.renew", "body.permits", [{"key": "task:x", "limit": 1}]),
    "queue_id empty": _set("worker.hello", "body.queue_id", ""),
    "lease_secret 129 characters": _set("task.start", "body.lease_secret", "s" * 129),
    "lease_secret empty": _set("task.start", "body.lease_secret", ""),
    "label 129 characters": _set("worker.hello", "body.capabilities.0.handler", "h" * 129),
    "label empty": _set("worker.hello", "body.capabilities.0.handler", ""),
    "capabilities 33": _set("worker.hello", "body.capabilities", [
        {"handler": f"h{i}", "handler_version": "1", "payload_version": "1"} for i in range(33)]),
    "capabilities empty": _set("worker.hello", "body.capabilities", []),
    "capability repeated": _set("worker.hello", "body.capabilities", [
        {"handler": "h", "handler_version": "1", "payload_version": "1"},
        {"payload_version": "1", "handler_version": "1", "handler": "h"}]),
    "hello capacity 0": _set("worker.hello", "body.capacity", 0),
    "hello capacity 257": _set("worker.hello", "body.capacity", 257),
    "capacity -1": _set("worker.capacity", "body.capacity", -1),
    "capacity 257": _set("worker.capacity", "body.capacity", 257),
    "error_code 65 characters": _failed(error_code="E" * 65),
    "error_code empty": _failed(error_code=""),
    # forms
    "instance_secret 42 characters": _set("worker.hello", "body.instance_secret", SECRET[:-1]),
    "instance_secret padded": _set("worker.hello", "body.instance_secret", SECRET + "="),
    "instance_secret standard alphabet": _set("worker.hello", "body.instance_secret", "+" + SECRET[1:]),
    "instance_secret not canonical": _set("worker.hello", "body.instance_secret", SECRET[:-1] + "B"),
    "lease_secret with a slash": _set("task.start", "body.lease_secret", "a/b"),
    "lease_secret with a trailing newline": _set("task.start", "body.lease_secret", "ab\n"),
    "queue_id with a space": _set("worker.hello", "body.queue_id", "my queue"),
    "queue_id with a tab": _set("worker.hello", "body.queue_id", "a\tb"),
    "queue_id with a trailing newline": _set("worker.hello", "body.queue_id", "ab\n"),
    "queue_id with a no-break space": _set("worker.hello", "body.queue_id", "a\u00a0b"),
    "queue_id with an ideographic space": _set("worker.hello", "body.queue_id", "a\u3000b"),
    "queue_id with a NUL": _set("worker.hello", "body.queue_id", "a\u0000b"),
    "label with a bell": _set("worker.hello", "body.capabilities.0.handler", "h\u0007"),
    "label with a trailing newline": _set("worker.hello", "body.capabilities.0.handler", "h\n"),
    "label with a line separator": _set("worker.hello", "body.capabilities.0.handler", "a\u2028b"),
    "label with a zero-width space": _set("worker.hello", "body.capabilities.0.handler", "a\u200bb"),
    "label with a byte order mark": _set("worker.hello", "body.capabilities.0.handler", "\ufeffa"),
    "label with a private-use character": _set("worker.hello", "body.capabilities.0.handler", "\ue000"),
    "error_code with a space": _failed(error_code="bad code"),
    "error_code with a trailing newline": _failed(error_code="E1\n"),
    # envelope and body rules
    "protocol_version 2": wire("task.start", protocol_version="2"),
    "unknown type": wire("task.start", type="task.pause"),
    "a gateway type from a worker": wire("task.start", type="ack"),
    "hello with a session_id": wire("worker.hello", session_id=SID),
    "SUCCEEDED with an error_code": _set("task.finish", "body.error_code", "E1"),
    "error_code null": _failed(error_code=None),
    "outcome unknown": _set("task.finish", "body.outcome", "DONE"),
    "outcome lowercase": _set("task.finish", "body.outcome", "succeeded"),
    "result null": _set("task.finish", "body.result", None),
    "a frame that is an array": [wire("task.start")],  # type: ignore[dict-item]
}


@pytest.mark.parametrize("frame", CLIENT_INVALID.values(), ids=CLIENT_INVALID.keys())
def test_an_invalid_worker_frame_is_refused_by_both(frame: Any) -> None:
    assert not client_valid(frame)
    assert not codec_accepts(frame)


def _server(kind: str, **fields: Any) -> dict[str, Any]:
    frame = {"protocol_version": "1", "type": kind, "message_id": "5" * 32, **fields}
    return {k: v for k, v in frame.items() if v is not ...}


_ERROR = {"code": "LEASE_LOST", "message": "attempt no longer grants execution authority"}
_ACK = _receipts()["start"]

SERVER_INVALID: dict[str, dict[str, Any]] = {
    "a worker type": _server("task.start", session_id=SID, body=REF),
    "unknown type": _server("task.pause", body={}),
    "version 2": _server("ack", protocol_version="2", reply_to=MID, body=_ACK),
    "ack without reply_to": _server("ack", body=_ACK),
    "welcome without reply_to": _server("worker.welcome", body=_receipts()["capacity"]),
    "assign with reply_to": _server("task.assign", reply_to=MID,
                                    body=assign_body(_ATTEMPT, _MESSAGE, 30.0)),
    "ack without body": _server("ack", reply_to=MID),
    "ack body an array": _server("ack", reply_to=MID, body=[]),
    "ack with error": _server("ack", reply_to=MID, body=_ACK, error=_ERROR),
    "error without error": _server("error", reply_to=MID),
    "error with body": _server("error", body={}, error=_ERROR),
    "error code a number": _server("error", error={"code": 1, "message": "x"}),
    "error code lowercase with a space": _server("error", error={"code": "lease lost", "message": "x"}),
    "error with an extra field": _server("error", error={**_ERROR, "sql": "SELECT"}),
    "error without message": _server("error", error={"code": "INTERNAL"}),
    "error message too long": _server("error", error={"code": "INTERNAL",
                                                      "message": "m" * (MAX_ERROR_MESSAGE + 1)}),
    "reply_to not an id": _server("ack", reply_to="x", body=_ACK),
    "session_id not an id": _server("ack", reply_to=MID, session_id="X" * 32, body=_ACK),
    "message_id missing": {k: v for k, v in _server("ack", reply_to=MID, body=_ACK).items()
                           if k != "message_id"},
    "unknown envelope field": _server("ack", reply_to=MID, body=_ACK, trace=1),
}


@pytest.mark.parametrize("frame", SERVER_INVALID.values(), ids=SERVER_INVALID.keys())
def test_an_invalid_gateway_frame_is_refused_by_both(frame: Any) -> None:
    assert not server_valid(frame)
    assert not codec_accepts(frame, decode_server)


BODY_ONLY_SCHEMA = {
    # decode_server checks the envelope and leaves a body to its reader (the client reads
    # the fields it uses): the schema states every body exactly.
    "welcome without session_id": _server("worker.welcome", reply_to=MID, body={
        k: v for k, v in _receipts()["capacity"].items() if k != "session_id"}),
    "ack with an unknown body field": _server("ack", reply_to=MID, body={**_ACK, "extra": 1}),
    "receipt with an unknown disposition": _server("ack", reply_to=MID, body={
        **_ACK, "receipt": {**_ACK["receipt"], "disposition": "MAYBE"}}),
    "lease_until without milliseconds": _server("ack", reply_to=MID, body={
        **_ACK, "lease": {**_ACK["lease"], "lease_until": "2026-09-17T08:00:30Z"}}),
    "assign epoch a number": _server("task.assign", body={
        **assign_body(_ATTEMPT, _MESSAGE, 30.0), "epoch": 12}),
    "assign body not base64": _server("task.assign", body={
        **assign_body(_ATTEMPT, _MESSAGE, 30.0),
        "task": {**assign_body(_ATTEMPT, _MESSAGE, 30.0)["task"], "body": "[[2, 2]]"}}),
    "an error code the protocol has not": _server("error", error={"code": "LEASE_GONE", "message": ""}),
}


@pytest.mark.parametrize("frame", BODY_ONLY_SCHEMA.values(), ids=BODY_ONLY_SCHEMA.keys())
def test_gateway_bodies_are_stated_by_the_schema_not_the_envelope_decoder(frame: Any) -> None:
    assert codec_accepts(frame, decode_server)
    assert not server_valid(frame)


# -- the gaps, each asserted as one ----------------------------------------------------------
GAPS: dict[str, dict[str, Any]] = {
    "an integer written 1.0": _set("worker.hello", "body.capacity", 1.0),
    "an epoch above int64 in 19 digits": _set("task.start", "body.epoch", str(INT64_MAX + 1)),
    "an unassigned code point in a label": _set("worker.hello", "body.capabilities.0.handler", "a\u0378"),
    "a format character outside the BMP": _set("worker.hello", "body.queue_id", "q\U000e0001"),
    "a result over 256 KiB": _set("task.finish", "body.result", "x" * (256 * 1024)),
    "a permit key twice": _set("task.start", "body.permits",
                               [{"key": "task:x", "limit": 1}, {"key": "task:x", "limit": 2}]),
}


@pytest.mark.parametrize("frame", GAPS.values(), ids=GAPS.keys())
def test_what_json_schema_cannot_say_only_the_codec_refuses(frame: Any) -> None:
    assert client_valid(frame)
    assert not codec_accepts(frame)


def _forbidden(definition: str) -> re.Pattern[str]:
    return re.compile(DEFS[definition]["not"]["pattern"])


def test_the_schema_never_refuses_a_character_the_codec_accepts() -> None:
    label, queue = _forbidden("label"), _forbidden("queue_id")
    for point in range(sys.maxunicode + 1):
        if 0xD800 <= point <= 0xDFFF:
            continue  # lone surrogates: refused as JSON, before any schema
        char = chr(point)
        if char.isprintable():
            assert not label.search(char), hex(point)
            if not char.isspace():
                assert not queue.search(char), hex(point)
        if point < 0x100:  # Basic Latin and Latin-1: exactly the codec's rule
            assert bool(label.search(char)) != char.isprintable(), hex(point)
            assert bool(queue.search(char)) != (char.isprintable() and not char.isspace()), hex(point)


# -- generated frames: one verdict ----------------------------------------------------------
def _agrees(char: str) -> bool:
    """A character both judge alike, in a label and in a queue id."""
    label, queue = _forbidden("label"), _forbidden("queue_id")
    return (not label.search(char)) == char.isprintable() and (not queue.search(char)) == (
        char.isprintable() and not char.isspace())


chars = st.characters(exclude_categories=("Cs",)).filter(_agrees) | st.sampled_from(
    " \t\n\r\x00\x07\x85\xa0\u2028\u3000\ufeff\ue000é字😀")
hex_ids = st.text("0123456789abcdef", min_size=32, max_size=32)
decimals = st.integers(0, INT64_MAX).map(str)
instance_secrets = st.binary(min_size=32, max_size=32).map(
    lambda raw: base64.urlsafe_b64encode(raw).rstrip(b"=").decode())
labels = st.text(chars, min_size=1, max_size=MAX_LABEL)
error_codes = st.text(string.ascii_letters + string.digits + "_.:-", min_size=1, max_size=64)
lease_secrets = st.text(string.ascii_letters + string.digits + "._~-", min_size=1, max_size=128)
scalars = st.none() | st.booleans() | st.integers(-(2**63), INT64_MAX) | st.floats(
    allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()) | st.text(chars)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.text(chars, max_size=8), kids, max_size=3), max_leaves=8)
attempt_refs = st.fixed_dictionaries({"task_id": hex_ids, "attempt_id": hex_ids, "epoch": decimals,
                              "lease_secret": lease_secrets})
capabilities = st.lists(st.fixed_dictionaries({"handler": labels, "handler_version": labels,
                                               "payload_version": labels}),
                        min_size=1, max_size=MAX_CAPABILITIES)
BODIES_OF = {
    "worker.hello": st.fixed_dictionaries({
        "instance_id": hex_ids, "instance_secret": instance_secrets,
        "queue_id": st.text(chars, min_size=1, max_size=MAX_QUEUE_ID),
        "capabilities": capabilities, "capacity": st.integers(1, MAX_CAPACITY)}),
    "worker.resume": attempt_refs, "task.renew": attempt_refs,
    "task.start": st.fixed_dictionaries(
        {"task_id": hex_ids, "attempt_id": hex_ids, "epoch": decimals,
         "lease_secret": lease_secrets},
        optional={"permits": st.lists(st.fixed_dictionaries(
            {"key": st.text(chars, min_size=1, max_size=MAX_PERMIT_KEY),
             "limit": st.integers(1, MAX_PERMIT_LIMIT)},
            optional={"window_ms": st.sampled_from(RATE_WINDOWS_MS)}), min_size=1,
            max_size=MAX_PERMITS,
            unique_by=lambda p: p["key"])}),
    "task.query": st.fixed_dictionaries({"task_id": hex_ids}),
    "worker.capacity": st.fixed_dictionaries({"sequence": decimals,
                                              "capacity": st.integers(0, MAX_CAPACITY),
                                              "drain": st.booleans()}),
    "task.finish": st.fixed_dictionaries(
        {"ref": attempt_refs, "outcome": st.sampled_from(sorted(OUTCOMES)),
         "result": json_values.filter(lambda v: v is not None)},
        optional={"error_code": error_codes}),
}
#: What a broken field is set to: other types, near-miss forms, and values from other fields.
near_misses = st.one_of(scalars, hex_ids, decimals, lease_secrets, error_codes, instance_secrets,
                        st.sampled_from(["", "01", "-1", "A" * 32, "1\n", " 1", "SUCCEEDED", "1",
                                         "worker.hello", 0, 257, -1, True, [], {}, None]),
                        attempt_refs, st.lists(json_values, max_size=2), st.dictionaries(
                            st.sampled_from(["x", "handler", "epoch", "task_id"]), json_values,
                            max_size=2))


@st.composite
def worker_frames(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(BODIES_OF)))
    frame: dict[str, Any] = {"protocol_version": "1", "type": kind, "message_id": draw(hex_ids)}
    if kind != "worker.hello" or draw(st.integers(0, 9)) == 0:
        frame["session_id"] = draw(hex_ids)
    frame["body"] = draw(BODIES_OF[kind])
    return frame


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            if prefix[-1:] != ("result",):
                yield from _paths(item, (*prefix, key))
    elif isinstance(value, list) and prefix[-1:] in (("capabilities",), ("permits",)):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


@st.composite
def broken_frames(draw: st.DrawFn) -> dict[str, Any]:
    """A generated frame with one place changed: a value replaced, a key dropped or added."""
    frame = draw(worker_frames())
    path = draw(st.sampled_from(list(_paths(frame))[1:]))
    *parents, last = path
    target: Any = frame
    for key in parents:
        target = target[key]
    action = draw(st.sampled_from(["replace", "drop", "add"]))
    if action == "drop":
        del target[last]
    elif action == "add" and isinstance(target, dict):
        target[draw(st.sampled_from(["extra", "reply_to", "session_id", "error_code", "ref"]))] = (
            draw(near_misses))
    else:
        target[last] = draw(near_misses)
    return frame


@PROPERTY
@given(worker_frames())
def test_generated_worker_frames_get_one_verdict(frame: dict[str, Any]) -> None:
    assert client_valid(frame) == codec_accepts(frame), frame


@PROPERTY
@given(worker_frames().filter(client_valid))
def test_worker_frames_valid_by_the_schema_are_accepted_and_written_back_valid(
        frame: dict[str, Any]) -> None:
    decoded = decode_client(json.dumps(frame))
    assert_client(json.loads(encode(decoded)))


@settings(database=None, deadline=None, max_examples=1000)
@given(broken_frames())
def test_broken_worker_frames_get_one_verdict(frame: dict[str, Any]) -> None:
    assert client_valid(frame) == codec_accepts(frame), frame
