"""Capabilities route tasks (issue 37, seed 003): a delivery goes only to an instance that
declared it can run it.

A rolling deploy adds a task: the old workers' hellos don't list it. Before, the gateway
assigned it to whichever instance had room, and an old worker failed it as an
unregistered task. Now it waits at the gateway, goes back to the broker, and runs once a
worker of the new deploy connects; the old workers go on with the rest.

Real processes: a gateway (PostgreSQL, TLS, RabbitMQ) and two remote workers.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from celery import Celery

from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import GatewayProcess, claim_of, evidence_of
from tests.helpers.workers import Env, Worker, wait_for


@pytest.fixture
def env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    made = make_env(pg_url, rabbitmq_url, {
        "result_backend": "pulse://", "pulse_lease_ttl": 4, "pulse_recover_interval": 0.5})
    made.app = "tests.apps.opsapp"
    return made


def test_a_task_only_the_newer_deploy_has_waits_for_a_worker_that_declares_it(
        env: Env, client_app: Celery, gateway: GatewayProcess, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    old = remote("remote-old@edge", concurrency=2).wait_ready(60)
    newer = [client_app.send_task("gatewayapp.newer", queue=env.queue) for _ in range(3)]
    wait_for(lambda: "gatewayapp.newer on" in gateway.log(), 30,
             "the gateway to say the old worker can't run it")
    # The old worker runs what it has meanwhile, and never saw the newer task.
    assert client_app.send_task("gatewayapp.plus", (1, 2), queue=env.queue).get(timeout=30) == 3
    assert all(r.state == "PENDING" for r in newer)
    assert "gatewayapp.newer" not in old.log()

    remote("remote-new@edge", concurrency=2, conf={"test_newer_deploy": True}).wait_ready(60)
    assert [r.get(timeout=60) for r in newer] == ["remote-new@edge"] * 3
    for result in newer:
        claim = claim_of(gateway_store, result.id)
        assert (claim.state, claim.epoch) == ("succeeded", 1)  # never reserved for the old
        assert evidence_of(gateway_store, result.id) == []
    assert gateway.log().count("gatewayapp.newer on") == 1  # said once, not per delivery
    assert old.proc.poll() is None
