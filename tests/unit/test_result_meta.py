"""The ``pulse://`` backend's own meta and JSON path (its per-task cost in a pool child)
writes what Celery's generic path would: same keys, same values, same bytes."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from celery.backends.base import KeyValueStoreBackend
from kombu.exceptions import EncodeError

from celery_pulse.backend import (
    PulseBackend,
    carried_by_completions,
    deferred_result,
    record_fields,
    same_store,
)
from celery_pulse.store.base import ResultRecord


def _backend(**conf: Any) -> PulseBackend:
    # The backend opens no connection until a row is read or written.
    app = Celery("meta", broker="memory://", backend="pulse+sqlite:////nonexistent/x.db",
                 set_as_current=False)
    app.conf.update(conf)
    backend: PulseBackend = app.backend
    return backend


def _request(**fields: Any) -> Context:
    return Context(id=str(uuid.uuid4()), task="t.noop", args=[1], kwargs={"a": 2},
                   hostname="w1", retries=0, delivery_info={"routing_key": "q"}, **fields)


def _without_date(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k != "date_done"}


@pytest.mark.parametrize("fields", [
    {}, {"group": "g1"}, {"parent_id": "p1"}, {"group": "g1", "parent_id": "p1"}])
@pytest.mark.parametrize("state", [states.SUCCESS, states.FAILURE, states.RETRY,
                                   states.STARTED])
def test_meta_is_celerys(fields: dict[str, Any], state: str) -> None:
    backend, request = _backend(), _request(**fields)
    ours = backend._get_result_meta({"x": 1}, state, "tb", request)
    celerys = KeyValueStoreBackend._get_result_meta(backend, {"x": 1}, state, "tb", request)
    assert _without_date(ours) == _without_date(celerys)
    assert list(ours) == list(celerys)
    if state in states.READY_STATES:
        done = datetime.fromisoformat(ours["date_done"])
        assert done.utcoffset() == datetime.fromisoformat(celerys["date_done"]).utcoffset()
        assert abs((done - datetime.fromisoformat(celerys["date_done"])).total_seconds()) < 5
    else:
        assert ours["date_done"] is None


def test_the_date_is_in_the_apps_timezone() -> None:
    backend = _backend(timezone="Asia/Shanghai", enable_utc=False)
    meta = backend._get_result_meta(None, states.SUCCESS, None, _request())
    assert datetime.fromisoformat(meta["date_done"]).utcoffset().total_seconds() == 8 * 3600


def test_result_extended_takes_celerys_path() -> None:
    backend = _backend(result_extended=True)
    meta = backend._get_result_meta(None, states.SUCCESS, None, _request())
    assert meta["name"] == "t.noop" and meta["queue"] == "q" and meta["worker"] == "w1"


def test_json_bytes_are_kombus() -> None:
    backend = _backend()
    meta = {"status": "SUCCESS", "result": {"é": [1, 2.5, None]}, "children": [],
            "date_done": "2026-01-01T00:00:00+00:00", "task_id": "t", "u": uuid.UUID(int=7)}
    assert backend.encode(meta) == KeyValueStoreBackend.encode(backend, meta)
    assert backend.decode(backend.encode(meta)) == meta


def test_an_unencodable_result_is_an_encode_error_as_in_celery() -> None:
    # Celery's tracer turns an EncodeError while storing into the task's failure.
    with pytest.raises(EncodeError):
        _backend().encode({"result": object()})


def test_another_serializer_takes_celerys_path() -> None:
    backend = _backend(result_serializer="pickle", accept_content=["pickle", "json"],
                       result_accept_content=["pickle", "json"])
    meta = {"status": "SUCCESS", "result": {1, 2}}
    assert backend.decode(backend.encode(meta)) == meta


def test_a_deferred_outcome_is_kept_not_written_and_crosses_the_pipe_as_fields() -> None:
    backend, request = _backend(), _request()
    with deferred_result(request.id) as deferral:
        backend.mark_as_done(request.id, 42, request)
    record = deferral.record
    assert record is not None and record.state == states.SUCCESS
    assert not backend.opened_here()  # nothing written, no connection
    assert ResultRecord(*record_fields(record)) == record
    assert backend.decode(record.value)["result"] == 42


# -- which backend a completion writes for -----------------------------------------------
@pytest.mark.parametrize(("a", "b", "same"), [
    ("postgresql://u@db/jobs", "postgresql+psycopg://u:secret@db/jobs", True),  # driver, password
    ("postgresql+psycopg://u@db/jobs?options=-csearch_path%3Da",
     "postgresql+psycopg://u@db/jobs?options=-csearch_path%3Db", False),  # another schema
    ("postgresql+psycopg://u@db/jobs", "postgresql+psycopg://u@db/other", False),
    ("postgresql+psycopg://u@db:5432/jobs", "postgresql+psycopg://u@db:5433/jobs", False),
    ("mysql+pymysql://root@127.0.0.1/test", "postgresql+psycopg://root@127.0.0.1/test", False),
])
def test_same_store_is_one_database(a: str, b: str, same: bool) -> None:
    assert same_store(a, b) is same


def test_same_store_resolves_sqlite_paths(tmp_path: Any, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.chdir(tmp_path)
    assert same_store("sqlite:///pulse.db", f"sqlite:///{tmp_path / 'pulse.db'}")
    assert not same_store("sqlite:///pulse.db", f"sqlite:///{tmp_path / 'other.db'}")


def test_completions_carry_only_a_pulse_backend_on_their_store(tmp_path: Any) -> None:
    store = f"sqlite:///{tmp_path / 'claims.db'}"
    app = Celery("carried", set_as_current=False)
    app.conf.pulse_store_url = store
    assert carried_by_completions(PulseBackend(app=app, url="pulse://"), store)
    # What Celery hands the backend for "pulse+<url>": the URL after the "+".
    assert carried_by_completions(PulseBackend(app=app, url=store), store)
    elsewhere = PulseBackend(app=app, url=f"sqlite:///{tmp_path / 'results.db'}")
    assert not carried_by_completions(elsewhere, store)
    assert not carried_by_completions(KeyValueStoreBackend(app=app), store)
