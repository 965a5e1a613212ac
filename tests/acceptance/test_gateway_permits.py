"""Cluster-wide concurrency permits on remote workers (issue 37).

A gateway worker computes a start's permits as a direct worker does and sends them in
``task.start``; the gateway takes them in the store, in the statement that starts the
attempt, and answers a start with no free permit ``WAITING``: the attempt stays reserved
and is renewed while it waits (so a wait longer than the lease costs no attempt). Keys
are the attempt's own task's or queue's only; the gateway's own limits override and are
required.

Before: a gateway worker with any concurrency limit refused to start.

Real processes: a gateway (PostgreSQL, TLS, RabbitMQ) and remote workers; the protocol
tests speak raw frames to the real gateway.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_pulse.store.sql import SqlStore
from tests.acceptance.test_rate_limits import JITTER, most_in_a_window, store_starts
from tests.helpers.gateway import GatewayProcess, Peer, claim_of, evidence_of, hello_body
from tests.helpers.schema import assert_server
from tests.helpers.workers import Env, Worker, wait_for

TTL = 3.0


@pytest.fixture
def env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    made = make_env(pg_url, rabbitmq_url, {
        "result_backend": "pulse://", "pulse_lease_ttl": TTL, "pulse_recover_interval": 0.5})
    made.app = "tests.apps.opsapp"
    return made


def _runs(folder: Path) -> list[tuple[float, float, int, str]]:
    """``(start, end, epoch, key)`` of every run the tasks recorded."""
    out = []
    for path in folder.iterdir():
        began, ended, epoch, *key = path.read_text().split(" ")
        out.append((float(began), float(ended), int(epoch), key[0] if key else ""))
    return out


def _most_at_once(runs: list[tuple[float, float, int, str]]) -> int:
    """The most runs whose bodies overlapped at any instant."""
    points = sorted([(r[0], 1) for r in runs] + [(r[1], -1) for r in runs],
                    key=lambda p: (p[0], p[1]))  # an end before a start at the same instant
    most = now = 0
    for _, step in points:
        now += step
        most = max(most, now)
    return most


def test_a_limit_holds_across_two_remote_workers_and_a_waiting_start_keeps_its_lease(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    """``pulse_concurrency=2`` on two remote workers of 3 processes each: never more than
    2 bodies at once, and 2 at once reached. 10 tasks of 1 s keep the last ones waiting
    about 4 s, past the 3 s lease: each still runs once, at epoch 1 (its reservation was
    renewed while it waited), and nothing is kept as evidence."""
    remote("remote-permit1@edge", concurrency=3).wait_ready(60)
    remote("remote-permit2@edge", concurrency=3).wait_ready(60)
    folder = env.tmp / "limited"
    folder.mkdir()
    results = [client_app.send_task("gatewayapp.limited", (str(folder), 1.0), queue=env.queue)
               for _ in range(10)]
    assert [r.get(timeout=90) for r in results] == [1] * 10
    runs = _runs(folder)
    assert len(runs) == 10
    assert _most_at_once(runs) == 2
    for result in results:
        assert (claim_of(gateway_store, result.id).state, claim_of(
            gateway_store, result.id).epoch) == ("succeeded", 1)
        assert evidence_of(gateway_store, result.id) == []


def test_a_keyed_limit_gives_each_key_its_own_permit(
        env: Env, client_app: Celery, remote: Callable[..., Worker]) -> None:
    """``pulse_concurrency=1`` per key: each key's runs never overlap, and the two keys
    run beside each other."""
    remote("remote-permit3@edge", concurrency=4).wait_ready(60)
    folder = env.tmp / "keyed"
    folder.mkdir()
    results = [client_app.send_task("gatewayapp.per_key", (str(folder), 0.5, key),
                                    queue=env.queue) for key in "abababab"]
    assert [r.get(timeout=90) for r in results] == [1] * 8
    runs = _runs(folder)
    for key in "ab":
        assert _most_at_once([r for r in runs if r[3] == key]) == 1
    assert _most_at_once(runs) == 2


def test_the_gateways_queue_limit_binds_a_worker_configured_alike_and_stops_one_that_is_not(
        env: Env, start_gateway: Callable[..., GatewayProcess], client_app: Celery,
        gateway_store: SqlStore, remote: Callable[..., Worker]) -> None:
    """The gateway is the operator's: its ``pulse_concurrency_limits`` names the queue
    (limit 1). A worker without that setting asks for no queue permit: its first start is
    refused FORBIDDEN naming the setting, and it exits (never runs unlimited). A worker
    configured alike runs the queue's tasks one at a time, the task's own limit of 2
    notwithstanding."""
    limits = {"pulse_concurrency_limits": {f"queue:{env.queue}": 1}}
    env.conf.update(limits)
    gateway = start_gateway()
    bare = remote("remote-permit4@edge", concurrency=2, url=gateway.url).wait_ready(60)
    folder = env.tmp / "queue-limited"
    folder.mkdir()
    results = [client_app.send_task("gatewayapp.limited", (str(folder), 0.5), queue=env.queue)
               for _ in range(4)]
    wait_for(lambda: bare.proc.poll() is not None, 60, "the unconfigured worker to exit")
    assert "pulse_concurrency_limits" in bare.log()
    assert list(folder.iterdir()) == []  # nothing ran without the queue's permit
    remote("remote-permit5@edge", concurrency=2, url=gateway.url, conf=limits).wait_ready(60)
    assert all(r.get(timeout=90) >= 1 for r in results)
    runs = _runs(folder)
    assert len(runs) == 4
    assert _most_at_once(runs) == 1
    for result in results:
        assert claim_of(gateway_store, result.id).state == "succeeded"


def test_a_rate_limit_holds_across_two_remote_workers(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    """``pulse_rate_limit="5/s"`` on two remote workers of 3 processes: the starts the
    store recorded never number more than 5 in any second, the bodies' by 50 ms of jitter
    less; 20 tasks take at least 3 s (20 / 5 - 1), each once."""
    remote("remote-rate1@edge", concurrency=3).wait_ready(60)
    remote("remote-rate2@edge", concurrency=3).wait_ready(60)
    folder = env.tmp / "rated"
    folder.mkdir()
    results = [client_app.send_task("gatewayapp.rated", (str(folder), 0.01), queue=env.queue)
               for _ in range(20)]
    assert [r.get(timeout=60) for r in results] == [1] * 20
    recorded = store_starts(gateway_store, [r.id for r in results])
    assert most_in_a_window(recorded, 1.0) == 5
    assert most_in_a_window([run[0] for run in _runs(folder)], 1.0 - JITTER) <= 5
    assert max(recorded) - min(recorded) >= 3.0 - 0.01


# -- the protocol, spoken raw to the real gateway -------------------------------------


def _worker(open_peer: Callable[..., Peer], env: Env, capacity: int) -> Peer:
    peer = open_peer()
    welcome = peer.call("worker.hello", hello_body(queue=env.queue, capacity=capacity),
                        session_id=None)
    peer.session_id = welcome["body"]["session_id"]
    assert peer.call("worker.capacity", {"sequence": "1", "capacity": capacity,
                                         "drain": False})["type"] == "ack"
    return peer


def _ref(assign: dict[str, Any]) -> dict[str, Any]:
    body = assign["body"]
    return {k: body[k] for k in ("task_id", "attempt_id", "epoch", "lease_secret")}


def test_a_start_without_a_free_permit_is_answered_waiting_and_renewed_until_it_starts(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        open_peer: Callable[..., Peer]) -> None:
    peer = _worker(open_peer, env, capacity=2)
    for _ in range(2):
        client_app.send_task("opsapp.noop", queue=env.queue)
    first, second = peer.assignment(), peer.assignment()
    permit = [{"key": "task:opsapp.noop", "limit": 1}]
    started = peer.call("task.start", {**_ref(first), "permits": permit})
    assert started["body"]["lease"]["state"] == "RUNNING"

    waiting = peer.call("task.start", {**_ref(second), "permits": permit})
    assert_server(waiting)
    assert waiting["body"]["receipt"]["disposition"] == "WAITING"
    assert waiting["body"]["lease"] == {**waiting["body"]["lease"], "active": True,
                                        "state": "WAITING"}
    task_id = second["body"]["task"]["id"]
    assert claim_of(gateway_store, task_id).state == "reserved"
    renewed = peer.call("task.renew", _ref(second))
    assert_server(renewed)
    assert renewed["body"]["receipt"]["disposition"] == "APPLIED"
    assert renewed["body"]["lease"]["state"] == "WAITING"
    # Extended while it waits (the timestamps are one fixed-width UTC form).
    assert renewed["body"]["lease"]["lease_until"] > waiting["body"]["lease"]["lease_until"]

    finish = {"ref": _ref(first), "outcome": "SUCCEEDED", "result": {"ok": True}}
    assert peer.call("task.finish", finish)["body"]["receipt"]["disposition"] == "APPLIED"
    now_started = peer.call("task.start", {**_ref(second), "permits": permit})
    assert now_started["body"]["lease"]["state"] == "RUNNING"
    assert claim_of(gateway_store, task_id).state == "running"


@pytest.mark.parametrize("key", ["task:opsapp.other", "queue:somebody-elses",
                                 "task:opsapp.noopx"])
def test_a_permit_of_another_task_or_queue_is_forbidden(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        open_peer: Callable[..., Peer], key: str) -> None:
    """One queue's credential can't count against, or raise, another's limit."""
    peer = _worker(open_peer, env, capacity=1)
    task_id = client_app.send_task("opsapp.noop", queue=env.queue).id
    assign = peer.assignment()
    refused = peer.error("task.start", {**_ref(assign), "permits": [{"key": key, "limit": 5}]},
                         message_id=secrets.token_hex(16))
    assert refused == "FORBIDDEN"
    assert claim_of(gateway_store, task_id).state == "reserved"  # never started
