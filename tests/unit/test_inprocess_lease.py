"""Tasks run in-process (eager, ``.apply()``, direct calls, other pools) get a lease that holds.

Real SQLite databases for ``fenced(conn)``; Celery's own eager tracer and its
in-process test worker (``celery.contrib.testing``), no mocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.contrib.testing.worker import start_worker
from sqlalchemy.orm import Session

import celery_pulse
from celery_pulse import InProcessLease, InvalidConfig, current_lease

rows = sa.Table("rows", sa.MetaData(), sa.Column("value", sa.String(32), primary_key=True))


@pytest.fixture
def engine(tmp_path: Path) -> sa.Engine:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'side-effects.sqlite3'}")
    rows.metadata.create_all(engine)
    return engine


@pytest.fixture
def app(tmp_path: Path, engine: sa.Engine) -> Celery:
    app = Celery("inprocess", set_as_current=False)
    app.conf.update(broker_url="memory://", result_backend="cache+memory://",
                    pulse_store_url=f"sqlite:///{tmp_path / 'pulse.sqlite3'}")
    celery_pulse.install(app)

    @app.task(name="inprocess.quickstart", shared=False)
    def quickstart() -> str:
        lease = current_lease()
        assert lease is not None
        lease.check()  # the README's quick start
        return repr(lease)

    @app.task(name="inprocess.write", shared=False, bind=True)
    def write(self: Any, value: str, fail: bool = False) -> list[Any]:
        lease = current_lease()
        assert lease is not None
        with engine.connect() as conn, lease.fenced(conn):
            conn.execute(sa.insert(rows).values(value=value))
            if fail:
                raise RuntimeError("rolled back")
        return [lease.task_id, lease.epoch, self.request.id]

    @app.task(name="inprocess.write_session", shared=False)
    def write_session(value: str) -> None:
        lease = current_lease()
        assert lease is not None
        with Session(engine) as session, lease.fenced(session):
            session.execute(sa.insert(rows).values(value=value))

    @app.task(name="inprocess.nested_transaction", shared=False)
    def nested_transaction() -> None:
        lease = current_lease()
        assert lease is not None
        with engine.connect() as conn:
            conn.execute(sa.select(1))  # autobegins a transaction
            with lease.fenced(conn):
                pass

    @app.task(name="inprocess.walk", shared=False)
    def walk(value: Any) -> list[Any]:
        lease = current_lease()
        assert lease is not None
        with engine.connect() as conn, lease.fenced(conn):  # as a pulse worker allows
            lease.checkpoint(value)
        lease.checkpoint(value, wait=True)
        return [lease.last_checkpoint, lease.checkpoint_seq]

    return app


def stored(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(sa.select(rows.c.value)).scalars())


def test_checkpoints_in_process_are_checked_then_kept_nowhere(app: Celery) -> None:
    """Code written for a pulse worker runs unchanged: its checkpoints are checked (JSON,
    the size limit) as a worker checks them; no later attempt reads them."""
    result = app.tasks["inprocess.walk"].apply(args=[{"next": 50}])
    assert result.get() == [None, 2]
    too_large = app.tasks["inprocess.walk"].apply(args=["x" * 70_000])
    assert isinstance(too_large.result, celery_pulse.CheckpointTooLarge)
    not_json = app.tasks["inprocess.walk"].apply(args=[{"when": object()}])
    assert isinstance(not_json.result, TypeError)


def test_a_lease_without_a_checkpointer_says_why_checkpoints_are_refused() -> None:
    """A gateway worker's lease: no SQL store in its pool processes."""
    lease = celery_pulse.Lease("t", 1, "k", "w@h", read_deadline=lambda: (1e18, False),
                               fencer=lambda *_: None, initial_deadline=1e18)  # type: ignore
    with pytest.raises(celery_pulse.PulseError, match="gateway worker cannot carry them"):
        lease.checkpoint({"next": 1})
    with pytest.raises(celery_pulse.PulseError, match="gateway worker cannot carry them"):
        _ = lease.last_checkpoint  # not None: an earlier attempt elsewhere may have one


def test_outside_any_task_there_is_no_lease() -> None:
    assert current_lease() is None


def test_apply_runs_the_quickstart_task_under_a_lease_that_holds(app: Celery) -> None:
    result = app.tasks["inprocess.quickstart"].apply()
    assert result.successful(), result.traceback
    assert "always held" in result.get()
    assert current_lease() is None  # the task ended: nothing leaks out of it


def test_task_always_eager_runs_the_quickstart_task(app: Celery) -> None:
    app.conf.task_always_eager = True
    result = app.tasks["inprocess.quickstart"].delay()
    assert result.successful(), result.traceback


def test_a_direct_call_gets_a_lease_too(app: Celery) -> None:
    assert "always held" in app.tasks["inprocess.quickstart"]()


def test_fenced_commits_on_a_connection(app: Celery, engine: sa.Engine) -> None:
    result = app.tasks["inprocess.write"].apply(("a",), task_id="t-1")
    assert result.successful(), result.traceback
    assert result.get() == ["t-1", 0, "t-1"]  # the request's id; epoch 0: no store granted it
    assert stored(engine) == ["a"]


def test_fenced_rolls_back_when_the_block_raises(app: Celery, engine: sa.Engine) -> None:
    result = app.tasks["inprocess.write"].apply(("b",), {"fail": True})
    assert result.failed()
    assert isinstance(result.result, RuntimeError)
    assert stored(engine) == []


def test_fenced_commits_on_a_session(app: Celery, engine: sa.Engine) -> None:
    result = app.tasks["inprocess.write_session"].apply(("c",))
    assert result.successful(), result.traceback
    assert stored(engine) == ["c"]


def test_fenced_refuses_what_the_real_fence_refuses(app: Celery) -> None:
    result = app.tasks["inprocess.nested_transaction"].apply()
    assert isinstance(result.result, InvalidConfig)
    assert "already in a transaction" in str(result.result)
    lease = InProcessLease("t", "here")
    with pytest.raises(InvalidConfig, match="Connection or Session"), lease.fenced(object()):
        pass


def test_a_worker_of_another_pool_gives_its_tasks_a_lease(app: Celery, engine: sa.Engine) -> None:
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False,
                      loglevel="WARNING", shutdown_timeout=10):
        result = app.tasks["inprocess.write"].delay("d")
        task_id, epoch, request_id = result.get(timeout=20)
    assert (task_id, epoch) == (request_id, 0)
    assert stored(engine) == ["d"]
