"""``celery pulse gateway`` as a worker meets it (issue 18): the handshake, the session,
and every malformed frame answered with its code while other connections carry on.

A real ``celery -A app pulse gateway`` process on real TLS (a test CA from ``trustme``;
the client checks the certificate and host name), on a SQLite and a PostgreSQL store;
credentials made in the store the way ``celery pulse credentials create`` makes them.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from celery_pulse.gateway.credentials import CONNECT, CONSUME
from celery_pulse.store.sql import open_store
from tests.helpers.workers import Env, wait_for

QUEUE = "objects"
SUBPROTOCOL = "pulse.worker.v1"


class GatewayProcess:
    """One ``celery pulse gateway`` process, killed by its fixture."""

    def __init__(self, env: Env, cert: Path, key: Path, *extra: str) -> None:
        self.log_path = env.tmp / f"gateway-{secrets.token_hex(4)}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", env.app, "pulse", "gateway",
             "--bind", "127.0.0.1:0", "--certfile", str(cert), "--keyfile", str(key), *extra],
            env=env.vars(), cwd=env.tmp, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)
        match = wait_for(self._serving, 30, "the gateway to listen")
        self.url = f"wss://localhost:{match.group(1)}/v1/worker/connect"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _serving(self) -> re.Match[str] | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"gateway exited ({self.proc.returncode}):\n{self.log()}")
        return re.search(r"serving pulse\.worker\.v1 on wss://127\.0\.0\.1:(\d+)/", self.log())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()


class Peer:
    """A worker's side of one connection, speaking raw frames."""

    def __init__(self, conn: ClientConnection) -> None:
        self.conn = conn
        self.session_id: str | None = None

    def send_raw(self, text: str | bytes) -> None:
        self.conn.send(text)

    def send(self, kind: str, body: Any, *, message_id: str | None = None,
             session_id: str | None = "current") -> str:
        message_id = message_id or secrets.token_hex(16)
        frame: dict[str, Any] = {"protocol_version": "1", "type": kind,
                                 "message_id": message_id, "body": body}
        if session_id == "current":
            session_id = self.session_id
        if session_id is not None:
            frame["session_id"] = session_id
        self.conn.send(json.dumps(frame))
        return message_id

    def recv(self, timeout: float = 10) -> dict[str, Any]:
        frame: dict[str, Any] = json.loads(self.conn.recv(timeout))
        return frame

    def call(self, kind: str, body: Any, **kwargs: Any) -> dict[str, Any]:
        message_id = self.send(kind, body, **kwargs)
        reply = self.recv()
        assert reply.get("reply_to") == message_id, reply
        return reply

    def error(self, kind: str, body: Any, **kwargs: Any) -> str:
        reply = self.call(kind, body, **kwargs)
        assert reply["type"] == "error", reply
        code: str = reply["error"]["code"]
        return code

    def closed_with(self, timeout: float = 10) -> int | None:
        """Read until the server closes; its close code."""
        try:
            while True:
                self.conn.recv(timeout)
        except ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd is not None else None


def _hello(instance_id: str | None = None, secret: str | None = None, queue: str = QUEUE,
           capacity: int = 4, capabilities: list[dict[str, str]] | None = None
           ) -> dict[str, Any]:
    return {"instance_id": instance_id or secrets.token_hex(16),
            "instance_secret": secret or base64.urlsafe_b64encode(
                secrets.token_bytes(32)).rstrip(b"=").decode(),
            "queue_id": queue, "capacity": capacity,
            "capabilities": capabilities or [
                {"handler": "opsapp.hold", "handler_version": "1", "payload_version": "1"}]}


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ssl.SSLContext]:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    folder = tmp_path_factory.mktemp("tls")
    cert.private_key_pem.write_to_path(folder / "key.pem")
    cert.cert_chain_pems[0].write_to_path(folder / "cert.pem")
    for extra in cert.cert_chain_pems[1:]:
        with open(folder / "cert.pem", "ab") as fh:
            fh.write(extra.bytes())
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)  # verifies cert and host
    ca.configure_trust(client)
    return folder / "cert.pem", folder / "key.pem", client


@pytest.fixture(params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, make_env: Callable[..., Env]) -> Env:
    url: str = request.getfixturevalue({"sqlite": "sqlite_url", "postgres": "pg_url"}[
        request.param])
    made = make_env(url, "memory://")
    made.app = "tests.apps.opsapp"
    return made


@pytest.fixture
def tokens(env: Env) -> dict[str, str]:
    store = open_store(env.store_url)
    try:
        make = store.credentials.create_credential
        return {"full": make("runner", [CONNECT, CONSUME], [QUEUE], "test")[1],
                "connect-only": make("looker", [CONNECT], [], "test")[1],
                "other-queue": make("elsewhere", [CONNECT, CONSUME], ["images"], "test")[1]}
    finally:
        store.close()


@pytest.fixture
def start_gateway(env: Env, tls: tuple[Path, Path, ssl.SSLContext]
                  ) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(*extra: str) -> GatewayProcess:
        started.append(GatewayProcess(env, tls[0], tls[1], *extra))
        return started[-1]

    yield start
    for gateway in started:
        gateway.kill()


@pytest.fixture
def gateway(start_gateway: Callable[..., GatewayProcess]) -> GatewayProcess:
    return start_gateway()


@pytest.fixture
def open_peer(gateway: GatewayProcess, tls: tuple[Path, Path, ssl.SSLContext],
              tokens: dict[str, str]) -> Iterator[Callable[..., Peer]]:
    opened: list[ClientConnection] = []

    def open_(token: str = "full", url: str | None = None,
              subprotocols: list[str] | None = None) -> Peer:
        conn = connect(url or gateway.url, ssl=tls[2],
                       subprotocols=[SUBPROTOCOL] if subprotocols is None else subprotocols,
                       additional_headers={"Authorization": f"Bearer {tokens.get(token, token)}"},
                       compression=None, open_timeout=15, legacy=True)
        opened.append(conn)
        return Peer(conn)

    yield open_
    for conn in opened:
        conn.close()


def _joined(open_peer: Callable[..., Peer], **hello: Any) -> Peer:
    peer = open_peer()
    welcome = peer.call("worker.hello", _hello(**hello), session_id=None)
    assert welcome["type"] == "worker.welcome", welcome
    peer.session_id = welcome["body"]["session_id"]
    return peer


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


def test_consuming_needs_the_scope_and_the_queue(open_peer: Callable[..., Peer]) -> None:
    looker = open_peer("connect-only")  # may connect, may not consume
    assert looker.error("worker.hello", _hello(), session_id=None) == "FORBIDDEN"
    assert looker.closed_with() == 1008
    elsewhere = open_peer("other-queue")
    assert elsewhere.error("worker.hello", _hello(queue=QUEUE), session_id=None) == "FORBIDDEN"
    assert elsewhere.closed_with() == 1008
    peer = open_peer("other-queue")
    assert peer.call("worker.hello", _hello(queue="images"), session_id=None)["type"] == (
        "worker.welcome")


# -- the session -------------------------------------------------------------------------
def test_welcome_then_capacity_rules(open_peer: Callable[..., Peer]) -> None:
    peer = open_peer()
    hello_id = peer.send("worker.hello", _hello(capacity=4), session_id=None)
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
    hello = _hello()
    old = _joined(open_peer, instance_id=hello["instance_id"], secret=hello["instance_secret"])
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
    assert thief.error("worker.hello", {**hello, "instance_secret": _hello()[
        "instance_secret"]}, session_id=None) == "UNAUTHENTICATED"
    # Nor may a reconnect change its queue or capabilities.
    other = open_peer("other-queue")
    assert other.error("worker.hello", {**hello, "queue_id": "images"}, session_id=None) in (
        "STATE_CONFLICT",)


def test_a_revoked_credential_ends_its_session(env: Env, open_peer: Callable[..., Peer]
                                               ) -> None:
    peer = _joined(open_peer)
    assert env.celery("pulse", "credentials", "revoke", "runner").returncode == 0
    assert peer.error("worker.capacity", {"sequence": "1", "capacity": 1, "drain": False}
                      ) == "UNAUTHENTICATED"
    assert peer.closed_with() == 1008
    with pytest.raises(InvalidStatus):
        open_peer()


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
    gateway = start_gateway("--max-connections", "2")
    headers = {"Authorization": f"Bearer {tokens['full']}"}

    def one() -> ClientConnection:
        return connect(gateway.url, ssl=tls[2], additional_headers=headers,
                       subprotocols=[SUBPROTOCOL], compression=None, legacy=True)

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
    peer = _joined(open_peer)
    bystander = _joined(open_peer)
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
    assert peer.error("worker.hello", {**_hello(), "capacity": 0}, session_id=None) == (
        "INVALID_FRAME")
    assert peer.error("worker.hello", {**_hello(), "instance_secret": "short"},
                      session_id=None) == "INVALID_FRAME"
    assert peer.error("worker.hello", _hello(), session_id="1" * 32) == "INVALID_FRAME"
    assert peer.call("worker.hello", _hello(), session_id=None)["type"] == "worker.welcome"


@pytest.mark.parametrize(("why", "payload", "close_code", "code"), [
    ("binary frame", b'{"protocol_version": "1"}', 1003, "INVALID_FRAME"),
    ("over 512 KiB", json.dumps({"pad": "x" * (512 * 1024)}), 1009, "FRAME_TOO_LARGE"),
])
def test_frames_that_break_the_transport_rules_close_only_their_connection(
        open_peer: Callable[..., Peer], why: str, payload: str | bytes, close_code: int,
        code: str) -> None:
    peer, bystander = _joined(open_peer), _joined(open_peer)
    peer.send_raw(payload)
    reply = peer.recv()
    assert reply["type"] == "error" and reply["error"]["code"] == code, (why, reply)
    assert peer.closed_with() == close_code
    assert bystander.call("worker.capacity", {"sequence": "1", "capacity": 1, "drain": False}
                          )["type"] == "ack"
