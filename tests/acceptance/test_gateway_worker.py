"""A remote ``celery worker -P pulse`` that talks only to the gateway (issue 18): it has
the gateway's URL, a credentials file and the CA, and no database or broker
credentials. The user's tasks, ``-c``, ``current_lease()`` and results work as on a
direct worker; a SIGKILLed remote worker's claim is taken over as a direct one's.

Real processes: the gateway (RabbitMQ, PostgreSQL, TLS) and the remote worker.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import claim_of, evidence_of, start_hold
from tests.helpers.proxy import Proxy
from tests.helpers.workers import Env, Worker, wait_for


@pytest.fixture
def env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    made = make_env(pg_url, rabbitmq_url, {"result_backend": "pulse://", "pulse_lease_ttl": 4,
                                           "pulse_recover_interval": 0.5})
    made.app = "tests.apps.opsapp"
    return made


def test_a_remote_worker_runs_tasks_with_gateway_credentials_only(
        env: Env, client_app: Celery, gateway_store: SqlStore, remote: Callable[..., Worker]) -> None:
    worker = remote("remote1@edge", concurrency=2).wait_ready(60)
    results = [client_app.send_task("gatewayapp.add", (i, 1), queue=env.queue)
               for i in range(8)]
    values = [r.get(timeout=30) for r in results]
    assert [v["sum"] for v in values] == [i + 1 for i in range(8)]
    assert all(v["epoch"] == 1 for v in values)  # current_lease() in the task
    folder = env.tmp / "meet"
    folder.mkdir()
    met = [client_app.send_task("gatewayapp.meet", (str(folder), 1), queue=env.queue)
           for _ in range(2)]
    assert len({r.get(timeout=30) for r in met}) == 2  # -c 2: two pool processes at once
    for r in results:
        claim = claim_of(gateway_store, r.id)
        assert claim.state == "succeeded" and claim.holder.startswith("gw:runner:")
    failed = client_app.send_task("gatewayapp.fail", ("nope",), queue=env.queue)
    with pytest.raises(ValueError, match="nope"):
        failed.get(timeout=30)
    assert claim_of(gateway_store, failed.id).state == "failed"
    assert "Traceback" not in worker.log().split("gatewayapp.fail")[0]


def test_a_killed_remote_workers_task_is_taken_over_by_recover(
        env: Env, client_app: Celery, gateway_store: SqlStore, remote: Callable[..., Worker]) -> None:
    worker = remote("remote2@edge", concurrency=1).wait_ready(60)
    result, _ = start_hold(client_app, env, 60, "held.txt")
    assert claim_of(gateway_store, result.id).state == "running"
    os.killpg(worker.pid, signal.SIGKILL)
    # Its claim expires by the store clock; the gateway's Recover takes it over (a started
    # task without acks_late: needs review), as for a direct worker.
    wait_for(lambda: claim_of(gateway_store, result.id).state == "needs_review", 30,
             "Recover to take the dead remote worker's task")
    assert AsyncResult(result.id, app=client_app).state == "PENDING"


def test_a_queue_outside_the_credentials_scope_fails_the_start(
        remote: Callable[..., Worker]) -> None:
    worker = remote("remote3@edge", queue="images")
    assert worker.wait(60) == 78  # EX_CONFIG: a setting is wrong, said in one line
    log = worker.log()
    assert "pulse_gateway_credentials" in log and "FORBIDDEN" in log
    assert "Traceback" not in log


def test_a_cut_gateway_connection_mid_task_is_resumed_and_the_task_finishes_once(
        env: Env, client_app: Celery, gateway_store: SqlStore, proxy: Proxy,
        remote: Callable[..., Worker]) -> None:
    worker = remote("remote4@edge", concurrency=1, through_proxy=True).wait_ready(60)
    result, marker = start_hold(client_app, env, 3, "cut.txt", "the task to start")
    assert proxy.cut() == 1  # the worker lives on; its connection doesn't
    assert result.get(timeout=30) == "held"
    assert proxy.connections >= 2  # it reconnected
    assert claim_of(gateway_store, result.id).state == "succeeded"
    assert evidence_of(gateway_store, result.id) == []
    assert "lost" not in marker.read_text()
    assert "Traceback" not in worker.log()


def test_a_paused_remote_workers_late_outcome_is_never_authoritative(
        env: Env, client_app: Celery, gateway_store: SqlStore, remote: Callable[..., Worker]) -> None:
    """Only the worker's main process is paused (its pool child finishes the body, the
    result waits in the pipe) past its lease; Recover takes the task over. On resuming,
    the worker's watchdog finds the lease past its local deadline and drops the outcome
    (no finish sent), or the finish reaches the gateway first and is kept as evidence
    only: a race, as for a direct worker (tests/acceptance/test_permits.py), and both
    leave the store's verdict alone."""
    worker = remote("remote5@edge", concurrency=1).wait_ready(60)
    result, _ = start_hold(client_app, env, 2, "paused.txt", "the task to start")
    worker.signal_main(signal.SIGSTOP)
    try:
        wait_for(lambda: claim_of(gateway_store, result.id).state == "needs_review", 30,
                 "Recover to take the paused worker's task")
    finally:
        worker.signal_main(signal.SIGCONT)
    worker.wait_log(r"kept as evidence only|lease lost for task " + result.id, 30)
    if "kept as evidence only" in worker.log():
        [row] = evidence_of(gateway_store, result.id)
        assert row.holder.startswith("gw:runner:") and row.outcome == "succeeded"
    else:
        assert evidence_of(gateway_store, result.id) == []
    assert claim_of(gateway_store, result.id).state == "needs_review"
    assert AsyncResult(result.id, app=client_app).state == "PENDING"


def test_a_revoked_credential_stops_the_remote_worker(
        env: Env, client_app: Celery, remote: Callable[..., Worker]) -> None:
    worker = remote("remote6@edge", concurrency=1).wait_ready(60)
    _, marker = start_hold(client_app, env, 60, "revoked.txt", "the task to start")
    assert env.celery("pulse", "credentials", "revoke", "runner").returncode == 0
    # Its next renewal is refused: the task loses its lease, and the worker, whose
    # session the gateway ended, stops (as one whose identity was taken).
    wait_for(lambda: "lost" in marker.read_text(), 30, "LeaseLost after the revocation")
    assert worker.wait(60) != 0


def _take_over(store: SqlStore, task_id: str) -> None:
    """What another worker's Recover would do: a new epoch for someone else."""
    with store.engine.begin() as conn:
        done = conn.execute(sa.text(
            "UPDATE pulse_claims SET epoch = epoch + 1, holder = 'thief', token = :t, "
            "lease_until = lease_until + 60 WHERE task_id = :id AND state = 'running'"),
            {"t": "f" * 32, "id": task_id}).rowcount
    assert done == 1


def test_a_task_ignoring_lease_lost_is_hard_stopped_and_the_remote_worker_goes_on(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    worker = remote("remote8@edge", concurrency=1).wait_ready(60)
    marker = env.tmp / "stubborn.txt"
    result = client_app.send_task("gatewayapp.stubborn", (str(marker), 60), queue=env.queue)
    wait_for(lambda: marker.exists() and "start" in marker.read_text(), 30,
             "the task to start")
    pid = int(marker.read_text().split()[1])
    _take_over(gateway_store, result.id)
    # Its next renewal through the gateway is refused: LeaseLost, ignored, then the hard
    # stop after pulse_revoke_grace (5 s) kills the pool process.
    wait_for(lambda: "ignored" in marker.read_text(), 30, "LeaseLost in the task")
    wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 30, "the hard stop")
    worker.wait_log(rf"task {result.id} epoch 1 ignored LeaseLost", 10)
    assert "end" not in marker.read_text()
    # The pool replaced the process: the worker serves the next task.
    assert client_app.send_task("gatewayapp.add", (1, 2), queue=env.queue).get(
        timeout=30)["sum"] == 3
    assert claim_of(gateway_store, result.id).holder == "thief"  # untouched by the stale one


def test_a_remote_worker_holds_its_prefetch_besides_what_runs_as_a_direct_worker_does(
        env: Env, client_app: Celery, gateway_store: SqlStore, remote: Callable[..., Worker]
) -> None:
    """``-c 1`` with a prefetch multiplier of 2: one task running and two waiting for the
    process, as a direct worker (and Celery, whose prefetch counts the messages not yet
    started) holds them; the instance declares a capacity of 3 and the rest stay in the
    broker. (It declared 2 before: a remote worker held a fifth less than a direct one
    at Celery's defaults, and its throughput is its capacity over the time a slot is
    held: docs/benchmarks.md section 10.)"""
    remote("remote-cap@edge", concurrency=1,
           conf={"worker_prefetch_multiplier": 2}).wait_ready(60)
    with gateway_store.engine.connect() as conn:
        [capacity] = conn.execute(sa.text("SELECT capacity FROM pulse_gateway_instances "
                                          "WHERE session_id IS NOT NULL")).scalars().all()
    assert capacity == 3
    first, _ = start_hold(client_app, env, 60, "cap0.txt")
    later = [client_app.send_task("gatewayapp.hold", (60, str(env.tmp / f"cap{i}.txt")),
                                  queue=env.queue) for i in range(1, 6)]
    ids = {first.id, *(r.id for r in later)}

    def held() -> list[str] | None:
        states = sorted(c.state for c in gateway_store.list_claims() if c.task_id in ids)
        return states if len(states) >= 3 else None

    assert wait_for(held, 30, "three tasks held by the remote worker") == [
        "reserved", "reserved", "running"]
    assert sum((env.tmp / f"cap{i}.txt").exists() for i in range(6)) == 1
