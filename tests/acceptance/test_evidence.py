"""A stale attempt's late outcome is kept in ``pulse_evidence`` (DESIGN: evidence only).

Real ``celery worker -P pulse`` processes on PostgreSQL and RabbitMQ. Worker ``a`` runs a
body that ends on its own after two seconds; its main process alone is paused (SIGSTOP)
while the body runs, past the lease and one Recover scan of worker ``b``: the claim goes
to review (``acks_late=False``) or is re-dispatched under a new epoch (``acks_late=True``).
Resumed, ``a`` finds the body's result waiting for it, for a lease the store has moved
on from (or that ``a``'s own watchdog declared lost first: either order must keep it):
the result is kept as evidence at the old epoch, and the claim is not changed by it.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_pulse.store.sql.tables import claims, evidence
from tests.helpers.workers import Env, Worker, wait_alive, wait_for

FAST: dict[str, Any] = {"pulse_lease_ttl": 3, "pulse_renew_interval": 0.5,
                        "pulse_recover_interval": 0.5, "pulse_worker_ttl": 3,
                        "pulse_heartbeat_interval": 0.5, "pulse_revoke_grace": 2}
#: Lease, a Recover scan, and a worker's start on a busy machine.
BOUND = FAST["pulse_lease_ttl"] + FAST["pulse_recover_interval"] + 20


@pytest.fixture
def engine(pg_url: str) -> Iterator[sa.Engine]:
    made = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    yield made
    made.dispose()


def _claim(engine: sa.Engine, task_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(claims.c.state, claims.c.epoch, claims.c.holder)
                            .where(claims.c.task_id == task_id)).one_or_none()


def _evidence(engine: sa.Engine, task_id: str) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(evidence).where(evidence.c.task_id == task_id)))


def _started(path: Path) -> bool:
    return path.exists() and path.read_text().startswith("start")


@pytest.mark.parametrize("task, moved", [
    ("pulseapp.charge", lambda c: c.state == "needs_review"),
    # Re-dispatched (the broker may hand the new delivery to the paused worker's window).
    ("pulseapp.late_charge", lambda c: c.epoch >= 2),
], ids=["review", "redispatch"])
def test_late_success_of_a_paused_worker_is_kept_as_evidence_with_its_result(
        task: str, moved: Callable[[Any], bool], pg_url: str, rabbitmq_url: str,
        tmp_path: Path, make_env: Callable[..., Env], workers: Callable[..., Worker],
        engine: sa.Engine) -> None:
    env = make_env(pg_url, rabbitmq_url, FAST)
    a = workers(env, "paused@%h").wait_ready()
    path, value = tmp_path / "charge.txt", f"charged-{uuid.uuid4().hex[:8]}"
    app = Celery("evidence-client", broker=env.broker_url, set_as_current=False)
    try:
        task_id = app.send_task(task, args=[str(path), 2.0, value], queue=env.queue).id
    finally:
        app.close()
    wait_alive(lambda: _started(path), 20, "the body to start on a", (a,))
    a.signal_main(signal.SIGSTOP)  # the main process only: the body runs on to its end
    try:
        b = workers(env, "recover@%h").wait_ready()
        wait_alive(lambda: (c := _claim(engine, task_id)) is not None and moved(c), BOUND,
                   "Recover to move the claim on from the paused worker", (b,))
        assert "end" in path.read_text().split()  # a's body ended while a was paused
        assert _evidence(engine, task_id) == []
    finally:
        a.signal_main(signal.SIGCONT)
    rows = wait_for(lambda: _evidence(engine, task_id), 20,
                    "a's late result in pulse_evidence")
    assert [(r.epoch, r.outcome, r.error, r.result) for r in rows] == [
        (1, "succeeded", None, repr(value))], rows
    assert rows[0].holder.startswith("paused@")
    after = _claim(engine, task_id)  # the late outcome changed nothing of the claim
    assert moved(after) and after.epoch >= 2, after
    assert a.proc.poll() is None
