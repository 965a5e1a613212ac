"""Malformed deliveries (issue 32): each is settled once, named in one log line, counted,
and the worker goes on serving the good deliveries published beside it.

Every message here is one a broker really carries to the worker's queue: published by
hand with kombu, shaped like a Celery task message but wrong in one field.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kombu import Connection

from tests.apps.intakeapp import LONG_NAME
from tests.helpers.workers import Env, Worker, wait_for

FAST = {"pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5, "pulse_lease_ttl": 3,
        "pulse_renew_interval": 0.5, "pulse_recover_interval": 0.5,
        "pulse_store_connect_timeout": 30}


def _message(task: str, args: list[Any], task_id: Any, **header_changes: Any
             ) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
    """A protocol-2 task message (body, headers, properties) with some headers changed
    (a value of ``...`` removes the header)."""
    from celery import Celery

    message = Celery("shape").amqp.as_task_v2(str(uuid.uuid4()), task, args=tuple(args),
                                              kwargs={})
    headers = dict(message.headers)
    headers["id"] = task_id
    for key, value in header_changes.items():
        if value is ...:
            headers.pop(key, None)
        else:
            headers[key] = value
    body = json.dumps(message.body).encode()
    properties = dict(message.properties)
    if isinstance(task_id, str) and len(task_id) < 256:  # an AMQP short string
        properties["correlation_id"] = task_id
    else:
        properties.pop("correlation_id", None)
    return body, headers, properties


def _publish(broker_url: str, queue: str,
             messages: list[tuple[bytes, dict[str, Any], dict[str, Any]]],
             transport_options: dict[str, Any] | None = None) -> None:
    with Connection(broker_url, transport_options=transport_options) as conn:
        producer = conn.Producer()
        for body, headers, properties in messages:
            producer.publish(body, exchange="", routing_key=queue, headers=headers,
                             declare=[conn.SimpleQueue(queue).queue],
                             **{"content_type": "application/json",
                                "content_encoding": "utf-8", **properties})


def _states(env: Env, ids: list[str]) -> dict[str, str]:
    engine = sa.create_engine(env.store_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("select task_id, state from pulse_claims")).all()
    finally:
        engine.dispose()
    wanted = set(ids)
    return {row[0]: row[1] for row in rows if row[0] in wanted}


def _left_on_broker(broker_url: str, queue: str, transport_options: dict[str, Any]) -> int:
    """Messages of ``queue`` the broker still holds, ready or unacknowledged (the
    worker is dead by then: RabbitMQ has given its unacked ones back)."""
    if broker_url.startswith("filesystem"):
        return len(list(Path(transport_options["data_folder_in"]).glob(f"*{queue}*")))
    if broker_url.startswith("amqp"):
        with Connection(broker_url) as conn:
            _name, count, _consumers = conn.default_channel.queue_declare(queue, passive=True)
            return int(count)
    import redis

    client = redis.Redis.from_url(broker_url)
    try:
        unacked = [raw for raw in client.hvals("unacked")
                   if json.loads(raw)[2] == queue]
        return int(client.llen(queue)) + len(unacked)
    finally:
        client.close()


BAD_SHAPES: dict[str, tuple[Any, dict[str, Any]]] = {
    "no id": (..., {}),
    "retries a string": ("ok", {"retries": "abc"}),
    "id a list": (["a", "b"], {}),
    "id an integer": (12345, {}),
    "id too long": ("i" * 300, {}),
    "id with a NUL": ("nul\x00id", {}),
    "time limit malformed": ("ok", {"timelimit": ["soon", None]}),
    "time limit not a pair": ("ok", {"timelimit": "abc"}),
    "eta malformed": ("ok", {"eta": "not a time"}),
}


@pytest.mark.parametrize("broker", ["rabbitmq", "redis", "embedded"])
def test_malformed_deliveries_are_settled_and_the_worker_serves_the_rest(
        broker: str, request: pytest.FixtureRequest, tmp_path: Path,
        make_env: Callable[..., Env], workers: Callable[..., Worker]) -> None:
    """On PostgreSQL with RabbitMQ and Redis, and on the embedded default (SQLite and
    kombu's filesystem:// broker)."""
    from tests.conftest import filesystem_broker

    options: dict[str, Any] = {}
    if broker == "embedded":
        broker_url, conf = filesystem_broker(tmp_path)
        options = conf["broker_transport_options"]
        env = make_env(request.getfixturevalue("sqlite_url"), broker_url, {**FAST, **conf})
    else:
        broker_url = request.getfixturevalue(f"{broker}_url")
        env = make_env(request.getfixturevalue("pg_url"), broker_url, dict(FAST))
    env.app = "tests.apps.intakeapp"
    worker = workers(env, f"malformed-{broker}@%h", concurrency=2).wait_ready()
    marker, bad = env.tmp / "good.txt", env.tmp / "bad.txt"
    good_ids = [str(uuid.uuid4()) for _ in range(len(BAD_SHAPES) + 2)]
    # A good delivery between each two malformed ones: they reach the store together.
    messages = [_message("intakeapp.mark", [str(marker)], good_ids[0])]
    shown: dict[str, str] = {}
    for i, (shape, (task_id, changes)) in enumerate(BAD_SHAPES.items(), start=1):
        if task_id == "ok":
            task_id = str(uuid.uuid4())
        if task_id is ...:
            messages.append(_message("intakeapp.mark", [str(bad)], "x", id=..., **changes))
        else:
            shown[shape] = repr(task_id)[:20]
            messages.append(_message("intakeapp.mark", [str(bad)], task_id, **changes))
        messages.append(_message("intakeapp.mark", [str(marker)], good_ids[i]))
    long_id = str(uuid.uuid4())
    messages.append(_message(LONG_NAME, [str(bad)], long_id))
    messages.append(_message("intakeapp.mark", [str(marker)], good_ids[-1]))
    _publish(broker_url, env.queue, messages, options)

    wait_for(lambda: len(_states(env, good_ids)) == len(good_ids)
             and set(_states(env, good_ids).values()) == {"succeeded"}, 60,
             "every good delivery to succeed")
    worker.wait_log(r"rejected .*" + long_id[:8], 30)
    assert worker.proc.poll() is None, worker.log()[-3000:]
    assert not bad.exists()  # no malformed delivery ran
    assert marker.read_text().count("ran") == len(good_ids)
    log = worker.log()
    rejected = [line for line in log.splitlines() if "pulse: rejected" in line]
    assert len(rejected) == len(BAD_SHAPES) + 1, "\n".join(rejected)
    for shape, text in shown.items():
        assert any(text in line for line in rejected), (shape, rejected)
    assert all(env.queue in line for line in rejected), rejected
    assert "Traceback" not in log, log[-4000:]
    worker.signal(signal.SIGKILL)
    worker.wait()
    assert _left_on_broker(broker_url, env.queue, options) == 0  # each settled, none unacked



def _run_beside(env: Env, worker: Worker, bad: list[tuple[bytes, dict[str, Any], dict[str, Any]]],
                good_pad: str = "") -> list[str]:
    """Publish ``bad`` with a good delivery before, between and after them, all at once
    (they reach the store in one batch); wait for the good ones to succeed."""
    marker = env.tmp / "good.txt"
    good_ids = [str(uuid.uuid4()) for _ in range(len(bad) + 1)]
    messages = [_message("intakeapp.mark", [str(marker), good_pad], good_ids[0])]
    for message, task_id in zip(bad, good_ids[1:], strict=True):
        messages += [message, _message("intakeapp.mark", [str(marker), good_pad], task_id)]
    _publish(env.broker_url, env.queue, messages)
    wait_for(lambda: set(_states(env, good_ids).values()) == {"succeeded"}
             and len(_states(env, good_ids)) == len(good_ids), 90,
             f"every good delivery to succeed; the worker's log ends:\n{worker.log()[-3000:]}")
    assert marker.read_text().count("ran") == len(good_ids)
    return good_ids


@pytest.mark.parametrize("server_url", ["postgres", "mariadb"], indirect=True)
def test_a_value_the_store_refuses_fails_that_delivery_alone(
        server_url: str, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """Past the screening: a content type longer than its column (128) is refused by the
    server itself. The batch it came in is reserved again without it, it is rejected."""
    env = make_env(server_url, rabbitmq_url, dict(FAST))
    env.app = "tests.apps.intakeapp"
    worker = workers(env, "refused@%h", concurrency=2).wait_ready()
    bad_id = str(uuid.uuid4())
    body, headers, properties = _message("intakeapp.mark", [str(env.tmp / "bad.txt")], bad_id)
    properties["content_type"] = "application/" + "x" * 200
    _run_beside(env, worker, [(body, headers, properties)])
    line = worker.wait_log(r"pulse: rejected task intakeapp\.mark\['" + bad_id + r"'\].*", 30)
    assert "refused" in line.group(0), line.group(0)
    assert bad_id not in _states(env, [bad_id])
    worker.kill()
    assert _left_on_broker(rabbitmq_url, env.queue, {}) == 0


def test_big_deliveries_on_mariadb_are_kept_or_rejected_never_stalled(
        mariadb_url: str, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """20 MB is over MariaDB's max_allowed_packet (16 MB here; PyMySQL sends a body as
    hex, twice its size): rejected before the store sees it. Two 5 MB deliveries fit one
    statement each, not one together: they are reserved in statements of their own."""
    env = make_env(mariadb_url, rabbitmq_url, dict(FAST))
    env.app = "tests.apps.intakeapp"
    worker = workers(env, "big@%h", concurrency=2).wait_ready()
    huge_id = str(uuid.uuid4())
    huge = _message("intakeapp.mark", [str(env.tmp / "bad.txt"), "x" * 20_000_000], huge_id)
    good_ids = _run_beside(env, worker, [huge], good_pad="y" * 5_000_000)
    line = worker.wait_log(r"pulse: rejected task intakeapp\.mark\['" + huge_id + r"'\].*", 30)
    assert "bytes" in line.group(0), line.group(0)
    assert not (env.tmp / "bad.txt").exists()
    assert len(good_ids) == 2
    assert worker.proc.poll() is None
    worker.kill()
    assert _left_on_broker(rabbitmq_url, env.queue, {}) == 0
