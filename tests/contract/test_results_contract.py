"""The ``pulse://`` result backend on every SQL store: Celery's key-value contract.

Each test drives a real Celery app whose ``result_backend`` is ``pulse+<store url>``
against a fresh, migrated store (SQLite, PostgreSQL, MariaDB). SQL only (``sql_store``):
the backend is a table of the SQL store, reached by its URL; the memory store has no URL
and no backend (it keeps the fenced results a completion writes, for the mechanism's
unit tests).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, states
from celery.exceptions import ImproperlyConfigured
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, GroupResult

from celery_pulse.backend import PulseBackend
from celery_pulse.errors import SchemaMissing
from celery_pulse.store.base import FAILED, SUCCEEDED, Completion, ResultRecord
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.sql.results import ResultRows
from celery_pulse.testing import wait_for
from tests.contract.test_claims_contract import TTL, W1, W2, grant, key, request


def _app(url: str, **conf: Any) -> Celery:
    app = Celery("results-contract", broker="memory://", backend=url, set_as_current=False)
    app.conf.update(conf)
    return app


@pytest.fixture
def backend(sql_store: SqlStore, store_url: str) -> Iterator[PulseBackend]:
    app = _app("pulse+" + store_url, result_expires=3600)
    backend: PulseBackend = app.backend
    yield backend
    backend.rows.engine.dispose()


def _meta(backend: PulseBackend, task_id: str) -> dict[str, Any]:
    meta: dict[str, Any] = backend.get_task_meta(task_id, cache=False)
    return meta


def test_celery_resolves_pulse_urls(store_url: str) -> None:
    assert type(_app("pulse+" + store_url).backend) is PulseBackend
    app = _app("pulse://", pulse_store_url=store_url)
    assert isinstance(app.backend, PulseBackend)
    assert app.backend.store_url == store_url
    assert app.backend.as_uri() == "pulse://"


def test_a_url_that_names_no_store_fails_naming_the_setting() -> None:
    with pytest.raises(ImproperlyConfigured, match="result_backend"):
        _app("pulse+redis://localhost/0").backend  # noqa: B018


def test_success_failure_and_traceback_round_trip(backend: PulseBackend) -> None:
    backend.mark_as_done("ok", {"answer": 42})
    assert _meta(backend, "ok")["status"] == states.SUCCESS
    assert AsyncResult("ok", backend=backend).get(timeout=5) == {"answer": 42}
    try:
        raise KeyError("boom")
    except KeyError as exc:
        backend.mark_as_failure("bad", exc, traceback="Traceback: boom")
    result = AsyncResult("bad", backend=backend)
    assert result.state == states.FAILURE
    assert isinstance(result.info, KeyError)
    assert result.traceback == "Traceback: boom"
    assert _meta(backend, "never-ran")["status"] == states.PENDING


def test_a_success_is_final(backend: PulseBackend) -> None:
    backend.mark_as_started("t")
    backend.mark_as_done("t", 1)
    backend.mark_as_failure("t", RuntimeError("a stale attempt"))
    backend.mark_as_retry("t", RuntimeError("a duplicate"))
    backend.store_result("t", 2, states.SUCCESS)
    meta = _meta(backend, "t")
    assert (meta["status"], meta["result"]) == (states.SUCCESS, 1)


def test_states_before_success_are_replaced(backend: PulseBackend) -> None:
    backend.mark_as_started("t", meta={"pid": 1})
    assert _meta(backend, "t")["status"] == states.STARTED
    backend.mark_as_retry("t", RuntimeError("again"))
    assert _meta(backend, "t")["status"] == states.RETRY
    backend.mark_as_done("t", "finally")
    assert _meta(backend, "t")["result"] == "finally"


def test_forget_and_get_many(backend: PulseBackend) -> None:
    for i in range(5):
        backend.mark_as_done(f"m{i}", i)
    got = dict(backend.get_many([f"m{i}" for i in range(5)], timeout=5))
    assert {k: v["result"] for k, v in got.items()} == {f"m{i}": i for i in range(5)}
    AsyncResult("m0", backend=backend).forget()
    assert _meta(backend, "m0")["status"] == states.PENDING


def test_groups_save_restore_delete(backend: PulseBackend) -> None:
    app = backend.app
    members = [AsyncResult(f"g{i}", app=app) for i in range(3)]
    for i in range(3):
        backend.mark_as_done(f"g{i}", i * 10)
    group = GroupResult("group-1", members, app=app)
    group.save(backend=backend)
    restored = GroupResult.restore("group-1", app=app, backend=backend)
    assert restored is not None
    assert [r.id for r in restored.results] == ["g0", "g1", "g2"]
    assert restored.join(timeout=5) == [0, 10, 20]
    restored.delete(backend=backend)
    assert GroupResult.restore("group-1", app=app, backend=backend) is None


def test_incr_counts_every_call_once_under_concurrency(backend: PulseBackend) -> None:
    seen: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def part() -> None:
        try:
            for _ in range(10):
                value = backend.incr("chord-unlock-c1")
                with lock:
                    seen.append(value)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=part) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert sorted(seen) == list(range(1, 41))


def test_expired_rows_read_as_absent_and_are_purged(backend: PulseBackend,
                                                    sql_store: SqlStore) -> None:
    backend.mark_as_done("old", 1)
    backend.mark_as_done("fresh", 2)
    backend.expire(backend.get_key_for_task("old"), 0.001)
    rows = ResultRows(sql_store.engine)

    def expired() -> bool:
        return _meta(backend, "old")["status"] == states.PENDING

    wait_for(expired, timeout=5, what="the expired result to read as absent")
    # An expired success is not final: the task id may run again.
    backend.mark_as_failure("old", RuntimeError("a new publication"))
    assert _meta(backend, "old")["status"] == states.FAILURE
    backend.expire(backend.get_key_for_task("old"), 0.001)
    wait_for(expired, timeout=5, what="the expired result to read as absent")
    sql_store.purge_finished(older_than=3600)
    assert rows.get(backend.get_key_for_task("old")) is None
    assert rows.mget([backend.get_key_for_task("old")]) == [None]
    assert _meta(backend, "fresh")["result"] == 2
    # The purge deleted the row: an expired counter starts again at 1 either way.
    backend.incr("chord-unlock-x")
    backend.expire("chord-unlock-x", 0.001)
    wait_for(lambda: rows.counter("chord-unlock-x") is None, timeout=5,
             what="the expired counter to read as absent")
    assert backend.incr("chord-unlock-x") == 1


def test_a_store_without_the_schema_says_to_migrate(store_url: str) -> None:
    backend = _app("pulse+" + store_url).backend
    with pytest.raises(SchemaMissing, match="pulse migrate"):
        backend.get_task_meta("t", cache=False)


# -- results written by a fenced completion (what a -P pulse worker sends) ----------------
def _record(backend: PulseBackend, task_id: str, result: Any, state: str = states.SUCCESS
            ) -> ResultRecord:
    meta = {"status": state, "result": result, "traceback": None, "children": [],
            "date_done": None, "task_id": task_id}
    encoded = backend.encode(meta)
    return ResultRecord(backend.get_key_for_task(task_id),
                        encoded.encode() if isinstance(encoded, str) else encoded,
                        state, 3600.0, states.SUCCESS)


@pytest.mark.parametrize("via", ["exchange", "complete"])
def test_a_completion_writes_its_result_only_if_it_applies(
        backend: PulseBackend, sql_store: SqlStore, via: str) -> None:
    live = grant(sql_store, W1, request())
    stale = grant(sql_store, W1, request())
    sql_store.release(W1, [key(stale)])
    grant(sql_store, W2, request(stale.task_id))  # taken over: W1's attempt is stale
    plain = grant(sql_store, W1, request())  # a completion without a result
    completions = [
        Completion(live.task_id, live.epoch, live.token, SUCCEEDED, None,
                   _record(backend, live.task_id, "live")),
        Completion(stale.task_id, stale.epoch, stale.token, SUCCEEDED, None,
                   _record(backend, stale.task_id, "stale")),
        Completion(plain.task_id, plain.epoch, plain.token, SUCCEEDED)]
    if via == "exchange":
        answers = sql_store.exchange(W1, TTL, completions, [], []).completed
    else:
        answers = sql_store.complete(W1, completions)
    assert answers == {live.task_id: "applied", stale.task_id: "evidence",
                       plain.task_id: "applied"}
    assert AsyncResult(live.task_id, backend=backend).get(timeout=5) == "live"
    assert _meta(backend, stale.task_id)["status"] == states.PENDING
    assert _meta(backend, plain.task_id)["status"] == states.PENDING
    # Sent again (its first exchange's answer was lost): a duplicate, nothing rewritten.
    again = sql_store.complete(W1, [Completion(live.task_id, live.epoch, live.token,
                                               SUCCEEDED, None,
                                               _record(backend, live.task_id, "again"))])
    assert again == {live.task_id: "duplicate"}
    assert _meta(backend, live.task_id)["result"] == "live"


def test_a_fenced_result_does_not_replace_a_success(backend: PulseBackend,
                                                    sql_store: SqlStore) -> None:
    """A task id published again (a new publication) fails where an earlier run
    succeeded: the success stays, as Celery's key-value backends keep it."""
    first = grant(sql_store, W1, request())
    backend.mark_as_done(first.task_id, "first")
    sql_store.complete(W1, [Completion(first.task_id, first.epoch, first.token, FAILED,
                                       "boom", _record(backend, first.task_id, "x",
                                                       states.FAILURE))])
    assert _meta(backend, first.task_id)["result"] == "first"
    retried = grant(sql_store, W1, request())
    backend.mark_as_retry(retried.task_id, RuntimeError("again"))
    sql_store.complete(W1, [Completion(retried.task_id, retried.epoch, retried.token,
                                       SUCCEEDED, None,
                                       _record(backend, retried.task_id, "done"))])
    assert _meta(backend, retried.task_id)["result"] == "done"


@pytest.mark.parametrize("via", ["exchange", "complete"])
def test_chord_parts_count_once_and_only_when_their_completion_applies(
        backend: PulseBackend, sql_store: SqlStore, via: str) -> None:
    counter = backend.get_key_for_chord("g1")

    def part(g: Any, result: Any) -> Completion:
        record = dataclasses.replace(_record(backend, g.task_id, result), counter=counter,
                                     counter_note=b"the callback")
        return Completion(g.task_id, g.epoch, g.token, SUCCEEDED, None, record)

    first, second, stale, third = (grant(sql_store, W1, request()) for _ in range(4))
    sql_store.release(W1, [key(stale)])
    grant(sql_store, W2, request(stale.task_id))

    def send(completions: list[Completion]) -> tuple[dict[str, str], dict[str, Any]]:
        if via == "exchange":
            done = sql_store.exchange(W1, TTL, completions, [], [])
            return dict(done.completed), dict(done.counted)
        counted: dict[str, Any] = {}
        return sql_store.complete(W1, completions, counted), counted

    answers, counted = send([part(first, 1), part(second, 2), part(stale, 0)])
    assert answers[stale.task_id] == "evidence"
    ordered = sorted([first.task_id, second.task_id])
    assert {t: c for t, (c, _) in counted.items()} == {ordered[0]: 1, ordered[1]: 2}
    nonces = {n for _, n in counted.values()}
    assert len(nonces) == 1 and len(nonces.pop()) == 32
    # Sent again (an exchange whose answer was lost): nothing counts twice.
    answers, counted = send([part(first, 1)])
    assert answers == {first.task_id: "duplicate"} and counted == {}
    answers, counted = send([part(third, 3)])
    assert [c for c, _ in counted.values()] == [3]
    assert ResultRows(sql_store.engine).get(counter) == b"the callback"
    assert AsyncResult(third.task_id, backend=backend).get(timeout=5) == 3


def test_get_wakes_on_the_write_not_on_its_poll_interval(backend: PulseBackend,
                                                         store_url: str) -> None:
    """A waiter with a 20 s poll interval returns soon after the write (PostgreSQL:
    LISTEN/NOTIFY; elsewhere polls start at 5 ms and double); the write comes from another
    process's connection, as a worker's would."""
    writer = _app("pulse+" + store_url, result_expires=3600).backend
    started = threading.Event()

    def write_later() -> None:
        started.wait(5)
        time.sleep(0.3)  # the waiter is asleep in its wait by then
        writer.mark_as_done("awaited", "here")

    thread = threading.Thread(target=write_later)
    thread.start()
    began = time.monotonic()
    started.set()
    try:
        assert AsyncResult("awaited", backend=backend).get(timeout=30, interval=20) == "here"
    finally:
        thread.join()
        writer.rows.engine.dispose()
    assert time.monotonic() - began < 10
    with pytest.raises(CeleryTimeoutError):
        AsyncResult("never", backend=backend).get(timeout=0.2, interval=20)


def test_a_chord_is_finished_by_its_whole_count_only(backend: PulseBackend) -> None:
    """The counts of one exchange reach the finishing thread in task id order: the whole
    count may come before a smaller one. Only the whole one publishes the callback; a
    smaller one after it finds the chord finished and does nothing (no ChordError)."""
    app = backend.app
    members = [AsyncResult(f"part-{i}", app=app) for i in range(3)]
    for i, member in enumerate(members):
        backend.mark_as_done(member.id, i)
    GroupResult("chord-g", members, app=app).save(backend=backend)
    callback = app.signature("results-contract.callback")
    callback.freeze()
    part = {"id": "part-0", "group": "chord-g", "chord": dict(callback)}
    assert not backend.finish_chord(part, 2, "n" * 32)
    assert backend.finish_chord(part, 3, "n" * 32)  # published to the app's memory:// broker
    assert GroupResult.restore("chord-g", app=app, backend=backend) is None
    assert not backend.finish_chord(part, 2, "n" * 32)
    assert _meta(backend, callback.id)["status"] == states.PENDING
