"""pytest-celery's ``celery_worker_cluster`` of two local ``-P pulse`` nodes: a killed node's task.

A user-style override of ``celery_worker_cluster`` adds a second node from the
plugin's ``pulse_worker_node_factory``; the node that runs the task is SIGKILLed with
its pool. An ``acks_late`` task is re-run by the other node under Recover's epoch; a
default-acks task goes to review and nobody runs it again.

Three stacks, chosen per test with pytest-celery's own ``celery_broker`` fixture
(parametrized indirectly) and this module's ``pulse_store_url`` override: the
embedded default (filesystem broker, SQLite store), and the PostgreSQL store with
RabbitMQ and with Redis, where the broker must not hand the acknowledged task out
again by itself (Recover's re-publish is its only second delivery).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pytest_celery import CeleryWorkerCluster

from celery_pulse.contrib.pytest_celery import PulseTestSetup, PulseWorkerNode
from celery_pulse.testing import wait_for
from tests.apps import clustertasks
from tests.plugin.conftest import BOUND, OBSERVE, journal

pytestmark = pytest.mark.parametrize(
    "celery_broker", ["pulse_filesystem_broker", "pulse_rabbitmq_broker", "pulse_redis_broker"],
    ids=["filesystem-sqlite", "rabbitmq-postgres", "redis-postgres"], indirect=True)


@pytest.fixture
def pulse_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """SQLite with the filesystem broker, PostgreSQL with a server broker."""
    if request.node.callspec.params["celery_broker"] != "pulse_filesystem_broker":
        url: str = request.getfixturevalue("pulse_postgres_store_url")
        return url
    return f"sqlite:///{tmp_path / 'pulse.sqlite3'}"


@pytest.fixture
def celery_worker_cluster(celery_worker: PulseWorkerNode,
                          pulse_worker_node_factory: Callable[..., PulseWorkerNode]
                          ) -> Iterator[CeleryWorkerCluster]:
    cluster = CeleryWorkerCluster(celery_worker, pulse_worker_node_factory())
    yield cluster
    cluster.teardown()


def running_on(setup: PulseTestSetup, host: str) -> tuple[PulseWorkerNode, PulseWorkerNode]:
    """(the node whose hostname is ``host``, the other one)."""
    a, b = setup.worker_cluster  # type: ignore[misc]
    return (a, b) if a.hostname() == host else (b, a)


def test_killed_node_acks_late_task_reruns_on_the_other(
        celery_setup: PulseTestSetup, files: tuple[Path, Path]) -> None:
    path, gate = files
    assert len(celery_setup.worker_cluster) == 2  # type: ignore[arg-type]
    result = clustertasks.late.delay(str(path), str(gate))
    first = wait_for(lambda: journal(path, result.id, "start"), 20, "the task to start")[0]
    victim, survivor = running_on(celery_setup, first.host)
    victim.kill()
    killed = time.monotonic()
    gate.touch()
    rerun = wait_for(lambda: journal(path, result.id, "start")[1:], BOUND + 10,
                     "the re-run on the other worker")[0]
    assert time.monotonic() - killed <= BOUND
    assert rerun.host == survivor.hostname()
    assert result.get(timeout=30) == "done"
    done = celery_setup.wait_for_claim(result.id, "succeeded")
    # Recover took it over as epoch 2, the survivor reserved it as epoch 3 and ran it.
    assert (done.epoch, done.attempts, rerun.epoch) == (3, 2, 3)
    assert [(e.epoch, e.host) for e in journal(path, result.id, "end")] == [(3, survivor.hostname())]
    survivor.assert_log_exists(f"recovered clustertasks.late[{result.id}] (was running): "
                               "re-dispatched as epoch 2")
    # It was acknowledged at reservation: the broker never handed it out again by itself.
    assert "duplicate delivery of" not in survivor.logs()


def test_killed_node_plain_task_goes_to_review(
        celery_setup: PulseTestSetup, files: tuple[Path, Path]) -> None:
    path, gate = files
    task_id = clustertasks.plain.delay(str(path), str(gate)).id
    first = wait_for(lambda: journal(path, task_id, "start"), 20, "the task to start")[0]
    victim, _ = running_on(celery_setup, first.host)
    victim.kill()
    celery_setup.wait_for_claim(task_id, "needs_review", timeout=BOUND)
    gate.touch()
    time.sleep(OBSERVE)  # observation window: the other worker must not run it
    assert len(journal(path, task_id, "start")) == 1 and not journal(path, task_id, "end")
    assert celery_setup.claim(task_id).state == "needs_review"  # type: ignore[union-attr]
