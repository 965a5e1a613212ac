"""Celery's revoke reaches remote workers: ``AsyncResult.revoke()`` (the broadcast every
Celery worker hears) is heard by the gateway, which ends what was not started and sends
``task.cancel`` to the instance holding the task, whose own Celery revokes it
(``terminate`` included), as on a direct worker.

Real processes: the gateway (PostgreSQL, RabbitMQ or Redis, TLS) and a remote worker.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import GatewayProcess, broker_env, claim_of, start_hold
from tests.helpers.workers import Env, Worker, wait_for


@pytest.fixture(params=["rabbitmq", "redis"])
def env(request: pytest.FixtureRequest, pg_url: str, make_env: Callable[..., Env]) -> Env:
    """Both brokers: Celery's broadcast is a fanout exchange on RabbitMQ, PUB/SUB on Redis."""
    return broker_env(request, pg_url, make_env)


def _state(client_app: Celery, task_id: str) -> str:
    return str(AsyncResult(task_id, app=client_app).state)


def _hearing(gateway: GatewayProcess) -> None:
    wait_for(lambda: "hearing Celery's revoke broadcast" in gateway.log(), 30,
             "the gateway to hear the revoke broadcast")


def test_revoke_with_terminate_stops_a_running_task_on_a_remote_worker(
        env: Env, client_app: Celery, gateway: GatewayProcess, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    worker = remote("remote-rv1@edge", concurrency=1).wait_ready(60)
    _hearing(gateway)
    long, marker = start_hold(client_app, env, 60, "long.txt")
    long.revoke(terminate=True, signal="KILL")  # Celery's spelling, as the worker's
    wait_for(lambda: claim_of(gateway_store, long.id).state == "revoked", 30,
             "the claim to end revoked")
    assert _state(client_app, long.id) == "REVOKED"
    assert "lost" not in marker.read_text()  # terminated, not a lost lease
    worker.wait_log(r"Terminating " + long.id + r" \(9\)", 10)  # Celery's own revoke handler did it
    after = client_app.send_task("gatewayapp.add", (2, 3), queue=env.queue)
    assert after.get(timeout=30)["sum"] == 5  # the worker goes on
    assert "Traceback" not in worker.log().split("Terminating")[0]


def test_a_revoked_task_held_but_not_started_never_runs(
        env: Env, client_app: Celery, gateway: GatewayProcess, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    """One revoked while assigned to the busy worker (its prefetch) and one while still in
    the broker: the first ends at once, the second when the gateway receives it; neither
    runs, both REVOKED, and a plain revoke lets the running task finish."""
    remote("remote-rv2@edge", concurrency=1).wait_ready(60)
    _hearing(gateway)
    busy, _ = start_hold(client_app, env, 4, "busy.txt", "the only process to be busy")
    waiting = [client_app.send_task("gatewayapp.add", (i, i), queue=env.queue)
               for i in range(6)]
    wait_for(lambda: any(c.task_id == waiting[0].id for c in gateway_store.list_claims()), 30,
             "the first waiting task to be assigned")
    for result in waiting:
        result.revoke()
    busy.revoke()  # without terminate: runs on, as on a direct worker
    assert busy.get(timeout=30) == "held"
    for result in waiting:
        wait_for(lambda r=result: _state(client_app, r.id) == "REVOKED", 30,
                 f"{result.id} to be revoked")
        claim = claim_of(gateway_store, result.id)
        assert claim.state == "revoked" and claim.started_at is None, claim
    after = client_app.send_task("gatewayapp.add", (2, 3), queue=env.queue)
    assert after.get(timeout=30)["sum"] == 5


def test_a_revoke_for_other_workers_is_left_to_them_and_one_naming_the_instance_is_not(
        env: Env, client_app: Celery, gateway: GatewayProcess, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    remote("remote-rv3@edge", concurrency=1).wait_ready(60)
    _hearing(gateway)
    task, _ = start_hold(client_app, env, 60, "aimed.txt")
    holder = claim_of(gateway_store, task.id).holder
    # One broadcast consumer handles them in order: once the second is acted on, the
    # first was heard and left alone (one cancel sent, the second's).
    client_app.control.revoke(task.id, terminate=True, destination=["celery@elsewhere"])
    client_app.control.revoke(task.id, terminate=True, destination=[holder])
    wait_for(lambda: claim_of(gateway_store, task.id).state == "revoked", 30,
             "the claim to end revoked")
    assert _state(client_app, task.id) == "REVOKED"
    assert gateway.log().count(f"revoke of gatewayapp.hold[{task.id}] sent") == 1
