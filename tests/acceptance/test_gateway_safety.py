"""The gateway's admission and ownership (issue 37): the connection limit counted from
accept, unauthenticated handshakes and one credential bounded; an instance id is its
first hello's credential and secret's, in the store, on every gateway; an idle worker
is never cut, a silent one is; no secret in any log at debug; a finish without a start
is evidence only.

Real ``celery pulse gateway`` processes (TLS, RabbitMQ, PostgreSQL), real remote
``celery worker -P pulse`` processes, and raw-frame peers where the rule is about what
a peer sends.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult
from websockets.asyncio.client import connect as async_connect
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from celery_pulse.store.credentials import parse_token
from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import (
    SUBPROTOCOL,
    GatewayProcess,
    Peer,
    claim_of,
    evidence_of,
    hello_body,
)
from tests.helpers.proxy import Proxy
from tests.helpers.workers import Env, Worker, wait_for

TTL = 4.0
READ_IDLE = 1.0


@pytest.fixture
def env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    made = make_env(pg_url, rabbitmq_url, {
        "result_backend": "pulse://", "pulse_lease_ttl": TTL, "pulse_recover_interval": 0.5,
        "task_default_queue": "unused"})
    made.app = "tests.apps.opsapp"
    return made


@pytest.fixture
def gateway(start_gateway: Callable[..., GatewayProcess]) -> GatewayProcess:
    """This module's gateway: a read idle short enough to be passed many times over."""
    return start_gateway("--read-idle", str(READ_IDLE), "-l", "debug")


def _joined(peer: Peer, hello: dict[str, Any]) -> Peer:
    welcome = peer.call("worker.hello", hello, session_id=None)
    assert welcome["type"] == "worker.welcome", welcome
    peer.session_id = welcome["body"]["session_id"]
    return peer


def _declare(peer: Peer, sequence: int = 1, capacity: int = 1) -> dict[str, Any]:
    return peer.call("worker.capacity", {"sequence": str(sequence), "capacity": capacity,
                                         "drain": False})


def _refusal(call: Callable[[], Any]) -> tuple[int, str]:
    with pytest.raises(InvalidStatus) as info:
        call()
    response = info.value.response
    return response.status_code, response.body.decode(errors="replace")


# -- admission ---------------------------------------------------------------------------
def test_simultaneous_handshakes_never_pass_the_connection_limit(
        start_gateway: Callable[..., GatewayProcess], tls: tuple[Path, Path, ssl.SSLContext],
        tokens: dict[str, str], env: Env) -> None:
    # Only the total is in play here: the other caps are wider than the attempts.
    gateway = start_gateway("--max-connections", "20", "--max-unauthenticated", "300",
                            "--max-per-credential", "300")
    headers = {"Authorization": f"Bearer {tokens['full']}"}

    async def drill() -> tuple[int, list[tuple[int, str]], list[str]]:
        held: list[Any] = []
        refused: list[tuple[int, str]] = []
        other: list[str] = []
        everyone = asyncio.Event()

        async def one() -> None:
            try:
                conn = await async_connect(
                    gateway.url, ssl=tls[2], additional_headers=headers,
                    subprotocols=[SUBPROTOCOL], compression=None, open_timeout=60)
            except InvalidStatus as exc:
                refused.append((exc.response.status_code, exc.response.body.decode()))
                return
            except Exception as exc:
                other.append(repr(exc))
                return
            # A session each (no hello timeout ends it): every place stays taken until
            # every handshake has its answer.
            try:
                await conn.send(json.dumps({"protocol_version": "1", "type": "worker.hello",
                                            "message_id": "a" * 32,
                                            "body": hello_body(queue=env.queue)}))
                reply = json.loads(await conn.recv())
            except Exception as exc:
                other.append(repr(exc))
                return
            if reply["type"] != "worker.welcome":
                other.append(repr(reply))
                await conn.close()
                return
            held.append(conn)
            await everyone.wait()

        tasks = [asyncio.ensure_future(one()) for _ in range(300)]
        while sum(t.done() for t in tasks) + len(held) < len(tasks):
            await asyncio.sleep(0.05)
        everyone.set()
        await asyncio.gather(*tasks)
        count = len(held)
        for conn in held:
            await conn.close()
        return count, refused, other

    held, refused, other = asyncio.run(drill())
    assert 1 <= held <= 20, (held, other[:3])
    assert held + len(refused) + len(other) == 300
    assert len(refused) >= 280 - len(other)
    assert {status for status, _ in refused} == {503}
    assert all(body.startswith("OVERLOADED") for _, body in refused), refused[:3]


def test_unauthenticated_handshakes_and_one_credential_are_bounded(
        start_gateway: Callable[..., GatewayProcess], tls: tuple[Path, Path, ssl.SSLContext],
        tokens: dict[str, str]) -> None:
    gateway = start_gateway("--max-connections", "10", "--max-unauthenticated", "2",
                            "--max-per-credential", "3")
    port = int(gateway.url.rsplit(":", 1)[1].split("/", 1)[0])

    def open_(token: str) -> Any:
        return connect(gateway.url, ssl=tls[2], subprotocols=[SUBPROTOCOL],
                       additional_headers={"Authorization": f"Bearer {tokens[token]}"},
                       compression=None, open_timeout=15, legacy=True)

    # Two connections that finished TLS and say nothing: they hold the two places of
    # unauthenticated handshakes, so a third handshake is refused before its lookup.
    silent = [tls[2].wrap_socket(socket.create_connection(("127.0.0.1", port)),
                                 server_hostname="localhost") for _ in range(2)]
    try:
        status, body = wait_for(lambda: _try_refusal(lambda: open_("full")), 10,
                                "the silent handshakes to be counted")
        assert (status, body.split(":")[0]) == (503, "OVERLOADED")
        # Within the hello's 5 s of their accept, the gateway drops them.
        for sock in silent:
            assert _closed_by_peer(sock, 15)
    finally:
        for sock in silent:
            sock.close()
    # A connect-only credential, which can never say hello, holds at most 3 places.
    looker = [open_("connect-only") for _ in range(3)]
    try:
        assert _refusal(lambda: open_("connect-only"))[0] == 503
        full = open_("full")  # another credential still gets in
        full.close()
    finally:
        for conn in looker:
            conn.close()


def test_a_remote_worker_starting_while_its_gateway_is_overloaded_gets_in_when_a_place_frees(
        env: Env, client_app: Celery, start_gateway: Callable[..., GatewayProcess],
        open_peer: Callable[..., Peer], remote: Callable[..., Worker]) -> None:
    full = start_gateway("--max-connections", "1", "-l", "debug")
    holder = _joined(open_peer(url=full.url), hello_body(queue=env.queue))
    worker = remote("late@edge", concurrency=1, url=full.url)
    wait_for(lambda: "503 Service Unavailable" in full.log(), 60,
             "the worker's handshake to be refused OVERLOADED")
    assert worker.proc.poll() is None  # refused, not given up: it tries again
    holder.conn.close()
    worker.wait_ready(30)
    assert client_app.send_task("gatewayapp.add", (3, 4), queue=env.queue
                                ).get(timeout=30)["sum"] == 7


def _closed_by_peer(sock: ssl.SSLSocket, timeout: float) -> bool:
    """Whether the other end closes ``sock`` within ``timeout`` (EOF, reset or a TLS
    close all say so; a timeout doesn't)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except (ssl.SSLError, ConnectionError):
        return True


def _try_refusal(call: Callable[[], Any]) -> tuple[int, str] | None:
    try:
        call().close()
    except InvalidStatus as exc:
        return exc.response.status_code, exc.response.body.decode(errors="replace")
    return None


# -- ownership ---------------------------------------------------------------------------
def test_another_credentials_hello_takes_no_instance_on_any_gateway(
        env: Env, open_peer: Callable[..., Peer], start_gateway: Callable[..., GatewayProcess],
        gateway: GatewayProcess) -> None:
    hello = hello_body(queue=env.queue)
    owner = _joined(open_peer(), hello)
    assert _declare(owner)["type"] == "ack"
    # A credential for another queue, with the owner's id: refused, closed, and the
    # owner's session is untouched (still current, still answered).
    thief = open_peer("other-queue")
    stolen = dict(hello_body(queue="images"), instance_id=hello["instance_id"])
    assert thief.error("worker.hello", stolen, session_id=None) == "UNAUTHENTICATED"
    assert thief.closed_with() == 1008
    assert _declare(owner, 2)["type"] == "ack"
    # A second gateway process on the same store knows the owner too, though it never
    # saw it: the thief is refused there first, and the owner is welcome.
    second = start_gateway()
    thief = open_peer("other-queue", url=second.url)
    assert thief.error("worker.hello", stolen, session_id=None) == "UNAUTHENTICATED"
    # The owner's credential without the owner's secret takes nothing either.
    impostor = open_peer(url=second.url)
    forged = dict(hello_body(queue=env.queue), instance_id=hello["instance_id"])
    assert impostor.error("worker.hello", forged, session_id=None) == "UNAUTHENTICATED"
    moved = _joined(open_peer(url=second.url), hello)
    assert moved.session_id != owner.session_id
    assert _declare(moved, 3)["type"] == "ack"


def test_a_restarted_gateway_keeps_a_remote_workers_instance_from_another_credential(
        env: Env, client_app: Celery, gateway: GatewayProcess, open_peer: Callable[..., Peer],
        start_gateway: Callable[..., GatewayProcess], remote: Callable[..., Worker]) -> None:
    worker = remote("owner@edge", concurrency=1).wait_ready(60)
    instance_id = wait_for(lambda: re.search(
        r"instance ([0-9a-f]{32}) \(credential runner", gateway.log()), 30,
        "the remote worker's hello").group(1)
    port = gateway.url.rsplit(":", 1)[1].split("/", 1)[0]
    gateway.kill()
    # The same address, a new process with an empty memory: the thief comes first (the
    # worker reconnects with a backoff), and is refused all the same.
    restarted = start_gateway("--bind", f"127.0.0.1:{port}")
    thief = open_peer("other-queue", url=restarted.url)
    stolen = dict(hello_body(queue="images"), instance_id=instance_id)
    assert thief.error("worker.hello", stolen, session_id=None) == "UNAUTHENTICATED"
    result = client_app.send_task("gatewayapp.add", (2, 3), queue=env.queue)
    assert result.get(timeout=60)["sum"] == 5
    assert worker.proc.poll() is None, worker.log()[-3000:]
    assert "UNAUTHENTICATED" not in worker.log()


# -- keepalive ---------------------------------------------------------------------------
def test_an_idle_remote_worker_is_never_cut_and_a_silent_peer_is(
        env: Env, client_app: Celery, gateway: GatewayProcess, proxy: Proxy,
        open_peer: Callable[..., Peer], remote: Callable[..., Worker]) -> None:
    worker = remote("idle@edge", concurrency=1).wait_ready(60)
    sessions = r"instance [0-9a-f]{32} \(credential runner, queue [^)]*\) session"
    wait_for(lambda: re.search(sessions, gateway.log()), 30, "the remote worker's hello")
    # A peer whose network goes silent (no pong either): cut once its read idle passes.
    silent = _joined(open_peer(url=f"wss://localhost:{proxy.port}/v1/worker/connect"),
                     hello_body(queue=env.queue))
    proxy.freeze()
    wait_for(lambda: re.search(rf"closing the connection of {silent.session_id}: read idle",
                               gateway.log()), 20, "the silent peer to be cut")
    # From then on, the idle worker's is the only connection: it sends nothing, and is
    # asked five times over (each read idle) whether it is there. It answers, and keeps
    # its one session: no close, no second hello, and it still takes work.
    def probes_since_the_cut() -> int:
        after = gateway.log().split(f"closing the connection of {silent.session_id}", 1)[1]
        return min(after.count("> PING"), after.count("< PONG"))
    wait_for(lambda: probes_since_the_cut() >= 5, 30, "five idle periods, each probed")
    log = gateway.log()
    assert len(re.findall(sessions, log)) == 2, log[-3000:]  # the worker's and the peer's
    assert len(re.findall(r"closing the connection of", log)) == 1, log[-3000:]
    assert client_app.send_task("gatewayapp.add", (1, 1), queue=env.queue
                                ).get(timeout=30)["sum"] == 2
    assert len(re.findall(sessions, gateway.log())) == 2
    assert worker.proc.poll() is None
    proxy.cut()  # the silent peer's client learns it is gone (else its close waits)


# -- logs --------------------------------------------------------------------------------
def test_a_debug_remote_worker_and_gateway_log_no_secret(
        env: Env, client_app: Celery, gateway: GatewayProcess, tokens: dict[str, str],
        gateway_store: SqlStore, remote: Callable[..., Worker]) -> None:
    worker = remote("chatty@edge", concurrency=1, extra=("-l", "debug")).wait_ready(60)
    result = client_app.send_task("gatewayapp.add", (4, 5), queue=env.queue)
    assert result.get(timeout=30)["sum"] == 9
    worker.kill()
    token = tokens["full"]
    secret = parse_token(token)[1]  # base64url: the secret itself may hold "_"
    for name, log in (("worker", worker.log()), ("gateway", gateway.log())):
        # Debug logging was on: the handshake and the frames were logged, redacted.
        assert "GET /v1/worker/connect" in log, f"no handshake in the {name}'s debug log"
        assert "[redacted]" in log, name
        for shown in (secret, secret[:12], secret[-12:]):
            lines = [line for line in log.splitlines() if shown in line]
            assert not lines, f"the {name}'s log shows its credential: {lines[:3]}"
        assert not re.search(r'"(lease|instance)_secret"\s*:\s*"(?!\[redacted\])', log), name


# -- finishing ---------------------------------------------------------------------------
def test_a_finish_without_a_start_is_evidence_only_with_its_result_kept(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        open_peer: Callable[..., Peer]) -> None:
    peer = _joined(open_peer(), hello_body(queue=env.queue, capacity=1))
    assert _declare(peer)["type"] == "ack"
    task_id = client_app.send_task("opsapp.noop", queue=env.queue).id
    assign = peer.assignment()
    ref = {k: assign["body"][k] for k in ("task_id", "attempt_id", "epoch", "lease_secret")}
    done = peer.call("task.finish", {"ref": ref, "outcome": "SUCCEEDED",
                                     "result": {"answer": 42}})
    assert done["type"] == "ack", done
    assert done["body"]["receipt"]["disposition"] == "EVIDENCE_ONLY", done
    assert done["body"]["lease"]["active"] is False
    assert claim_of(gateway_store, task_id).state == "reserved"  # nothing applied
    assert AsyncResult(task_id, app=client_app).state == "PENDING"
    assert [(r.holder.startswith("gw:runner:"), r.outcome)
            for r in evidence_of(gateway_store, task_id)] == [(True, "succeeded")]
    with gateway_store.engine.connect() as conn:
        kept = conn.execute(sa.text("SELECT result FROM pulse_evidence WHERE task_id = :t"),
                            {"t": task_id}).scalar_one()
    assert json.loads(kept) == {"answer": 42}
    # The attempt had no authority: it can't start now, and the task is dispatched
    # again once its reservation expires.
    assert peer.error("task.start", ref) == "LEASE_LOST"
    again = peer.assignment(timeout=30)
    assert again["body"]["task"]["id"] == task_id
    assert int(again["body"]["epoch"]) > int(assign["body"]["epoch"])

