"""The Python pulse.worker.v1 client (``celery_pulse.gateway.client``) against a real
``celery pulse gateway`` (issue 18): tasks end to end, and the connection cut mid-task
(a TCP proxy between them drops it; the worker side lives on): the client reconnects,
resumes, and the task finishes once, including when a finish's ACK was lost.

RabbitMQ, a PostgreSQL gateway_store, TLS checked end to end through the proxy.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_pulse.gateway.client import GatewayClient
from celery_pulse.gateway.frames import ProtocolError
from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import claim_of, evidence_of
from tests.helpers.proxy import Proxy
from tests.helpers.workers import Env, wait_for

CAPABILITIES = [{"handler": "opsapp.noop", "handler_version": "1", "payload_version": "1"}]


@pytest.fixture
def env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    made = make_env(pg_url, rabbitmq_url, {"result_backend": "pulse://",
                                           "pulse_recover_interval": 0.5})
    made.app = "tests.apps.opsapp"
    return made


@pytest.fixture
def make_client(env: Env, tokens: dict[str, str], proxy: Proxy,
                tls: tuple[Path, Path, ssl.SSLContext]) -> Iterator[Callable[..., GatewayClient]]:
    made: list[GatewayClient] = []

    def factory(capacity: int = 2, token: str = "full") -> GatewayClient:
        client = GatewayClient(f"wss://localhost:{proxy.port}/v1/worker/connect",
                               tokens[token], queue_id=env.queue, capabilities=CAPABILITIES,
                               capacity=capacity, ssl_context=tls[2], reconnect_max=0.5)
        made.append(client)
        client.start()
        return client

    yield factory
    for client in made:
        client.close()


def test_tasks_run_end_to_end_through_the_client(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        make_client: Callable[..., GatewayClient]) -> None:
    client = make_client(capacity=3)
    ids = [client_app.send_task("opsapp.noop", queue=env.queue).id for _ in range(6)]
    for _ in ids:
        assigned = client.assignments.get(timeout=15)
        started = client.start_task(assigned)
        assert started.active and started.deadline is not None
        assert client.renew(assigned).active
        done = client.finish(assigned, "SUCCEEDED", {"id": assigned.task_id})
        assert done.disposition == "APPLIED" and not done.active
    for task_id in ids:
        assert claim_of(gateway_store, task_id).state == "succeeded"
        assert AsyncResult(task_id, app=client_app).get(timeout=10) == {"id": task_id}


def test_a_cut_connection_mid_task_is_resumed_and_the_task_finishes_once(
        env: Env, client_app: Celery, gateway_store: SqlStore, proxy: Proxy,
        make_client: Callable[..., GatewayClient]) -> None:
    client = make_client(capacity=1)
    task_id = client_app.send_task("opsapp.noop", queue=env.queue).id
    assigned = client.assignments.get(timeout=15)
    first = client.start_task(assigned)
    epoch = client.epoch
    assert proxy.cut() == 1
    # The next operation waits for the reconnect (a new session of the same instance),
    # which resumed the attempt; the lease still holds.
    renewed = client.renew(assigned)
    assert renewed.active and client.epoch == epoch + 1 and client.reconnects == 1
    assert renewed.deadline is not None and first.deadline is not None
    assert renewed.deadline > first.deadline
    done = client.finish(assigned, "SUCCEEDED", "once")
    assert done.disposition == "APPLIED"
    assert claim_of(gateway_store, task_id).state == "succeeded"
    assert evidence_of(gateway_store, task_id) == []
    assert AsyncResult(task_id, app=client_app).get(timeout=10) == "once"


def test_a_finish_whose_ack_was_lost_is_sent_again_and_settles_once(
        env: Env, client_app: Celery, gateway_store: SqlStore, proxy: Proxy,
        make_client: Callable[..., GatewayClient]) -> None:
    client = make_client(capacity=1)
    task_id = client_app.send_task("opsapp.noop", queue=env.queue).id
    assigned = client.assignments.get(timeout=15)
    client.start_task(assigned)
    # Cut while the finish is on its way: whether the gateway applied it or not, the
    # client sends it again (same message_id) on the next connection.
    cutter = _cut_when_sent(client, proxy)
    done = client.finish(assigned, "SUCCEEDED", "once")
    assert cutter.wait(10), "the finish was never sent"
    assert done.disposition == "APPLIED", done.body  # the original receipt, or applied now
    assert client.reconnects >= 1
    assert claim_of(gateway_store, task_id).state == "succeeded"
    assert evidence_of(gateway_store, task_id) == []


def test_a_revoked_credential_ends_the_client(
        env: Env, make_client: Callable[..., GatewayClient]) -> None:
    client = make_client(capacity=1)
    assert env.celery("pulse", "credentials", "revoke", "runner").returncode == 0
    # The gateway ends the session at its next check of its sessions' credentials
    # (once a second), unasked: the client gives up.
    wait_for(lambda: client.fatal is not None, 5, "the revocation to end the client")
    with pytest.raises(ProtocolError) as info:
        client.declare(1)
    assert info.value.code == "UNAUTHENTICATED"
    with pytest.raises(ProtocolError):
        client.declare(1)  # and stays ended: nothing reconnects


def _cut_when_sent(client: GatewayClient, proxy: Proxy) -> threading.Event:
    """Cut the proxy right after the client's next frame goes out."""
    sent = threading.Event()
    conn = client._conn
    assert conn is not None
    original = conn.send

    def send(message: Any, text: bool | None = None) -> None:
        original(message)
        if not sent.is_set():
            sent.set()
            proxy.cut()

    conn.send = send  # type: ignore[method-assign]
    return sent
