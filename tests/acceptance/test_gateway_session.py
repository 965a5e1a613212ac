"""``celery pulse gateway`` as a worker meets it (issue 18): the handshake, the session,
and every malformed frame answered with its code while other connections carry on.

A real ``celery -A app pulse gateway`` process on real TLS (a test CA from ``trustme``;
the client checks the certificate and host name), on a SQLite and a PostgreSQL store;
credentials made in the store the way ``celery pulse credentials create`` makes them.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from celery_pulse.store.credentials import CONNECT, CONSUME
from celery_pulse.store.sql import open_store
from tests.helpers.gateway import QUEUE, SUBPROTOCOL, GatewayProcess, Peer, hello_body, joined
from tests.helpers.workers import Env, wait_for


@pytest.fixture(params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, make_env: Callable[..., Env]) -> Env:
    url: str = request.getfixturevalue({"sqlite": "sqlite_url", "postgres": "pg_url"}[
        request.param])
    made = make_env(url, "memory://")
    made.app = "tests.apps.opsapp"
    return made


def _status(call: Callable[[], Any]) -> int:
    with pytest.raises(InvalidStatus) as info:
        call()
    status: int = info.value.response.status_code
    return status


# -- the handshake -----------------------------------------------------------------------
def test_the_handshake_takes_a_bearer_credential_only(
        gateway: GatewayProcess, tls: tuple[Path, Path, ssl.SSLContext],
        tokens: dict[str, str], open_peer: Callable[..., Peer]) -> None:
    good = {"Authorization": f"Bearer {tokens['full']}"}

    def attempt(url: str = gateway.url, headers: dict[str, str] | None = None,
                subprotocols: list[str] | None = None) -> Callable[[], Any]:
        return lambda: connect(url, ssl=tls[2], additional_headers=headers,
                               subprotocols=subprotocols or [SUBPROTOCOL], compression=None,
                               legacy=True)

    assert _status(attempt()) == 401  # no credential
    assert _status(attempt(headers={"Authorization": "Basic dXNlcjpwdw=="})) == 401
    assert _status(attempt(headers={"Authorization": "Bearer pgw1_" + "0" * 32 + "_x"})) == 401
    forged = tokens["full"][:-4] + ("AAAA" if not tokens["full"].endswith("AAAA") else "BBBB")
    assert _status(attempt(headers={"Authorization": f"Bearer {forged}"})) == 401
    # A credential in the query is refused even when it is valid, and with one in the header.
    assert _status(attempt(url=f"{gateway.url}?access_token={tokens['full']}")) == 400
    assert _status(attempt(url=f"{gateway.url}?token={tokens['full']}", headers=good)) == 400
    assert _status(attempt(url=gateway.url.replace("/v1/worker/connect", "/v1/other"),
                           headers=good)) == 404
    assert _status(attempt(headers=good, subprotocols=["chat"])) == 400
    assert tokens["full"] not in gateway.log()

    peer = open_peer()
    assert peer.conn.subprotocol == SUBPROTOCOL
    assert peer.conn.response.headers.get("Sec-WebSocket-Extensions") is None  # no compression


def test_a_browsers_origin_is_refused_unless_allowed(
        start_gateway: Callable[..., GatewayProcess], tls: tuple[Path, Path, ssl.SSLContext],
        tokens: dict[str, str]) -> None:
    gateway = start_gateway("--allowed-origin", "https://ops.example.com")
    good = {"Authorization": f"Bearer {tokens['full']}"}

    def attempt(origin: str | None) -> Callable[[], Any]:
        return lambda: connect(gateway.url, ssl=tls[2], origin=origin,  # type: ignore[arg-type]
                               additional_headers=good, subprotocols=[SUBPROTOCOL],
                               compression=None, legacy=True)

    assert _status(attempt("https://evil.example.com")) == 403  # a valid credential, too
    assert _status(attempt("null")) == 403  # a sandboxed page's
    assert _status(attempt("https://ops.example.com:8443")) == 403  # origins match exactly
    allowed = attempt("https://ops.example.com")()
    assert allowed.subprotocol == SUBPROTOCOL
    allowed.close()
    worker = attempt(None)()  # a worker sends no Origin
    assert worker.subprotocol == SUBPROTOCOL
    worker.close()


def test_the_gateway_issues_no_tls_session_tickets(
        gateway: GatewayProcess, tls: tuple[Path, Path, ssl.SSLContext]) -> None:
    """TLS 1.3 tickets arrive while a threaded client writes its upgrade request; OpenSSL
    can lose that request (the handshake then times out), so the gateway sends none."""
    port = int(gateway.url.rsplit(":", 1)[1].split("/", 1)[0])
    with socket.create_connection(("127.0.0.1", port), timeout=15) as raw, \
            tls[2].wrap_socket(raw, server_hostname="localhost") as conn:
        assert conn.version() == "TLSv1.3"  # where tickets come after the handshake
        conn.sendall(b"GET /v1/worker/connect HTTP/1.1\r\nHost: localhost\r\n"
                     b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     b"Sec-WebSocket-Version: 13\r\n\r\n")
        response = b""
        while chunk := conn.recv(65536):  # every record the server sent, to its close
            response += chunk
        assert response.startswith(b"HTTP/1.1 401"), response
        assert conn.session is not None and not conn.session.has_ticket


def test_consuming_needs_the_scope_and_the_queue(open_peer: Callable[..., Peer]) -> None:
    looker = open_peer("connect-only")  # may connect, may not consume
    assert looker.error("worker.hello", hello_body(), session_id=None) == "FORBIDDEN"
    assert looker.closed_with() == 1008
    elsewhere = open_peer("other-queue")
    assert elsewhere.error("worker.hello", hello_body(queue=QUEUE), session_id=None) == "FORBIDDEN"
    assert elsewhere.closed_with() == 1008
    peer = open_peer("other-queue")
    assert peer.call("worker.hello", hello_body(queue="images"), session_id=None)["type"] == (
        "worker.welcome")


# -- the session -------------------------------------------------------------------------
def test_welcome_then_capacity_rules(open_peer: Callable[..., Peer]) -> None:
    peer = open_peer()
    hello_id = peer.send("worker.hello", hello_body(capacity=4), session_id=None)
    welcome = peer.recv()
    assert welcome["type"] == "worker.welcome" and welcome["reply_to"] == hello_id
    body = welcome["body"]
    assert set(body) == {"session_id", "epoch", "server_time", "expires_at",
                         "lease_duration_ms", "draining"}
    assert re.fullmatch(r"[0-9a-f]{32}", body["session_id"]) and body["epoch"] == "1"
    assert body["server_time"] < body["expires_at"] and body["draining"] is False
    assert 0 < body["lease_duration_ms"] <= 30_000
    peer.session_id = body["session_id"]

    def capacity(sequence: int, value: int, drain: bool = False, **kw: Any) -> dict[str, Any]:
        return peer.call("worker.capacity", {"sequence": str(sequence), "capacity": value,
                                             "drain": drain}, **kw)

    first = capacity(1, 4)
    assert first["type"] == "ack" and first["body"]["session_id"] == peer.session_id
    assert capacity(1, 4)["type"] == "ack"  # the same declaration again
    assert capacity(1, 3)["error"]["code"] == "STATE_CONFLICT"
    assert capacity(2, 0)["type"] == "ack"  # 0 stops dispatch; a newer sequence overwrites
    assert capacity(1, 4)["error"]["code"] == "STATE_CONFLICT"  # older
    assert capacity(3, 2, drain=True)["body"]["draining"] is True
    assert capacity(4, 2, drain=False)["error"]["code"] == "STATE_CONFLICT"  # drain sticks

    # One message_id, one operation: the same content again is the original reply.
    again = capacity(5, 1, message_id="a" * 32, drain=True)
    repeat = capacity(5, 1, message_id="a" * 32, drain=True)
    assert repeat["type"] == "ack" and repeat["body"]["deduplicated"] is True
    assert {k: v for k, v in repeat["body"].items() if k != "deduplicated"} == again["body"]
    assert capacity(6, 1, message_id="a" * 32, drain=True)["error"]["code"] == (
        "IDEMPOTENCY_CONFLICT")
    # Attempts are named only by what the gateway assigned.
    ref = {"task_id": "1" * 32, "attempt_id": "2" * 32, "epoch": "1", "lease_secret": "x"}
    assert peer.error("task.start", ref) == "NOT_FOUND"
    # session_id must be this connection's.
    assert peer.error("worker.capacity", {"sequence": "9", "capacity": 1, "drain": True},
                      session_id="f" * 32) == "SESSION_MISMATCH"


def test_a_reconnect_replaces_the_old_session(open_peer: Callable[..., Peer]) -> None:
    hello = hello_body()
    old = joined(open_peer, instance_id=hello["instance_id"], secret=hello["instance_secret"])
    assert old.call("worker.capacity", {"sequence": "1", "capacity": 2, "drain": True}
                    )["type"] == "ack"
    new = open_peer()
    # The capability set is the same in another order: the same identity.
    welcome = new.call("worker.hello", {**hello, "capabilities": list(
        reversed(hello["capabilities"]))}, session_id=None)
    assert welcome["body"]["epoch"] == "2" and welcome["body"]["draining"] is True
    assert welcome["body"]["session_id"] != old.session_id
    replaced = old.recv()
    assert replaced["type"] == "error" and replaced["error"]["code"] == "SESSION_MISMATCH"
    assert old.closed_with() == 1008
    # Knowing the instance id is not enough: another secret is refused.
    thief = open_peer()
    assert thief.error("worker.hello", {**hello, "instance_secret": hello_body()[
        "instance_secret"]}, session_id=None) == "UNAUTHENTICATED"
    # Nor another credential, even with the secret: the instance is its owner's.
    other = open_peer("other-queue")
    assert other.error("worker.hello", {**hello, "queue_id": "images"}, session_id=None
                       ) == "UNAUTHENTICATED"
    # Nor may a reconnect change its capabilities.
    changed = open_peer()
    assert changed.error("worker.hello", {**hello, "capabilities": [
        {"handler": "opsapp.other", "handler_version": "1", "payload_version": "1"}]},
        session_id=None) == "STATE_CONFLICT"


def test_a_revoked_credential_ends_its_session(env: Env, open_peer: Callable[..., Peer]
                                               ) -> None:
    peer = joined(open_peer)
    assert env.celery("pulse", "credentials", "revoke", "runner").returncode == 0
    # Ended by the gateway's next check of its sessions' credentials (once a second),
    # idle as it is: told why, unasked, then closed.
    ended = peer.recv(timeout=5)
    assert ended["type"] == "error" and ended["error"]["code"] == "UNAUTHENTICATED", ended
    assert peer.closed_with() == 1008
    with pytest.raises(InvalidStatus):
        open_peer()


def test_an_expired_credential_ends_its_sessions_and_is_refused(
        env: Env, open_peer: Callable[..., Peer]) -> None:
    store = open_store(env.store_url)
    try:
        _, token = store.credentials.create_credential(
            "short-lived", [CONNECT, CONSUME], [QUEUE], "test", expires_in=3)
    finally:
        store.close()
    peer = open_peer(token)
    welcome = peer.call("worker.hello", hello_body(), session_id=None)
    assert welcome["type"] == "worker.welcome", welcome
    # Ended by the gateway's check of its sessions' credentials once the store's clock
    # passes the expiry: told why, unasked, then closed.
    ended = peer.recv(timeout=10)
    assert ended["type"] == "error" and ended["error"]["code"] == "UNAUTHENTICATED", ended
    assert peer.closed_with() == 1008
    with pytest.raises(InvalidStatus) as info:
        open_peer(token)
    assert info.value.response.status_code == 401


def test_a_rotation_keeps_sessions_and_both_secrets_for_its_grace(
        env: Env, tokens: dict[str, str], open_peer: Callable[..., Peer]) -> None:
    peer = joined(open_peer)
    rotated = env.celery("pulse", "credentials", "rotate", "runner", "--grace", "60")
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.strip()
    assert new.startswith("pgw1_") and new != tokens["full"]
    # The session goes on: a rotation changes the secret, not the credential.
    assert peer.call("worker.capacity", {"sequence": "1", "capacity": 1, "drain": False}
                     )["type"] == "ack"
    for token in (tokens["full"], new):  # both secrets, during the grace
        joined(lambda t=token: open_peer(t))
    again = env.celery("pulse", "credentials", "rotate", "runner", "--grace", "0")
    assert again.returncode == 0, again.stderr
    for token in (tokens["full"], new):  # only the latest secret now
        with pytest.raises(InvalidStatus) as info:
            open_peer(token)
        assert info.value.response.status_code == 401
    joined(lambda: open_peer(again.stdout.strip()))
    listed = env.celery_json("pulse", "credentials", "list")
    [runner] = [c for c in listed if c["name"] == "runner"]
    assert runner["rotated_at"] is not None and runner["active"]


def test_hello_must_come_first_and_in_time(open_peer: Callable[..., Peer]) -> None:
    peer = open_peer()
    assert peer.error("worker.capacity", {"sequence": "1", "capacity": 1, "drain": False},
                      session_id="1" * 32) == "HELLO_REQUIRED"
    # Nothing more: the gateway gives up 5 s after the connection opened.
    reply = peer.recv(timeout=10)
    assert reply["type"] == "error" and reply["error"]["code"] == "HELLO_TIMEOUT"
    assert peer.closed_with() == 1008


def test_the_connection_limit(start_gateway: Callable[..., GatewayProcess],
                              tls: tuple[Path, Path, ssl.SSLContext],
                              tokens: dict[str, str]) -> None:
    gateway = start_gateway("--max-connections", "2", "--max-per-credential", "2")
    headers = {"Authorization": f"Bearer {tokens['full']}"}

    def one() -> ClientConnection:
        return connect(gateway.url, ssl=tls[2], additional_headers=headers,
                       subprotocols=[SUBPROTOCOL], compression=None, legacy=True)

    def bad_subprotocol() -> ClientConnection:
        return connect(gateway.url, ssl=tls[2], additional_headers=headers,
                       subprotocols=["chat"], compression=None, legacy=True)

    # Handshakes that fail after the credential check take no place for good.
    for _ in range(3):
        assert _status(bad_subprotocol) == 400
    first, second = one(), one()
    try:
        assert _status(one) == 503
        first.close()
        wait_for(lambda: _try(one), 10, "a place to free up")
    finally:
        second.close()


def _try(open_: Callable[[], ClientConnection]) -> bool:
    try:
        open_().close()
    except InvalidStatus:
        return False
    return True


# -- malformed frames --------------------------------------------------------------------
def _frame(**fields: Any) -> str:
    frame = {"protocol_version": "1", "type": "worker.capacity",
             "message_id": secrets.token_hex(16), "session_id": "0" * 32,
             "body": {"sequence": "1", "capacity": 1, "drain": False}}
    frame.update(fields)
    return json.dumps(frame)


MALFORMED = [
    ("not json", "{", "INVALID_FRAME"),
    ("not an object", "[1, 2]", "INVALID_FRAME"),
    ("duplicate keys", '{"protocol_version": "1", "protocol_version": "1", "type": "ack"}',
     "INVALID_FRAME"),
    ("unknown envelope field", _frame(extra=1), "INVALID_FRAME"),
    ("unknown body field", _frame(body={"sequence": "1", "capacity": 1, "drain": False,
                                        "x": 1}), "INVALID_FRAME"),
    ("wrong type", _frame(body={"sequence": 1, "capacity": 1, "drain": False}),
     "INVALID_FRAME"),
    ("bool for int", _frame(body={"sequence": "1", "capacity": True, "drain": False}),
     "INVALID_FRAME"),
    ("non-finite", _frame().replace('"capacity": 1', '"capacity": NaN'), "INVALID_FRAME"),
    ("lone surrogate", _frame(type="SURROGATE").replace("SURROGATE", "\\ud800"),
     "INVALID_FRAME"),
    ("bad message id", _frame(message_id="ABC"), "INVALID_ID"),
    ("upper-case id", _frame(session_id="A" * 32), "INVALID_ID"),
    ("unknown type", _frame(type="task.steal"), "UNKNOWN_TYPE"),
    ("other version", _frame(protocol_version="2"), "UNSUPPORTED_VERSION"),
    ("capacity out of range", _frame(body={"sequence": "1", "capacity": 257, "drain": False}),
     "INVALID_FRAME"),
]


def test_malformed_frames_are_answered_with_their_code(open_peer: Callable[..., Peer]) -> None:
    peer = joined(open_peer)
    bystander = joined(open_peer)
    for sequence, (why, text, code) in enumerate(MALFORMED, start=1):
        peer.send_raw(text.replace('"0' * 1 + "0" * 31 + '"', f'"{peer.session_id}"'))
        reply = peer.recv()
        assert reply["type"] == "error", (why, reply)
        assert reply["error"]["code"] == code, (why, reply)
        assert set(reply["error"]) == {"code", "message"}
        # The connection that sent it, and the others, carry on.
        for who in (peer, bystander):
            ok = who.call("worker.capacity", {"sequence": str(sequence), "capacity": 1,
                                              "drain": False})
            assert ok["type"] == "ack", (why, ok)


def test_a_hello_with_bad_fields_is_refused_and_may_be_sent_again(
        open_peer: Callable[..., Peer]) -> None:
    peer = open_peer()
    assert peer.error("worker.hello", {**hello_body(), "capacity": 0}, session_id=None) == (
        "INVALID_FRAME")
    assert peer.error("worker.hello", {**hello_body(), "instance_secret": "short"},
                      session_id=None) == "INVALID_FRAME"
    assert peer.error("worker.hello", hello_body(), session_id="1" * 32) == "INVALID_FRAME"
    assert peer.call("worker.hello", hello_body(), session_id=None)["type"] == "worker.welcome"


@pytest.mark.parametrize(("why", "payload", "close_code", "code"), [
    ("binary frame", b'{"protocol_version": "1"}', 1003, "INVALID_FRAME"),
    ("over 512 KiB", json.dumps({"pad": "x" * (512 * 1024)}), 1009, "FRAME_TOO_LARGE"),
])
def test_frames_that_break_the_transport_rules_close_only_their_connection(
        open_peer: Callable[..., Peer], why: str, payload: str | bytes, close_code: int,
        code: str) -> None:
    peer, bystander = joined(open_peer), joined(open_peer)
    peer.send_raw(payload)
    reply = peer.recv()
    assert reply["type"] == "error" and reply["error"]["code"] == code, (why, reply)
    assert peer.closed_with() == close_code
    assert bystander.call("worker.capacity", {"sequence": "1", "capacity": 1, "drain": False}
                          )["type"] == "ack"
