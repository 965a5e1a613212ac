"""Celery's request lifecycle under ``-P pulse``, with real worker processes.

Every path by which Celery ends a request ends its claim too: dropped as revoked or
expired before the pool, ``Reject(requeue=True)``, ``Task.replace``, a task id
published again, a duplicate delivery, a chord part that lost its lease. PostgreSQL
store, RabbitMQ broker, Redis result backend (for chains and chords).
"""

from __future__ import annotations

import contextlib
import datetime
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery, chain, chord

import celery_pulse
from tests.acceptance.test_leases import FAST, Claims, db, events, wait_event
from tests.helpers import services
from tests.helpers.publish import publish_raw
from tests.helpers.workers import Env, Worker, wait_for

__all__ = ["db"]  # the fixture, shared with the lease tests

#: Redis database for the result backend (task ids are unique per test: no clash).
RESULTS_DB = 7


@pytest.fixture
def results_url(redis_url: str) -> str:
    return f"{services.REDIS_URL.rsplit('/', 1)[0]}/{RESULTS_DB}"


@contextlib.contextmanager
def client(env: Env) -> Iterator[Celery]:
    """The producing side as a user has it: the same app settings, pulse installed."""
    app = Celery("pulse-lifecycle-client", broker=env.broker_url, set_as_current=False)
    app.conf.update({k: v for k, v in env.conf.items()
                     if k.startswith(("broker_", "result_", "pulse_store"))})
    app.conf.task_default_queue = env.queue
    celery_pulse.install(app)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def lifecycle_env(pg_url: str, rabbitmq_url: str, results_url: str,
                  make_env: Callable[..., Env]) -> Env:
    env: Env = make_env(pg_url, rabbitmq_url, {**FAST, "result_backend": results_url})
    return env


# -- 1. revoked or expired before the pool: the claim ends, intake goes on ---------------
def test_revoked_and_expired_tasks_end_their_claims_and_the_worker_keeps_consuming(
        lifecycle_env: Env, pg_url: str, tmp_path: Path, workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    """100 expired and 20 revoked tasks on a ``-c 2`` worker (prefetch limit 8): each
    claim ends ``revoked`` (none is left reserved and renewed), the result backend says
    REVOKED as under plain Celery, and a normal task still runs at once."""
    env = lifecycle_env
    store_db = db(pg_url)
    w = workers(env, "revoke@%h", concurrency=2).wait_ready()
    with client(env) as app:
        revoked = [uuid.uuid4().hex for _ in range(20)]
        app.control.revoke(revoked)
        for task_id in revoked:
            w.wait_log(rf"Tasks flagged as revoked: .*{task_id}", timeout=10)
        markers = [tmp_path / f"never-{i}.txt" for i in range(120)]
        past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=1)
        expired = [uuid.uuid4().hex for _ in range(100)]
        for task_id, path in zip(expired, markers[:100], strict=True):
            publish_raw(app, env.queue, "pulseapp.touch", [str(path)], task_id, task_id, past)
        for task_id, path in zip(revoked, markers[100:], strict=True):
            app.send_task("pulseapp.touch", args=[str(path)], task_id=task_id)
        dropped = expired + revoked

        def all_revoked() -> bool:
            rows = store_db.rows()
            return all(rows.get(t) is not None and rows[t].state == "revoked" for t in dropped)
        wait_for(all_revoked, 60, "every dropped task's claim to end revoked")
        after = tmp_path / "after.txt"
        sent = time.monotonic()
        app.send_task("pulseapp.touch", args=[str(after)])
        wait_for(after.exists, 10, "a normal task to run after 120 dropped ones")
        took = time.monotonic() - sent
        assert {app.AsyncResult(t).state for t in dropped[:5] + revoked[:5]} == {"REVOKED"}
    assert not any(p.exists() for p in markers)
    rows = store_db.rows()
    assert [r.task_id for r in rows.values() if r.state in ("reserved", "running")] == []
    assert all(rows[t].lease_until is None and rows[t].finished_at is not None for t in dropped)
    assert took < 10


# -- 2. Celery's requeue paths --------------------------------------------------------------
def test_reject_requeue_runs_the_task_again_under_a_new_epoch(
        lifecycle_env: Env, pg_url: str, tmp_path: Path, workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    env = lifecycle_env
    store_db = db(pg_url)
    workers(env, "reject@%h").wait_ready()
    path = tmp_path / "reject.txt"
    with client(env) as app:
        result = app.send_task("pulseapp.reject_once", args=[str(path)])
        # Requeued as Recover would (epoch 2, the message back in the queue), then granted
        # to the next delivery (epoch 3): the same publication, its second attempt.
        assert result.get(timeout=30) == 3
    # The requeued delivery says it was delivered before, as a broker's requeue does.
    assert events(path) == [["rejected", "1", "False"], ["ran", "3", "True"]]
    # The claim's completion commits just after Celery stores the result.
    wait_for(lambda: store_db.state(result.id) == "succeeded", 10, "the claim to succeed")
    row = store_db.get(result.id)
    assert (row.state, row.epoch, row.attempts) == ("succeeded", 3, 2)


def test_reject_on_worker_lost_requeues_a_task_whose_pool_process_died(
        lifecycle_env: Env, pg_url: str, tmp_path: Path, workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    """``reject_on_worker_lost`` with the pool process SIGKILLed: requeued and run again."""
    env = lifecycle_env
    store_db = db(pg_url)
    w = workers(env, "oom@%h").wait_ready()
    path = tmp_path / "oom.txt"
    with client(env) as app:
        result = app.send_task("pulseapp.die_once", args=[str(path)])
        assert result.get(timeout=30) == 3
    assert events(path) == [["killed", "1"], ["ran", "3"]]
    wait_for(lambda: store_db.state(result.id) == "succeeded", 10, "the claim to succeed")
    assert w.proc.poll() is None


def test_hard_time_limit_without_acks_on_timeout_requeues_the_task(
        lifecycle_env: Env, pg_url: str, tmp_path: Path, workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    env = lifecycle_env
    store_db = db(pg_url)
    workers(env, "limit@%h").wait_ready()
    path = tmp_path / "limit.txt"
    with client(env) as app:
        result = app.send_task("pulseapp.slow_once", args=[str(path)])
        wait_for(lambda: [e[:2] for e in events(path)] == [["start", "1"], ["start", "3"]], 30,
                 "the task to be requeued after its time limit and run again")
        # Celery stored the time limit's failure before it requeued; the second run's
        # result replaces it before the claim succeeds (the child writes it first).
        wait_for(lambda: store_db.state(result.id) == "succeeded", 10, "the claim to succeed")
        assert result.get(timeout=10) == 3
    assert store_db.get(result.id).attempts == 2


def test_revoke_with_terminate_ends_the_running_claim_revoked(
        lifecycle_env: Env, pg_url: str, tmp_path: Path, workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    env = lifecycle_env
    store_db = db(pg_url)
    w = workers(env, "term@%h").wait_ready()
    path, after = tmp_path / "term.txt", tmp_path / "after.txt"
    with client(env) as app:
        task_id = app.send_task("pulseapp.leased_sleep", args=[60, str(path)]).id
        wait_event(path, "start", 20, (w,))
        app.control.revoke(task_id, terminate=True)
        wait_for(lambda: store_db.state(task_id) == "revoked", 20, "the claim to end revoked")
        assert app.AsyncResult(task_id).state == "REVOKED"
        app.send_task("pulseapp.touch", args=[str(after)])
        wait_for(after.exists, 20, "the next task to run")
    assert store_db.get(task_id).lease_until is None


# -- 3. Task.replace --------------------------------------------------------------------------
def test_replace_in_a_chain_gives_the_chains_result(
        lifecycle_env: Env, pg_url: str, workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    env = lifecycle_env
    store_db = db(pg_url)
    workers(env, "replace@%h", concurrency=2).wait_ready()
    with client(env) as app:
        sig = chain(app.signature("pulseapp.add", (1, 2)),
                    app.signature("pulseapp.replace_add", (10,)),
                    app.signature("pulseapp.add", (100,)))
        result = sig.apply_async()
        assert result.get(timeout=30) == 113
        replaced = result.parent
        assert replaced.get(timeout=5) == 13
    wait_for(lambda: store_db.state(replaced.id) == "succeeded", 10, "the claim to succeed")
    row = store_db.get(replaced.id)
    # The replaced task and its replacement, one after the other under one id.
    assert (row.state, row.epoch) == ("succeeded", 2)


# -- 4 and 7. one publication runs once; a new publication of an id runs again ------------------
def test_one_publication_delivered_twice_runs_once(
        lifecycle_env: Env, pg_url: str, tmp_path: Path, workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    """Copies of one publication in a burst: later ones reach the worker while the first
    one's reservation is in flight (in the same batch or the next). One runs. (An
    ``acks_late`` task goes to a free pool process as soon as it is granted: a second
    grant to the same worker would run next to it.)"""
    env = lifecycle_env
    store_db = db(pg_url)
    w = workers(env, "twice@%h", concurrency=2).wait_ready()
    path = tmp_path / "twice.txt"
    task_id = uuid.uuid4().hex
    copies = 5
    with client(env) as app:
        for _ in range(copies):
            publish_raw(app, env.queue, "pulseapp.late_sleep", [0.5, str(path)], task_id, "pub-1")
    dropped = rf"duplicate delivery of pulseapp.late_sleep\[{task_id}\] dropped"
    wait_for(lambda: len(re.findall(dropped, w.log())) == copies - 1, 20,
             "every other copy to be dropped as a duplicate")
    wait_for(lambda: store_db.state(task_id) == "succeeded", 20, "the task to finish")
    assert [e[0] for e in events(path)] == ["start", "end"]
    assert store_db.get(task_id).epoch == 1


def test_two_publications_of_one_id_run_one_after_the_other(
        lifecycle_env: Env, pg_url: str, tmp_path: Path, workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    env = lifecycle_env
    store_db = db(pg_url)
    w = workers(env, "again@%h", concurrency=2).wait_ready()
    path = tmp_path / "again.txt"
    task_id = uuid.uuid4().hex
    with client(env) as app:
        # send_task stamps a fresh publication each time (pulse's before_task_publish).
        for _ in range(2):
            app.send_task("pulseapp.leased_sleep", args=[1, str(path)], task_id=task_id)

        def both_ran() -> bool:
            return [e[0] for e in events(path)] == ["start", "end", "start", "end"]
        wait_for(both_ran, 30, "both publications to run")
        wait_for(lambda: store_db.state(task_id) == "succeeded", 10, "the claim to finish")
        # A redelivery of a finished publication is still dropped.
        publish_raw(app, env.queue, "pulseapp.leased_sleep", [1, str(path)], task_id,
                    store_db.get(task_id).publication)
        w.wait_log(rf"duplicate delivery of pulseapp.leased_sleep\[{task_id}\] dropped: "
                   r"already finished", timeout=20)
    starts = [e for e in events(path) if e[0] == "start"]
    assert [s[1] for s in starts] == ["1", "2"]  # epochs
    assert len(events(path)) == 4
    assert store_db.get(task_id).epoch == 2


# -- 6. a chord part that lost its lease: the stale attempt leaves the backend alone ----------
@pytest.mark.parametrize("backend", ["redis", "pulse"])
def test_chord_completes_with_the_right_result_when_a_part_loses_its_lease(
        lifecycle_env: Env, pg_url: str, tmp_path: Path, workers: Callable[..., Worker],
        db: Callable[[str], Claims], backend: str) -> None:
    """The slow part's worker is paused past its lease; another worker re-runs the part.
    Resumed, the stale attempt gets LeaseLost: it must not write FAILURE (which would
    count the part and fail the chord) before the re-run writes the real result. With
    Celery's Redis backend and with ``pulse://`` (the chord counted in the store)."""
    env = lifecycle_env
    if backend == "pulse":
        env.conf["result_backend"] = "pulse://"
        env.conf["pulse_store_url"] = pg_url
    store_db = db(pg_url)
    stale = workers(env, "stale@%h").wait_ready()
    paths = [tmp_path / f"part-{i}.txt" for i in range(3)]
    # The pause may also catch a fast part between its body and its completion: that
    # attempt is stale too and runs again; such a re-run finishes at once.
    for fast in paths[:2]:
        Path(f"{fast}.go").touch()
    with client(env) as app:
        header = [app.signature("pulseapp.chord_part", (i, str(p), 60 if i == 2 else 0))
                  for i, p in enumerate(paths)]
        result = chord(header)(app.signature("pulseapp.total"))
        wait_event(paths[2], "start", 20, (stale,))
        slow_id = result.parent.results[2].id
        stale.signal(signal.SIGSTOP)
        wait_for(lambda: store_db.execute(
            f"SELECT lease_until <= {store_db.now} FROM pulse_claims WHERE task_id = :t",
            t=slow_id).scalar_one(), FAST["pulse_lease_ttl"] + 5, "the part's lease to expire")
        fresh = workers(env, "fresh@%h").wait_ready()
        wait_for(lambda: store_db.get(slow_id).epoch >= 2, 20, "Recover to re-dispatch the part")
        # The paused worker's consumer may hold the re-dispatched message: resume it.
        stale.signal(signal.SIGCONT)
        wait_event(paths[2], "lost", 10, (stale,))
        stale.wait_log(rf"not writing \w+ for task {slow_id} epoch 1 ", timeout=10)
        # Recover's takeover is epoch 2, the re-delivered part's grant epoch 3 (either
        # worker may run it); it finishes once told to, after the stale attempt ended.
        wait_for(lambda: [e[:2] for e in events(paths[2]) if e[0] == "start"]
                 == [["start", "1"], ["start", "3"]], 30, "the part to be re-run as epoch 3")
        Path(f"{paths[2]}.go").touch()
        assert result.get(timeout=30) == 0 + 1 + 2
        assert app.AsyncResult(slow_id).get(timeout=5) == 2
    wait_for(lambda: store_db.state(slow_id) == "succeeded", 10, "the part's claim to succeed")
    assert store_db.get(slow_id).epoch == 3
    assert fresh.proc.poll() is None
