"""celery_pulse.contrib.pytest_celery: pytest-celery's fixtures on real ``-P pulse`` workers.

These tests are written as a user would write them, with pytest-celery's names
(``celery_setup``, ``celery_worker``, ``celery_worker_cluster``,
``default_worker_tasks``); the plugin is loaded by ``tests/conftest.py``. The nodes
are local ``celery worker -P pulse`` subprocesses on the embedded default (SQLite
store under ``tmp_path``, ``filesystem://`` broker, ``file://`` backend); the
two-worker cluster tests also run on a PostgreSQL store.

The journal of :mod:`tests.apps.clustertasks` shows which worker ran which attempt
under which epoch; a killed node is SIGKILLed with its pool, like a vanished machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pytest_celery.vendors.worker.tasks import add

from celery_pulse.contrib.pytest_celery import PulseTestSetup, PulseWorkerNode
from celery_pulse.testing import wait_for
from tests.apps import clustertasks
from tests.plugin.conftest import BOUND, OBSERVE, journal


# -- one worker ------------------------------------------------------------------------------
def test_setup_runs_tasks_on_a_pulse_worker(celery_setup: PulseTestSetup,
                                            celery_worker: PulseWorkerNode) -> None:
    assert isinstance(celery_setup, PulseTestSetup) and celery_setup.worker is celery_worker
    assert celery_setup.ready(ping=True, control=True)
    result = add.s(2, 3).apply_async(queue=celery_worker.worker_queue)
    assert result.get(timeout=30) == 5
    claim = celery_setup.wait_for_claim(result.id, "succeeded")
    assert (claim.epoch, claim.holder) == (1, celery_worker.hostname())
    celery_worker.assert_log_exists(f"Task pytest_celery.vendors.worker.tasks.add[{result.id}] "
                                    "succeeded")
    assert any("-P" in p["cmdline"] and "pulse" in p["cmdline"]
               for p in celery_worker.get_running_processes_info(["cmdline"]))


def test_expire_lease_makes_the_running_task_see_lease_lost(
        celery_setup: PulseTestSetup, files: tuple[Path, Path]) -> None:
    path, gate = files
    task_id = clustertasks.plain.delay(str(path), str(gate)).id
    wait_for(lambda: journal(path, task_id, "start"), 20, "the task to start")
    epoch = celery_setup.expire_lease(task_id)
    lost = wait_for(lambda: journal(path, task_id, "lost"), 10, "the task to see LeaseLost")
    assert [e.epoch for e in lost] == [epoch] == [1]
    # Not safe to repeat: Recover sends it to review, and nobody runs it again.
    celery_setup.wait_for_claim(task_id, "needs_review", timeout=BOUND)
    gate.touch()
    time.sleep(OBSERVE)  # observation window: a wrong re-run would start and end now
    assert len(journal(path, task_id, "start")) == 1 and not journal(path, task_id, "end")


@pytest.fixture
def pulse_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """SQLite, or PostgreSQL/MariaDB for a test parametrized ``indirect`` with
    ``"postgres"``/``"mariadb"``."""
    kind = getattr(request, "param", "sqlite")
    if kind in ("postgres", "mariadb"):
        url: str = request.getfixturevalue(f"pulse_{kind}_store_url")
        return url
    return f"sqlite:///{tmp_path / 'pulse.sqlite3'}"


@pytest.mark.parametrize("pulse_store_url", ["sqlite", "postgres", "mariadb"], indirect=True)
def test_store_outage_self_fences_then_the_worker_takes_work_again(
        celery_setup: PulseTestSetup, celery_worker: PulseWorkerNode,
        files: tuple[Path, Path]) -> None:
    path, gate = files
    task_id = clustertasks.late.delay(str(path), str(gate)).id
    wait_for(lambda: journal(path, task_id, "start"), 20, "the task to start")
    with celery_setup.store_outage():
        # Nothing can renew: at its local deadline the worker gives the lease up itself.
        lost = wait_for(lambda: journal(path, task_id, "lost"), BOUND, "the task to see LeaseLost")
        assert lost[0].epoch == 1
    gate.touch()
    # The store is back: Recover re-runs the acks_late task, and new work flows.
    assert add.s(1, 1).apply_async(queue=celery_worker.worker_queue).get(timeout=60) == 2
    done = celery_setup.wait_for_claim(task_id, "succeeded", timeout=BOUND + 30)
    assert done.epoch > 1
    assert [e.epoch for e in journal(path, task_id, "end")] == [done.epoch]


def test_restart_and_warm_shutdown(celery_setup: PulseTestSetup,
                                   celery_worker: PulseWorkerNode) -> None:
    first = celery_worker.pid
    celery_worker.restart()
    assert celery_worker.pid != first and celery_worker.container.status == "running"
    assert celery_worker.logs().count(" ready.") == 2
    assert add.s(4, 4).apply_async(queue=celery_worker.worker_queue).get(timeout=30) == 8
    celery_worker.kill("SIGTERM")  # a warm shutdown deregisters the worker
    celery_worker.wait_for_log("pulse: deregistered", timeout=30)
    wait_for(lambda: celery_worker.container.status == "exited", 30, "the worker to exit")
