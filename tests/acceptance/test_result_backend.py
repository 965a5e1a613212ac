"""``result_backend = "pulse://"`` with real ``celery worker -P pulse`` processes.

A -P pulse worker's pool children write no results: the parent writes each one with
the task's completion, fenced by the store. Chord parts are written by the child (Celery
counts them there), guarded by the lease.
"""

from __future__ import annotations

import contextlib
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery, chord, group
from celery.result import GroupResult

import celery_pulse
from celery_pulse.store.base import ResultRecord
from tests.acceptance.test_leases import Claims, db, events, wait_event
from tests.helpers.workers import Env, Worker, wait_for

__all__ = ["db"]

#: Renewals far apart: a takeover made in the store stays unnoticed by the holder for
#: long enough that only the store's fence can refuse its completion.
SLOW_RENEWAL: dict[str, Any] = {"pulse_lease_ttl": 60, "pulse_renew_interval": 20,
                                "pulse_worker_ttl": 30, "pulse_heartbeat_interval": 2}


@contextlib.contextmanager
def client(env: Env) -> Iterator[Celery]:
    """A user's client: the app's settings, ``pulse://`` results from the same store."""
    app = Celery("pulse-results-client", broker=env.broker_url, backend="pulse://",
                 set_as_current=False)
    app.conf.update({k: v for k, v in env.conf.items() if k.startswith(("broker_", "result_"))})
    app.conf.update(task_default_queue=env.queue, pulse_store_url=env.store_url)
    celery_pulse.install(app)
    try:
        yield app
    finally:
        app.close()


def results_written_by(store_url: str) -> set[str]:
    """Keys in the results table."""
    engine = sa.create_engine(store_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return set(conn.execute(sa.text("SELECT key FROM pulse_results")).scalars())
    finally:
        engine.dispose()


def test_results_groups_and_chords(stack: tuple[str, str, dict[str, Any]],
                                   make_env: Callable[..., Env],
                                   workers: Callable[..., Worker]) -> None:
    """What a Celery user does with results, on the embedded default and on PostgreSQL
    + RabbitMQ: get, the extended fields, failures with their traceback, groups, a
    chord, forget."""
    store_url, broker_url, conf = stack
    env = make_env(store_url, broker_url, {**conf, "result_backend": "pulse://",
                                           "result_extended": True})
    w = workers(env, "results@%h", concurrency=2).wait_ready()
    with client(env) as app:
        added = app.send_task("pulseapp.add", (2, 3))
        assert added.get(timeout=30) == 5
        assert (added.name, added.args, added.worker) == ("pulseapp.add", [2, 3], w.name
                                                          .replace("%h", socket.gethostname()))
        failed = app.send_task("pulseapp.fail", ("boom",))
        with pytest.raises(ValueError, match="boom"):
            failed.get(timeout=30)
        assert failed.state == "FAILURE"
        assert "ValueError: boom" in (failed.traceback or "")
        parts = group(app.signature("pulseapp.add", (i, i)) for i in range(10)).apply_async()
        assert parts.get(timeout=30) == [2 * i for i in range(10)]
        joined = chord(app.signature("pulseapp.add", (i, 1)) for i in range(5))(
            app.signature("pulseapp.total"))
        assert joined.get(timeout=30) == sum(i + 1 for i in range(5))
        # Counted with the parts' completions, finished by the worker's parent.
        w.wait_log(rf"chord {joined.parent.id} complete \(5 parts\): callback published", 10)
        done = app.send_task("pulseapp.add", (1, 1))
        assert done.get(timeout=30) == 2
        done.forget()
        assert app.AsyncResult(done.id).state == "PENDING"


def test_a_completion_the_store_refuses_writes_no_result(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    """The lease is taken over in the store while the body runs, and the holder has not
    noticed yet (its next renewal is far off): the body finishes, the parent sends the
    completion with the result, the store refuses it. The outcome is only evidence."""
    env = make_env(pg_url, rabbitmq_url, {**SLOW_RENEWAL, "result_backend": "pulse://"})
    store_db = db(pg_url)
    w = workers(env, "fenced@%h").wait_ready()
    path = tmp_path / "fenced.txt"
    with client(env) as app:
        result = app.send_task("pulseapp.epoch_when_told", (str(path),))
        wait_event(path, "start", 20, (w,))
        # What a takeover does to the row: a new epoch and token (Recover's, or another
        # worker's grant), the lease still live.
        store_db.execute("UPDATE pulse_claims SET epoch = epoch + 1, token = 'taken-over' "
                         "WHERE task_id = :t", t=result.id)
        Path(f"{path}.go").touch()
        wait_event(path, "end", 20, (w,))
        w.wait_log(rf"late outcome 'succeeded' for task {result.id} epoch 1 kept as evidence",
                   timeout=20)
        assert app.AsyncResult(result.id).state == "PENDING"
    evidence = store_db.execute("SELECT epoch, outcome FROM pulse_evidence WHERE task_id = :t",
                                t=result.id).all()
    assert [tuple(r) for r in evidence] == [(1, "succeeded")]
    assert not any(result.id in key for key in results_written_by(pg_url))
    assert events(path) == [["start", "1", str(events(path)[0][2])], ["end", "1"]]


def test_the_pool_children_write_no_results(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """Each result is written by the worker's parent with its completion: after 50 tasks
    no pool process has opened the store (each child answers for itself)."""
    env = make_env(pg_url, rabbitmq_url, {"result_backend": "pulse://"})
    workers(env, "parent-writes@%h", concurrency=2).wait_ready()
    with client(env) as app:
        results = [app.send_task("pulseapp.add", (i, i)) for i in range(50)]
        assert [r.get(timeout=30) for r in results] == [2 * i for i in range(50)]
        # Two at once, each holding its process until both run: one answer per child.
        folder = tmp_path / "probes"
        folder.mkdir()
        probes = group(app.signature("pulseapp.store_opened_here", (str(folder), 2))
                       for _ in range(2)).apply_async()
        answers = probes.get(timeout=30)
    assert len({pid for pid, _ in answers}) == 2
    assert [opened for _, opened in answers] == [False, False]


def test_a_backend_on_a_store_of_its_own_gets_the_results(
        pg_url: str, rabbitmq_url: str, sqlite_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """``pulse+<another store>`` (the docs' "a store of its own"): the claims are in one
    store, the results in the other. The completion can't carry a result to another
    database, so the pool child writes it there itself, as with any backend."""
    make_env(sqlite_url, "memory://")  # migrates the results' store
    backend = "pulse+" + sqlite_url
    env = make_env(pg_url, rabbitmq_url, {"result_backend": backend})
    workers(env, "own-store@%h", concurrency=2).wait_ready()
    app = Celery("pulse-results-client", broker=env.broker_url, backend=backend,
                 set_as_current=False)
    app.conf.update(task_default_queue=env.queue)
    try:
        results = [app.send_task("pulseapp.add", (i, i)) for i in range(5)]
        assert [r.get(timeout=30) for r in results] == [2 * i for i in range(5)]
        failed = app.send_task("pulseapp.fail", ("boom",))
        with pytest.raises(ValueError, match="boom"):
            failed.get(timeout=30)
    finally:
        app.close()
    ids = {r.id for r in [*results, failed]}
    assert {k for k in results_written_by(sqlite_url) if any(i in k for i in ids)}
    assert not {k for k in results_written_by(pg_url) if any(i in k for i in ids)}


def test_a_chord_counts_each_part_once_and_runs_its_callback_once(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    """40 parts on two ``-c 2`` workers: the callback sees every part's result and runs
    once; the count is in the store, not polled (no ``celery.chord_unlock`` task)."""
    env = make_env(pg_url, rabbitmq_url, {"result_backend": "pulse://"})
    store_db = db(pg_url)
    a = workers(env, "chord-a@%h", concurrency=2).wait_ready()
    b = workers(env, "chord-b@%h", concurrency=2).wait_ready()
    path = tmp_path / "callback.txt"
    with client(env) as app:
        joined = chord(app.signature("pulseapp.add", (i, i)) for i in range(40))(
            app.signature("pulseapp.record_total", kwargs={"path": str(path)}))
        assert joined.get(timeout=60) == sum(2 * i for i in range(40))
    assert [e[:2] for e in events(path)] == [["total", str(sum(2 * i for i in range(40)))]]
    finished = rf"chord {joined.parent.id} complete \(40 parts\)"
    # Logged by the finishing thread after the publish: the callback may be done first.
    wait_for(lambda: re.search(finished, a.log() + b.log()), 10, "the chord's finish log")
    logs = a.log() + b.log()
    assert len(re.findall(finished, logs)) == 1
    assert "chord_unlock" not in logs
    assert store_db.get(joined.id).epoch == 1
    # The chord's counter and saved group are gone once the callback is out.
    keys = results_written_by(pg_url)
    assert not [k for k in keys if joined.parent.id in k]


def test_the_leader_finishes_a_chord_whose_counting_worker_died(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """A worker counted a chord's last part, published its callback and died before it
    could clear the count: the store holds a whole count, the callback kept with it. The
    leader's sweep publishes the callback again; the same publication, it runs once."""
    env = make_env(pg_url, rabbitmq_url, {"result_backend": "pulse://", "pulse_beat": False})
    path = tmp_path / "callback.txt"
    with client(env) as app:
        backend = app.backend
        members = [app.AsyncResult(uuid.uuid4().hex) for _ in range(3)]
        for i, member in enumerate(members):
            backend.mark_as_done(member.id, i + 1)
        group_id = uuid.uuid4().hex
        GroupResult(group_id, members, app=app).save(backend=backend)
        callback = app.signature("pulseapp.record_total", kwargs={"path": str(path)},
                                 queue=env.queue)
        callback.freeze()
        note = backend.encode({"group": group_id, "chord": dict(callback)})
        record = ResultRecord("unused", None, "SUCCESS", None, "SUCCESS",
                              counter=backend.get_key_for_chord(group_id),
                              counter_note=note.encode() if isinstance(note, str) else note)
        rows = backend.rows
        with rows.engine.begin() as conn:
            counted = rows.count_parts(conn, [(m.id, record) for m in members])
            conn.execute(sa.text(f"UPDATE pulse_results SET updated_at = {rows.dialect.clock}"
                                 f" - 600 WHERE key = :k"), {"k": record.counter})
        assert sorted(count for count, _ in counted.values()) == [1, 2, 3]
        (nonce,) = {nonce for _, nonce in counted.values()}
        # What the dead worker published: the callback, as its chord's publication.
        callback.clone(args=([1, 2, 3],)).apply_async(
            headers={"pulse_pub_fixed": f"chord:{group_id}:{nonce}"})
        w = workers(env, "leader@%h").wait_ready()
        assert app.AsyncResult(callback.id).get(timeout=30) == 6
        w.wait_log(r"published the callback of 1 chord\(s\) whose last part's worker did not")
        w.wait_log(rf"duplicate delivery of pulseapp.record_total\[{callback.id}\] dropped")
        assert not [k for k in results_written_by(pg_url) if group_id in k]
    assert [e[:2] for e in events(path)] == [["total", "6"]]
