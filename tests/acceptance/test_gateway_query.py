"""``task.query`` (issue 37, seed 003's attempt and evidence queries): a remote worker asks
what became of a task: the claim, the attempts gateways assigned, the late outcomes kept
as evidence. Only a task of the instance's own queue; nothing of another's.

Real processes: a gateway (PostgreSQL, TLS, RabbitMQ), raw frames; ``celery pulse
attempts`` is the operator's view of the same rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import QUEUE, Peer, claim_of, hello_body
from tests.helpers.schema import assert_client, assert_server
from tests.helpers.workers import Env, wait_for


@pytest.fixture
def env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    made = make_env(pg_url, rabbitmq_url, {
        "result_backend": "pulse://", "pulse_lease_ttl": 3.0, "pulse_recover_interval": 0.5})
    made.app = "tests.apps.opsapp"
    return made


def _worker(open_peer: Callable[..., Peer], queue: str) -> Peer:
    peer = open_peer()
    welcome = peer.call("worker.hello", hello_body(queue=queue, capacity=1), session_id=None)
    peer.session_id = welcome["body"]["session_id"]
    assert peer.call("worker.capacity", {"sequence": "1", "capacity": 1,
                                         "drain": False})["type"] == "ack"
    return peer


def _ref(assign: dict[str, Any]) -> dict[str, Any]:
    return {k: assign["body"][k] for k in ("task_id", "attempt_id", "epoch", "lease_secret")}


def _query(peer: Peer, wire_task_id: str) -> dict[str, Any]:
    frame = {"protocol_version": "1", "type": "task.query", "message_id": "5" * 32,
             "session_id": peer.session_id, "body": {"task_id": wire_task_id}}
    assert_client(frame)
    reply = peer.call("task.query", {"task_id": wire_task_id})
    assert_server(reply)
    return reply


def test_a_worker_reads_its_tasks_attempts_and_the_late_outcome_kept_as_evidence(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        open_peer: Callable[..., Peer]) -> None:
    peer = _worker(open_peer, env.queue)
    task_id = client_app.send_task("opsapp.noop", queue=env.queue).id
    assign = peer.assignment()
    wire_id = assign["body"]["task_id"]
    reserved = _query(peer, wire_id)["body"]
    assert (reserved["task_state"], reserved["epoch"]) == ("RESERVED", "1")
    assert [(a["attempt_id"], a["current"], a["mine"]) for a in reserved["attempts"]] == [
        (assign["body"]["attempt_id"], True, True)]
    assert reserved["evidence"] == []

    assert peer.call("task.start", _ref(assign))["body"]["lease"]["state"] == "RUNNING"
    # Never renewed: Recover sends the started task to review; its finish comes late.
    wait_for(lambda: claim_of(gateway_store, task_id).state == "needs_review", 30,
             "Recover to send the started task to review")
    late = peer.call("task.finish", {"ref": _ref(assign), "outcome": "SUCCEEDED",
                                     "result": "late"})
    assert late["body"]["receipt"]["disposition"] == "EVIDENCE_ONLY"
    after = _query(peer, wire_id)["body"]
    assert after["task_state"] == "NEEDS_REVIEW"
    assert [(a["epoch"], a["current"]) for a in after["attempts"]] == [("1", False)]
    assert [(e["epoch"], e["outcome"], e["mine"]) for e in after["evidence"]] == [
        ("1", "SUCCEEDED", True)]
    # The operator's view of the same rows.
    shown = env.celery_json("pulse", "attempts", task_id)
    assert [g["attempt_id"] for g in shown["gateway_attempts"]] == [
        assign["body"]["attempt_id"]]


def test_a_task_of_another_queue_or_none_at_all_is_not_found(
        env: Env, client_app: Celery, open_peer: Callable[..., Peer]) -> None:
    """The same credential's instance on another queue learns nothing of this one's."""
    mine = _worker(open_peer, env.queue)
    other = _worker(open_peer, QUEUE)
    client_app.send_task("opsapp.noop", queue=QUEUE)
    theirs = other.assignment()["body"]["task_id"]
    assert _query(other, theirs)["type"] == "ack"
    refused = mine.call("task.query", {"task_id": theirs})
    assert_server(refused)
    assert refused["error"]["code"] == "NOT_FOUND"
    assert mine.error("task.query", {"task_id": "9" * 32}) == "NOT_FOUND"
