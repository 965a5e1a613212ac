"""Seed 003 §5 on a gateway: a task still waiting past its deadline (Celery's
``expires``) ends, revoked, and is never dispatched again.

A Celery worker judges ``expires`` on receipt and marks the task ``REVOKED``; the gateway
does the same before it assigns a delivery. Before it did, the remote worker declined the
expired task, its unstarted finish was evidence only, and Recover dispatched it again at
every lease expiry, its result ``PENDING`` for good.

Real processes: the gateway (PostgreSQL, TLS, the broker) and a remote worker.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import broker_env, claim_of, evidence_of, start_hold
from tests.helpers.workers import Env, Worker, wait_for


@pytest.fixture(params=["redis", "rabbitmq"])
def env(request: pytest.FixtureRequest, pg_url: str, make_env: Callable[..., Env]) -> Env:
    return broker_env(request, pg_url, make_env)


def _revoked(client_app: Celery, task_id: str) -> bool:
    return AsyncResult(task_id, app=client_app).state == "REVOKED"


@pytest.mark.parametrize("env", ["redis"], indirect=True)  # RabbitMQ drops it at its TTL
def test_a_task_already_expired_is_revoked_by_the_gateway_and_never_assigned(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    """Redis keeps a message past its ``expires`` (RabbitMQ discards it at its TTL, as
    for any Celery worker): the gateway receives it expired and ends it at once."""
    worker = remote("remote-exp1@edge", concurrency=1).wait_ready(60)
    late = client_app.send_task("gatewayapp.add", (1, 1), queue=env.queue, expires=-1)
    wait_for(lambda: _revoked(client_app, late.id), 30, "the expired task to be revoked")
    claim = claim_of(gateway_store, late.id)
    assert (claim.state, claim.epoch, claim.started_at) == ("revoked", 1, None)
    assert claim.error == "expired before it ran"
    assert evidence_of(gateway_store, late.id) == []
    assert late.id not in worker.log()  # never assigned
    after = client_app.send_task("gatewayapp.add", (3, 3), queue=env.queue)
    assert after.get(timeout=30)["sum"] == 6  # the queue goes on


def test_a_task_that_expires_in_the_workers_prefetch_ends_revoked_not_redispatched(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    """Assigned before its ``expires`` (the instance's prefetch has room while its only
    process is busy), expired by the time the remote worker would run it: its Celery
    declines it and the unstarted finish is evidence only (seed 003 §4). The lease
    expires, Recover sends it back, and the gateway ends it REVOKED (epoch 3 at most):
    never the loop of dispatches it was. On RabbitMQ the re-published message carries no
    broker TTL (it would be dropped unconsumed, its claim re-published for good)."""
    remote("remote-exp2@edge", concurrency=1).wait_ready(60)
    busy, _ = start_hold(client_app, env, 3, "busy.txt", "the only process to be busy")
    late = client_app.send_task("gatewayapp.add", (1, 1), queue=env.queue, expires=1.0)
    assert busy.get(timeout=30) == "held"
    wait_for(lambda: _revoked(client_app, late.id), 40, "the expired task to be revoked")
    claim = claim_of(gateway_store, late.id)
    assert claim.state == "revoked" and claim.epoch <= 3 and claim.started_at is None
    assert claim.error == "expired before it ran"
