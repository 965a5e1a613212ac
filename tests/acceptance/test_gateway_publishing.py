"""What a remote worker's task publishes: ``self.retry()``, ETA/countdown, a chain's next
step. A gateway worker has no broker; its task's publications to its own queue travel
in the finish, and the gateway publishes them before it applies the finish. A delivery
with an ETA waits at the gateway, unacknowledged, until due (a remote worker renews only
started attempts: reserved early, it would expire and be dispatched again).

Before: ``self.retry()`` failed with ``NoPublishing`` (the task ended ``failed``), and a
countdown longer than the lease cost an attempt per lease expiry.

Real processes: the gateway (PostgreSQL, TLS, the broker) and a remote worker.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest
from celery import Celery, chain

from celery_pulse.store.sql import SqlStore
from tests.helpers.gateway import broker_env, claim_of, evidence_of
from tests.helpers.workers import Env, Worker


@pytest.fixture(params=["redis", "rabbitmq"])
def env(request: pytest.FixtureRequest, pg_url: str, make_env: Callable[..., Env]) -> Env:
    return broker_env(request, pg_url, make_env)


def _runs(folder: object) -> list[tuple[int, int, float]]:
    """``(run, epoch, time)`` of each run ``gatewayapp.flaky`` recorded, in order."""
    from pathlib import Path

    out = []
    for path in Path(str(folder)).iterdir():
        run, epoch, at = path.name.split("-", 2)
        out.append((int(run), int(epoch), float(at)))
    return sorted(out)


@pytest.mark.parametrize("countdown", [0, 1])
def test_self_retry_on_a_remote_worker_runs_the_task_again_until_it_succeeds(
        env: Env, client_app: Celery, gateway_store: SqlStore, remote: Callable[..., Worker],
        countdown: float) -> None:
    """Two retries, then success: three runs, one claim ending ``succeeded``, nothing
    kept as evidence. A countdown of 0 publishes the retry while its attempt is still
    live (the gateway asks again once that attempt's finish applies, never dropping it
    as a duplicate); a countdown of 1 s waits at the gateway."""
    remote("remote-pub1@edge", concurrency=2).wait_ready(60)
    folder = env.tmp / f"flaky-{countdown}"
    folder.mkdir()
    result = client_app.send_task("gatewayapp.flaky", (str(folder), 2, countdown),
                                  queue=env.queue)
    assert result.get(timeout=60) == 3
    runs = _runs(folder)
    assert [r[0] for r in runs] == [1, 2, 3]
    assert [r[1] for r in runs] == sorted({r[1] for r in runs})  # a new epoch each run
    if countdown:
        assert all(b[2] - a[2] >= countdown - 0.05 for a, b in itertools.pairwise(runs))
    claim = claim_of(gateway_store, result.id)
    assert claim.state == "succeeded"
    assert claim.epoch == runs[-1][1]
    assert evidence_of(gateway_store, result.id) == []


def test_a_countdown_longer_than_the_lease_waits_at_the_gateway_and_runs_once(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    """A 9 s countdown against a 4 s lease: held by the gateway, reserved when due, run
    once at epoch 1 (reserved early, it would have been dispatched again at each lease
    expiry, spending attempts)."""
    remote("remote-pub2@edge", concurrency=1).wait_ready(60)
    folder = env.tmp / "eta"
    folder.mkdir()
    sent = time.time()
    result = client_app.send_task("gatewayapp.flaky", (str(folder), 0, 0),
                                  queue=env.queue, countdown=9)
    assert result.get(timeout=60) == 1
    [(_, epoch, ran_at)] = _runs(folder)
    assert epoch == 1
    assert ran_at >= sent + 9 - 0.5  # not before its time (clock granularity aside)
    claim = claim_of(gateway_store, result.id)
    assert (claim.state, claim.epoch) == ("succeeded", 1)
    # The queue is not blocked meanwhile: a task sent after it ran before it.
    assert client_app.send_task("gatewayapp.plus", (2, 2), queue=env.queue).get(timeout=30) == 4


def test_a_chain_on_a_remote_workers_queue_runs_step_after_step(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    remote("remote-pub3@edge", concurrency=2).wait_ready(60)
    steps = chain(client_app.signature("gatewayapp.plus", (1, 2), queue=env.queue),
                  client_app.signature("gatewayapp.plus", (3,), queue=env.queue),
                  client_app.signature("gatewayapp.plus", (4,), queue=env.queue))
    result = steps.apply_async()
    assert result.get(timeout=60) == 10
    assert claim_of(gateway_store, result.id).state == "succeeded"
    assert claim_of(gateway_store, result.parent.id).state == "succeeded"


def test_a_publication_to_another_queue_fails_the_task_saying_why(
        env: Env, client_app: Celery, gateway_store: SqlStore,
        remote: Callable[..., Worker]) -> None:
    worker = remote("remote-pub4@edge", concurrency=1).wait_ready(60)
    result = client_app.send_task("gatewayapp.elsewhere", queue=env.queue)
    with pytest.raises(Exception, match="only to its own queue"):
        result.get(timeout=30)
    assert claim_of(gateway_store, result.id).state == "failed"
    assert worker.proc.poll() is None  # the worker carries on
