"""The example's guarantees, checked on real ``-P pulse`` workers through pytest-celery.

The test process talks to the workers through ``celery_setup.app`` (the test's
broker and backend); the workers run :mod:`example_project.app`. The ledger and
reports tables live in the store's database (a SQLite file of the test's own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from celery.result import AsyncResult

from celery_pulse.contrib.pytest_celery import PulseTestSetup, PulseWorkerNode
from example_project.schema import engine_for, ledger, reports


def send(setup: PulseTestSetup, task: str, *args: Any) -> AsyncResult:
    return setup.app.send_task(f"example_project.tasks.{task}", args=args)


def rows(setup: PulseTestSetup, table: sa.Table, **where: Any) -> list[Any]:
    with engine_for(setup.store_url).connect() as conn:
        query = sa.select(table).where(*(table.c[k] == v for k, v in where.items()))
        return list(conn.execute(query).all())


def test_a_charge_writes_one_ledger_row_under_its_lease(celery_setup: PulseTestSetup) -> None:
    result = send(celery_setup, "charge", "order-1", 1250, 0.1)
    assert result.get(timeout=30)["epoch"] == 1
    (row,) = rows(celery_setup, ledger, order_id="order-1")
    assert (row.task_id, row.epoch, row.worker) == (result.id, 1, celery_setup.worker.hostname())


def test_a_charge_that_lost_its_lease_goes_to_review_and_writes_nothing(
        celery_setup: PulseTestSetup, celery_worker: PulseWorkerNode) -> None:
    result = send(celery_setup, "charge", "order-2", 990, 30.0)  # a slow provider call
    celery_setup.wait_for_claim(result.id, "running")
    celery_setup.expire_lease(result.id)  # as if the worker had stopped renewing
    celery_worker.assert_log_exists(f"[{result.id}] lost its lease: was held by", timeout=10)
    celery_setup.wait_for_claim(result.id, "needs_review")
    assert rows(celery_setup, ledger, order_id="order-2") == []


def test_the_report_of_a_killed_worker_is_rebuilt_on_another(
        celery_setup: PulseTestSetup,
        pulse_worker_node_factory: Callable[..., PulseWorkerNode]) -> None:
    result = send(celery_setup, "build_report", "q4", 30, 0.1)
    assert celery_setup.wait_for_claim(result.id, "running").holder == celery_setup.worker.hostname()
    # SIGKILL, pool included: the report is lost mid-way (killed before the other worker
    # starts, which may take longer than the report's 3 s on a loaded machine).
    celery_setup.worker.kill()
    other = pulse_worker_node_factory()  # joins the cluster on the same queue

    report = result.get(timeout=60)  # Recover re-dispatches it (acks_late)
    assert (report["sections"], report["epoch"]) == (30, 3)
    (row,) = rows(celery_setup, reports, name="q4")
    assert (row.epoch, row.worker) == (3, other.hostname())
