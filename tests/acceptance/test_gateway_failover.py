"""Two gateway processes on one store are interchangeable (issue 37): a remote worker's
attempts, sessions and re-sent operations are the store's, not one process's memory.

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
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery

from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import GatewayProcess
from tests.helpers.proxy import Proxy
from tests.helpers.workers import Env, Worker, wait_for

TASKS = 160
SECONDS = 0.1


@pytest.fixture
def env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    made = make_env(pg_url, rabbitmq_url, {"result_backend": "pulse://", "pulse_lease_ttl": 4,
                                           "pulse_recover_interval": 0.5})
    made.app = "tests.apps.opsapp"
    return made


@pytest.fixture
def balancer(gateway: GatewayProcess) -> Proxy:
    """The load balancer in front of the gateways, aimed at the first one."""
    made = Proxy(_port(gateway))
    yield made  # type: ignore[misc]
    made.close()


def _port(gateway: GatewayProcess) -> int:
    return int(gateway.url.rsplit(":", 1)[1].split("/", 1)[0])


def _aim(balancer: Proxy, gateway: GatewayProcess) -> None:
    """New connections go to ``gateway``; the open ones are cut (the workers reconnect)."""
    balancer.target = ("127.0.0.1", _port(gateway))
    balancer.cut()


def _runs(folder: Path) -> collections.Counter[int]:
    return collections.Counter(int(name.split("-", 1)[0]) for name in os.listdir(folder))


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
