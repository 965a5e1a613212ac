"""Two gateway processes on one store are interchangeable (issue 37): a remote worker's
attempts, sessions and re-sent operations are the store's, not one process's memory.

The rules one by one, in raw frames against two gateways: a hello on one ends the
instance's session on the other; the other answers resume, renew, start and finish of
an attempt it never assigned, counts it against the instance's capacity, and answers a
finish already applied ``DUPLICATE`` with the result stored once.

The drill, as an operator meets it: two ``celery pulse gateway`` processes, two remote
workers reaching them through one TCP proxy (the load balancer), a run of short tasks;
mid-run one gateway is SIGKILLed and started again (the proxy sends the workers to the
new process), or the workers are switched to the other gateway. Every task runs exactly
once, succeeds, has its result stored, and none ends in ``needs_review``.

Real processes: two gateways (RabbitMQ, PostgreSQL, TLS), two remote workers.
"""

from __future__ import annotations

import collections
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult
from websockets.exceptions import ConnectionClosed

from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import GatewayProcess, Peer, claim_of, evidence_of, hello_body
from tests.helpers.proxy import Proxy
from tests.helpers.workers import Env, Worker, wait_for

TASKS = 160
SECONDS = 0.1


@pytest.fixture
def env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    # A lease longer than a gateway's restart takes on a loaded machine (a new process
    # imports Celery, then the workers back off and reconnect): an outage past the lease
    # is a lost lease by design, whatever the gateway keeps.
    made = make_env(pg_url, rabbitmq_url, {"result_backend": "pulse://",
                                           "pulse_lease_ttl": 15,
                                           "pulse_recover_interval": 0.5})
    made.app = "tests.apps.opsapp"
    return made


@pytest.fixture
def balancer(gateway: GatewayProcess) -> Iterator[Proxy]:
    """The load balancer in front of the gateways, aimed at the first one."""
    made = Proxy(_port(gateway))
    yield made
    made.close()


def _port(gateway: GatewayProcess) -> int:
    return int(gateway.url.rsplit(":", 1)[1].split("/", 1)[0])


def _aim(balancer: Proxy, gateway: GatewayProcess) -> None:
    """New connections go to ``gateway``; the open ones are cut (the workers reconnect)."""
    balancer.target = ("127.0.0.1", _port(gateway))
    balancer.cut()


def _join(open_peer: Callable[..., Peer], gateway: GatewayProcess, hello: dict[str, Any],
          sequence: int | None = None) -> Peer:
    peer = open_peer(url=gateway.url)
    welcome = peer.call("worker.hello", hello, session_id=None)
    assert welcome["type"] == "worker.welcome", welcome
    peer.session_id = welcome["body"]["session_id"]
    if sequence is not None:
        assert peer.call("worker.capacity", {"sequence": str(sequence),
                                             "capacity": hello["capacity"], "drain": False}
                         )["type"] == "ack"
    return peer


def _ref(assign: dict[str, Any]) -> dict[str, str]:
    body = assign["body"]
    return {k: body[k] for k in ("task_id", "attempt_id", "epoch", "lease_secret")}


def test_a_hello_on_another_gateway_ends_the_session_on_the_first(
        env: Env, gateway: GatewayProcess, start_gateway: Callable[..., GatewayProcess],
        open_peer: Callable[..., Peer]) -> None:
    other = start_gateway()
    hello = hello_body(queue=env.queue, capacity=1)
    first = _join(open_peer, gateway, hello, sequence=1)
    second = open_peer(url=other.url)
    welcome = second.call("worker.hello", hello, session_id=None)
    assert welcome["body"]["epoch"] == "2"  # the store's generation, not one gateway's
    replaced = first.recv(timeout=5)
    assert replaced["type"] == "error", replaced
    assert replaced["error"]["code"] == "SESSION_MISMATCH"
    assert first.closed_with(5) == 1008
    # The same hello with another queue is refused on either gateway: identity is kept.
    moved = dict(hello, queue_id="objects")
    third = open_peer(url=gateway.url)
    assert third.error("worker.hello", moved, session_id=None) == "STATE_CONFLICT"


def test_another_gateway_answers_an_attempt_it_never_assigned_and_counts_it(
        env: Env, client_app: Celery, gateway_store: SqlStore, gateway: GatewayProcess,
        start_gateway: Callable[..., GatewayProcess], open_peer: Callable[..., Peer]) -> None:
    other = start_gateway()
    hello = hello_body(queue=env.queue, capacity=1)
    peer = _join(open_peer, gateway, hello, sequence=1)
    ids = [client_app.send_task("opsapp.noop", queue=env.queue).id for _ in range(2)]
    assign = peer.assignment()
    start_id = secrets.token_hex(16)
    assert peer.call("task.start", _ref(assign), message_id=start_id)["type"] == "ack"
    peer.conn.close()  # its gateway never hears of it again
    back = _join(open_peer, other, hello)
    resumed = back.call("worker.resume", _ref(assign))
    assert resumed["body"]["lease"]["active"] is True, resumed
    assert back.call("worker.capacity", {"sequence": "2", "capacity": 1, "drain": False}
                     )["type"] == "ack"
    with pytest.raises(TimeoutError):
        back.assignment(timeout=2)  # capacity 1, held by the attempt the first assigned
    task_id = assign["body"]["task"]["id"]
    renewed = back.call("task.renew", _ref(assign))
    assert renewed["body"]["receipt"]["disposition"] == "APPLIED", renewed
    again = back.call("task.start", _ref(assign), message_id=start_id)  # its ACK was lost
    assert again["type"] == "ack" and again["body"]["receipt"]["disposition"] == "APPLIED"
    finish = {"ref": _ref(assign), "outcome": "SUCCEEDED", "result": "once"}
    finish_id = secrets.token_hex(16)
    done = back.call("task.finish", finish, message_id=finish_id)
    assert done["body"]["receipt"]["disposition"] == "APPLIED", done
    assert claim_of(gateway_store, task_id).state == "succeeded"
    assert AsyncResult(task_id, app=client_app).get(timeout=10) == "once"
    second = back.assignment()  # the slot is free again: the other task comes
    assert second["body"]["task"]["id"] in ids and second["body"]["task"]["id"] != task_id
    # The finish sent again through the first gateway (the ACK lost once more): the
    # store's verdict, once; nothing kept as evidence, nothing written twice.
    back.conn.close()
    third = _join(open_peer, gateway, hello)
    repeat = third.call("task.finish", finish, message_id=finish_id)
    assert repeat["type"] == "ack", repeat
    assert repeat["body"]["receipt"]["disposition"] == "DUPLICATE"
    assert claim_of(gateway_store, task_id).state == "succeeded"
    assert evidence_of(gateway_store, task_id) == []
    shown = env.celery_json("pulse", "attempts", task_id)  # what an operator reads
    [grant] = shown["gateway_attempts"]
    assert (grant["attempt_id"], grant["epoch"], grant["instance_id"]) == (
        assign["body"]["attempt_id"], int(assign["body"]["epoch"]), hello["instance_id"])
    assert grant["current"] is False and shown["evidence"] == []  # finished, once
    text = env.celery("pulse", "attempts", task_id, check=True).stdout
    assert assign["body"]["attempt_id"] in text and "succeeded" in text
    # A made-up attempt is still nobody's.
    forged = dict(_ref(second), attempt_id=secrets.token_hex(16))
    assert third.error("task.start", forged) == "NOT_FOUND"


def test_a_revoked_credential_ends_its_sessions_on_every_gateway_within_seconds(
        env: Env, gateway: GatewayProcess, start_gateway: Callable[..., GatewayProcess],
        open_peer: Callable[..., Peer]) -> None:
    """Operations check the credential each gateway read at its last check (no store
    round trip per frame); revocation still ends every session of it, busy or idle, on
    every gateway, within a check (1 s) of the revocation."""
    other = start_gateway()
    busy = _join(open_peer, gateway, hello_body(queue=env.queue, capacity=1), sequence=1)
    idle = _join(open_peer, other, hello_body(queue=env.queue, capacity=1), sequence=1)
    assert env.celery("pulse", "credentials", "revoke", "runner").returncode == 0
    revoked = time.monotonic()
    codes: list[str] = []
    while not codes and time.monotonic() < revoked + 10:
        # The busy one keeps operating (a repeat of its declaration) until it is refused,
        # told unasked that its session ended, or closed (the close names the code).
        try:
            busy.send("worker.capacity", {"sequence": "1", "capacity": 1, "drain": False})
            reply = busy.recv(timeout=5)
        except ConnectionClosed as exc:
            assert exc.rcvd is not None and exc.rcvd.code == 1008, exc
            codes.append(exc.rcvd.reason)
        else:
            if reply["type"] == "error":
                codes.append(reply["error"]["code"])
                assert busy.closed_with() == 1008
    ended = idle.recv(timeout=5)
    assert ended["type"] == "error" and ended["error"]["code"] == "UNAUTHENTICATED", ended
    assert idle.closed_with() == 1008
    assert codes == ["UNAUTHENTICATED"]
    assert time.monotonic() - revoked < 3.0


def _runs(folder: Path) -> collections.Counter[int]:
    return collections.Counter(int(name.split("-", 1)[0]) for name in os.listdir(folder))


def _started(folder: Path) -> list[float]:
    """When each run began (the time its body wrote), in order."""
    return sorted(float((folder / name).read_text()) for name in os.listdir(folder))


def _drill(env: Env, client_app: Celery, store: SqlStore, balancer: Proxy,
           remote: Callable[..., Worker], fault: Callable[[], None], name: str) -> None:
    folder = env.tmp / f"runs-{name}"
    folder.mkdir()
    url = f"wss://localhost:{balancer.port}/v1/worker/connect"
    workers = [remote(f"{name}{i}@edge", concurrency=2, url=url).wait_ready(60)
               for i in range(2)]
    results = [client_app.send_task("gatewayapp.tally", (str(folder), i, SECONDS),
                                    queue=env.queue) for i in range(TASKS)]
    wait_for(lambda: len(os.listdir(folder)) >= TASKS // 3, 60, "a third of the tasks to run")
    faulted_at, before = time.time(), len(balancer.accepted_at)
    fault()
    assert [r.get(timeout=90) for r in results] == list(range(TASKS))  # results stored
    runs = _runs(folder)
    assert sorted(runs) == list(range(TASKS))
    assert [i for i, n in runs.items() if n != 1] == []  # exactly once
    ids = {r.id for r in results}
    states = collections.Counter(c.state for c in store.list_claims() if c.task_id in ids)
    assert states == {"succeeded": TASKS}, states  # 0 in needs_review
    for worker in workers:
        assert "Traceback" not in worker.log(), worker.log()[-3000:]
    # Work resumes within 2 s of the workers reconnecting (both of them).
    back = balancer.accepted_at[before:before + 2]
    assert len(back) == 2 and back[0] >= faulted_at, balancer.accepted_at
    resumed = [t for t in _started(folder) if t > back[1]]
    assert resumed, back
    print(f"work resumed {resumed[0] - back[1]:.3f} s after the workers reconnected")
    assert resumed[0] - back[1] < 2.0, (resumed[:1], back)


def test_a_gateway_sigkilled_mid_run_and_restarted_loses_nothing(
        env: Env, client_app: Celery, gateway_store: SqlStore, gateway: GatewayProcess,
        start_gateway: Callable[..., GatewayProcess], balancer: Proxy,
        remote: Callable[..., Worker]) -> None:
    start_gateway()  # the other gateway, idle: two processes on one store

    def kill_and_restart() -> None:
        gateway.kill()
        _aim(balancer, start_gateway())

    _drill(env, client_app, gateway_store, balancer, remote, kill_and_restart, "killed")


def test_workers_switched_to_the_other_gateway_mid_run_lose_nothing(
        env: Env, client_app: Celery, gateway_store: SqlStore, gateway: GatewayProcess,
        start_gateway: Callable[..., GatewayProcess], balancer: Proxy,
        remote: Callable[..., Worker]) -> None:
    other = start_gateway()
    _drill(env, client_app, gateway_store, balancer, remote,
           lambda: _aim(balancer, other), "switched")
