"""Test helpers for the pulse.worker.v1 gateway: a real ``celery pulse gateway`` process,
a worker's side of a connection speaking raw frames, and a test CA (``trustme``).

A pytest plugin (``tests/conftest.py``): its fixtures need an ``env`` fixture of the
test module's (which store, which broker).
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
from celery import Celery
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from celery_pulse.gateway.credentials import CONNECT, CONSUME
from celery_pulse.store.sql import SqlStore, open_store
from tests.helpers.proxy import Proxy
from tests.helpers.workers import Env, Worker, wait_for

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
        self.assigned: list[dict[str, Any]] = []

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
        """Send one operation and read its reply (assignments arriving meanwhile are kept
        for :meth:`assignment`)."""
        message_id = self.send(kind, body, **kwargs)
        while True:
            reply = self.recv()
            if reply.get("reply_to") == message_id:
                return reply
            assert reply["type"] == "task.assign", reply
            self.assigned.append(reply)

    def assignment(self, timeout: float = 15) -> dict[str, Any]:
        """The next ``task.assign`` (TimeoutError if none comes in time)."""
        if self.assigned:
            return self.assigned.pop(0)
        frame = self.recv(timeout)
        assert frame["type"] == "task.assign", frame
        return frame

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


def hello_body(instance_id: str | None = None, secret: str | None = None, queue: str = QUEUE,
           capacity: int = 4, capabilities: list[dict[str, str]] | None = None
           ) -> dict[str, Any]:
    return {"instance_id": instance_id or secrets.token_hex(16),
            "instance_secret": secret or base64.urlsafe_b64encode(
                secrets.token_bytes(32)).rstrip(b"=").decode(),
            "queue_id": queue, "capacity": capacity,
            "capabilities": capabilities or [
                {"handler": "opsapp.*", "handler_version": "1", "payload_version": "1"}]}


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, ssl.SSLContext]:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    folder = tmp_path_factory.mktemp("tls")
    cert.private_key_pem.write_to_path(folder / "key.pem")
    cert.cert_chain_pems[0].write_to_path(folder / "cert.pem")
    for extra in cert.cert_chain_pems[1:]:
        with open(folder / "cert.pem", "ab") as fh:
            fh.write(extra.bytes())
    ca.cert_pem.write_to_path(folder / "ca.pem")
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)  # verifies cert and host
    ca.configure_trust(client)
    return folder / "cert.pem", folder / "key.pem", client


@pytest.fixture
def tokens(env: Env) -> dict[str, str]:
    store = open_store(env.store_url)
    try:
        make = store.credentials.create_credential
        return {"full": make("runner", [CONNECT, CONSUME], [QUEUE, env.queue], "test")[1],
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


def joined(open_peer: Callable[..., Peer], **hello: Any) -> Peer:
    peer = open_peer()
    welcome = peer.call("worker.hello", hello_body(**hello), session_id=None)
    assert welcome["type"] == "worker.welcome", welcome
    peer.session_id = welcome["body"]["session_id"]
    return peer


def broker_env(request: pytest.FixtureRequest, pg_url: str, make_env: Callable[..., Env]
               ) -> Env:
    """A gateway test's environment on the broker its fixture's param names (``rabbitmq``
    or ``redis``): PostgreSQL, ``pulse://`` results, a 4 s lease, Recover every 0.5 s."""
    broker = request.getfixturevalue(f"{request.param}_url")
    made = make_env(pg_url, broker, {"result_backend": "pulse://", "pulse_lease_ttl": 4,
                                     "pulse_recover_interval": 0.5})
    made.app = "tests.apps.opsapp"
    return made


def start_hold(client_app: Celery, env: Env, seconds: float, name: str,
               what: str = "the task to start on the remote worker") -> tuple[Any, Path]:
    """Send ``gatewayapp.hold`` for ``seconds`` and wait until its body has started (it
    writes ``start`` to the marker ``name``): its result and its marker."""
    marker = env.tmp / name
    result = client_app.send_task("gatewayapp.hold", (seconds, str(marker)), queue=env.queue)
    wait_for(lambda: marker.exists() and "start" in marker.read_text(), 30, what)
    return result, marker


@pytest.fixture
def client_app(env: Env) -> Iterator[Celery]:
    """A plain Celery client on the test's broker, reading results from the store."""
    app = Celery("publisher", broker=env.broker_url, backend="pulse+" + env.store_url,
                 set_as_current=False)
    yield app
    app.close()


@pytest.fixture
def gateway_store(env: Env) -> Iterator[SqlStore]:
    opened = open_store(env.store_url)
    yield opened
    opened.close()


@pytest.fixture
def proxy(gateway: GatewayProcess) -> Iterator[Proxy]:
    """A cuttable TCP proxy in front of the test's gateway."""
    made = Proxy(int(gateway.url.rsplit(":", 1)[1].split("/", 1)[0]))
    yield made
    made.close()


@pytest.fixture
def remote(env: Env, gateway: GatewayProcess, tokens: dict[str, str], proxy: Proxy,
           tls: tuple[Path, Path, ssl.SSLContext], workers: Callable[..., Worker]
           ) -> Callable[..., Worker]:
    """Start a remote worker: its environment names no store and no broker (the queue's
    name only; ``through_proxy``: its gateway connection can be cut; ``url``: another
    gateway's; ``extra``: more ``celery worker`` arguments; ``conf``: more of the worker's
    Celery configuration)."""
    credentials = env.tmp / "runner.json"
    credentials.write_text(json.dumps({"token": tokens["full"]}))

    def start(name: str, concurrency: int = 2, queue: str | None = None,
              through_proxy: bool = False, url: str | None = None,
              extra: tuple[str, ...] = (), conf: dict[str, Any] | None = None) -> Worker:
        remote_env = Env("sqlite:////nonexistent/never-opened.db", "memory://",
                         queue or env.queue, env.tmp, app="tests.apps.gatewayapp")
        if url is None:
            url = (f"wss://localhost:{proxy.port}/v1/worker/connect" if through_proxy
                   else gateway.url)
        return workers(remote_env, name, concurrency=concurrency, extra=extra, extra_env={
            "PULSE_TEST_GATEWAY_URL": url,
            "PULSE_TEST_GATEWAY_CREDENTIALS": str(credentials),
            "PULSE_TEST_GATEWAY_CA": str(tls[0].parent / "ca.pem"),
            "PULSE_TEST_STORE": "", "PULSE_TEST_BROKER": "",
            "PULSE_TEST_REMOTE_CONF": json.dumps(conf or {})})
    return start


def claim_of(store: SqlStore, task_id: str) -> Any:
    """The claim of ``task_id`` as the store has it now."""
    [claim] = [c for c in store.list_claims() if c.task_id == task_id]
    return claim


def evidence_of(store: SqlStore, task_id: str) -> list[Any]:
    """``(holder, outcome)`` of every late outcome kept for ``task_id``."""
    import sqlalchemy as sa

    with store.engine.connect() as conn:
        return list(conn.execute(sa.text(
            "SELECT holder, outcome FROM pulse_evidence WHERE task_id = :t"), {"t": task_id}))
