"""Celery's own settings for a lost broker connection and a soft shutdown, under ``-P pulse``.

Each passes under plain prefork, where the broker redelivers what Celery did not
acknowledge. Under pulse the message was acknowledged at reservation, so the claim must
give the task back itself:

* ``worker_cancel_long_running_tasks_on_connection_loss``: the ``acks_late`` tasks Celery
  cancels on a connection loss run again, under a new epoch, within their budget;
* ``worker_enable_prefetch_count_reduction``: the prefetch count Celery lowers after a
  reconnect is restored as tasks are acknowledged;
* a soft shutdown (``worker_soft_shutdown_timeout``, SIGQUIT or a SIGTERM remapped to it)
  on Redis: every task, the running ones and the ETA ones held, completes after a restart.

Real ``celery worker -P pulse`` processes, PostgreSQL store; RabbitMQ on a vhost of the
test's own (its connections are cut with ``rabbitmqctl``), Redis for the soft shutdown.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.test_leases import FAST, Claims, db, events, producer
from tests.helpers.services import cut_vhost_connections
from tests.helpers.workers import Env, Worker, wait_alive

__all__ = ["db"]  # the fixture, shared with the lease tests

APP = "tests.apps.connlossapp"
LATE = "connlossapp.late_until_told"
RECORD = "connlossapp.record"
CANCEL = {"worker_cancel_long_running_tasks_on_connection_loss": True}


def app_env(make_env: Callable[..., Env], store_url: str, broker_url: str,
            conf: dict[str, Any]) -> Env:
    env: Env = make_env(store_url, broker_url, {**FAST, "pulse_recover_interval": 0.5, **conf})
    env.app = APP
    return env


def words(path: Path, word: str) -> list[list[str]]:
    return [e for e in events(path) if e[0] == word]


def states(store: Claims, ids: list[str]) -> list[str | None]:
    return [store.state(i) for i in ids]


def started(paths: list[Path], epoch_above: int = 0) -> bool:
    return all(any(int(e[1]) > epoch_above for e in words(p, "start")) for p in paths)


def inspect(env: Env, name: str, what: str) -> Any:
    """``celery inspect WHAT`` of worker ``name``, asked on a connection of its own (the
    test cuts them); None while the broker still closes the connections the test cut
    (``rabbitmqctl`` returns before the broker has closed them all)."""
    with producer(env) as app:
        try:
            answer = getattr(app.control.inspect(timeout=2, destination=[name]), what)() or {}
        except app.connection_for_write().connection_errors:
            return None
    return answer.get(name)


def prefetch_count(env: Env, name: str) -> Any:
    """The worker's ``prefetch_count`` as ``inspect stats`` reports it (Celery's
    ``consumer.qos.value``)."""
    return (inspect(env, name, "stats") or {}).get("prefetch_count")


def wait_active(env: Env, w: Worker, paths: list[Path]) -> None:
    """The tasks writing to ``paths`` started, and are among Celery's active requests
    (what Celery cancels, and what its prefetch reduction counts)."""
    name = w.wait_log(r"pulse: registered (\S+)").group(1)
    wait_alive(lambda: started(paths) and len(inspect(env, name, "active") or ()) == len(paths),
               30, "the tasks to be active", (w,), interval=0.3)


# -- 1. cancelled on connection loss: requeued under a new epoch -----------------------------
@pytest.mark.parametrize("max_attempts", [3, 1])
def test_acks_late_tasks_cancelled_on_connection_loss_run_again_within_their_budget(
        max_attempts: int, pg_url: str, rabbitmq_vhost_url: str, tmp_path: Path,
        make_env: Callable[..., Env], workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    """Two ``acks_late`` tasks run on a ``-c 2`` worker when its broker connection is cut,
    with ``worker_cancel_long_running_tasks_on_connection_loss``: Celery cancels both.
    With attempts left, each runs again under a later epoch and succeeds, once; with
    ``pulse_max_attempts = 1`` neither runs again and each claim ends ``failed`` (its
    budget spent), never revoked and forgotten."""
    env = app_env(make_env, pg_url, rabbitmq_vhost_url,
                  {**CANCEL, "pulse_max_attempts": max_attempts})
    store = db(pg_url)
    w = workers(env, "cancel@%h", concurrency=2).wait_ready()
    paths = [tmp_path / f"late-{i}.txt" for i in range(2)]
    with producer(env) as app:
        ids = [app.send_task(LATE, args=[str(p)]).id for p in paths]
    wait_active(env, w, paths)
    first = [int(words(p, "start")[0][1]) for p in paths]
    cut_vhost_connections(rabbitmq_vhost_url, "pulse test: connection loss")
    w.wait_log(r"cannot be acknowledged after a connection loss")
    if max_attempts > 1:
        wait_alive(lambda: all(started([p], e) for p, e in zip(paths, first, strict=True)),
                   30, "both tasks to start again", (w,))
        for p in paths:  # the second run finishes
            Path(f"{p}.go").touch()
        wait_alive(lambda: states(store, ids) == ["succeeded"] * 2, 30,
                   "both tasks to succeed", (w,))
    else:
        wait_alive(lambda: states(store, ids) == ["failed"] * 2, 30,
                   "both claims to end failed, their budget spent", (w,))
    for task_id, p in zip(ids, paths, strict=True):
        row = store.get(task_id)
        starts, ends = words(p, "start"), words(p, "end")
        if max_attempts > 1:
            assert (row.state, row.attempts) == ("succeeded", 2), (row, events(p))
            assert len(starts) == 2 and int(starts[1][1]) > int(starts[0][1]), events(p)
            assert ends == [["end", starts[1][1]]], events(p)  # the cancelled run never ended
        else:
            assert (row.state, row.attempts) == ("failed", 1), (row, events(p))
            assert len(starts) == 1, events(p)


# -- 2. the prefetch count Celery lowers after a reconnect comes back -------------------------
def test_the_prefetch_count_reduced_after_a_reconnect_is_restored_as_tasks_are_acknowledged(
        pg_url: str, rabbitmq_vhost_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    """``worker_enable_prefetch_count_reduction`` (Celery's default): a ``-c 2`` worker
    (prefetch 2 x 4 = 8) loses its broker connection while two tasks run; Celery lowers
    the count to 4 (8 less 4 per running task, at least 4). Celery raises it again as
    the requests it receives after the reconnect are acknowledged: pulse, which
    acknowledges the broker itself, must too. Observed as Celery reports it
    (``inspect stats``: ``prefetch_count``, the consumer's ``qos.value``)."""
    env = app_env(make_env, pg_url, rabbitmq_vhost_url, {})
    store = db(pg_url)
    w = workers(env, "prefetch@%h", concurrency=2).wait_ready()
    paths = [tmp_path / f"late-{i}.txt" for i in range(2)]
    name = w.wait_log(r"pulse: registered (\S+)").group(1)
    assert prefetch_count(env, name) == 8
    with producer(env) as app:
        ids = [app.send_task(LATE, args=[str(p)]).id for p in paths]
    wait_active(env, w, paths)
    cut_vhost_connections(rabbitmq_vhost_url, "pulse test: reconnect")
    w.wait_log(r"Temporarily reducing the prefetch count to 4")
    wait_alive(lambda: prefetch_count(env, name) == 4, 30,
               "the reduced prefetch count after the reconnect", (w,), interval=0.3)
    for p in paths:
        Path(f"{p}.go").touch()
    after = [tmp_path / f"after-{i}.txt" for i in range(2)]
    with producer(env) as app:
        ids += [app.send_task(RECORD, args=[str(p)]).id for p in after]
    wait_alive(lambda: states(store, ids) == ["succeeded"] * 4, 30, "every task to succeed",
               (w,))
    wait_alive(lambda: prefetch_count(env, name) == 8, 10, "the prefetch count to be restored",
               (w,), interval=0.3)
    w.wait_log(r"Prefetch count has been restored to the maximum of 8")


# -- 3. a soft shutdown on Redis loses nothing -------------------------------------------------
@pytest.mark.parametrize("how", ["SIGQUIT", "SIGTERM remapped to SIGQUIT"])
def test_a_soft_shutdown_on_redis_loses_nothing_and_every_task_runs_after_the_restart(
        how: str, pg_url: str, redis_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    """A ``-c 2`` worker on Redis with ``worker_soft_shutdown_timeout`` runs two
    ``acks_late`` tasks and holds two ETA tasks when it gets a cold shutdown (SIGQUIT, or
    SIGTERM under ``REMAP_SIGTERM=SIGQUIT``): Celery waits out the soft timeout, then
    cancels the running tasks. After a new worker starts, every task completes, each
    once, the running ones under a later epoch."""
    env = app_env(make_env, pg_url, redis_url, {"worker_soft_shutdown_timeout": 1})
    store = db(pg_url)
    sig, extra = ((signal.SIGQUIT, {}) if how == "SIGQUIT"
                  else (signal.SIGTERM, {"REMAP_SIGTERM": "SIGQUIT"}))
    w = workers(env, "soft@%h", concurrency=2, extra_env=extra).wait_ready()
    running = [tmp_path / f"late-{i}.txt" for i in range(2)]
    scheduled = [tmp_path / f"eta-{i}.txt" for i in range(2)]
    with producer(env) as app:
        ids = [app.send_task(LATE, args=[str(p)]).id for p in running]
        ids += [app.send_task(RECORD, args=[str(p)], countdown=8).id for p in scheduled]
    wait_active(env, w, running)
    wait_alive(lambda: states(store, ids[2:]) == ["reserved"] * 2, 30,
               "the ETA tasks to be reserved", (w,))
    w.signal_main(sig)
    w.wait_log(r"Initiating Soft Shutdown")
    w.wait(30)
    for p in running:
        Path(f"{p}.go").touch()
    again = workers(env, "soft-again@%h", concurrency=2).wait_ready()
    wait_alive(lambda: states(store, ids) == ["succeeded"] * 4, 40, "every task to complete",
               (again,))
    for p in running:
        starts = words(p, "start")
        assert len(starts) == 2 and int(starts[1][1]) > int(starts[0][1]), events(p)
        assert words(p, "end") == [["end", starts[1][1]]], events(p)
    for p in scheduled:
        assert len(words(p, "end")) == 1, events(p)
