"""Bad input: clear errors, the worker keeps serving, nothing lost (issue: fault suite)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from kombu import Connection, Exchange, Producer

from tests.helpers.pg import PrivatePostgres
from tests.helpers.workers import Env, Worker, wait_for

FAST = {"pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5, "pulse_lease_ttl": 3,
        "pulse_renew_interval": 0.5, "pulse_recover_interval": 0.5,
        "pulse_store_connect_timeout": 30}


def _env(make_env: Callable[..., Env], store: str, broker: str) -> Env:
    env = make_env(store, broker, dict(FAST))
    env.app = "tests.apps.opsapp"
    return env


def _send_hold(env: Env, marker: Path, seconds: float = 0.0, pad: str = "") -> str:
    from celery import Celery

    client = Celery("client", broker=env.broker_url)
    task_id = str(uuid.uuid4())
    client.send_task("opsapp.hold", args=[seconds, str(marker)],
                     kwargs={"pad": pad} if pad else {}, task_id=task_id, queue=env.queue)
    return task_id


def _claim_state(env: Env, task_id: str) -> str | None:
    engine = sa.create_engine(env.store_url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text("select state from pulse_claims where task_id = :t"),
                                {"t": task_id}).scalar_one_or_none()
    finally:
        engine.dispose()


def test_poison_messages_do_not_stop_the_worker(pg_url: str, rabbitmq_url: str,
                                                make_env: Callable[..., Env],
                                                workers: Callable[..., Worker]) -> None:
    env = _env(make_env, pg_url, rabbitmq_url)
    worker = workers(env, "poison@%h").wait_ready()
    with Connection(rabbitmq_url) as conn:
        producer = Producer(conn.default_channel, exchange=Exchange(env.queue, "direct"),
                            routing_key=env.queue)
        # Undecodable body.
        producer.publish(b"\xff\xfe not json", content_type="application/json",
                         content_encoding="utf-8", headers={"id": str(uuid.uuid4()),
                                                            "task": "opsapp.hold"})
        # Unknown task name.
        producer.publish(json.dumps([[], {}, {}]).encode(), content_type="application/json",
                         content_encoding="utf-8",
                         headers={"id": str(uuid.uuid4()), "task": "no.such.task", "lang": "py"})
    big = env.tmp / "big.txt"
    big_id = _send_hold(env, big, pad="x" * 2_000_000)  # a 2 MB argument: stored, then run
    ok = env.tmp / "ok.txt"
    ok_id = _send_hold(env, ok)
    wait_for(lambda: _claim_state(env, ok_id) == "succeeded", 60, "the normal task to succeed")
    wait_for(lambda: _claim_state(env, big_id) == "succeeded", 60, "the oversized task")
    assert worker.proc.poll() is None, worker.log()[-3000:]
    log = worker.log()
    assert "no.such.task" in log  # Celery names the unknown task
    assert big.read_text().splitlines() == ["start 1", "end"]


def test_corrupted_claim_row_is_failed_and_recover_goes_on(
        pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    env = _env(make_env, pg_url, rabbitmq_url)
    engine = sa.create_engine(pg_url)
    bad_id, good_marker = str(uuid.uuid4()), env.tmp / "after.txt"
    with engine.begin() as conn:
        conn.execute(sa.text(
            "insert into pulse_claims (task_id, task_name, state, holder, token, epoch, "
            "lease_until, attempts, max_attempts, policy, retries, body, headers, properties, "
            "delivery_info, content_type, content_encoding, created_at, reserved_at) values "
            "(:t, 'opsapp.hold', 'reserved', 'ghost@nowhere', 'tok', 1, 0, 1, 5, 'review', 0, "
            "'\\x00', '{not json', '{}', '{}', 'application/json', 'utf-8', 0, 0)"),
            {"t": bad_id})
    engine.dispose()
    worker = workers(env, "corrupt@%h").wait_ready()
    wait_for(lambda: _claim_state(env, bad_id) == "failed", 30, "the corrupted claim to be failed")
    assert "corrupted" in worker.log()
    ok_id = _send_hold(env, good_marker)
    wait_for(lambda: _claim_state(env, ok_id) == "succeeded", 60, "a normal task afterwards")


def test_read_only_store_pauses_then_resumes_without_loss(
        private_pg: PrivatePostgres, rabbitmq_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    env = _env(make_env, private_pg.url, rabbitmq_url)
    worker = workers(env, "ro@%h").wait_ready()
    admin = sa.create_engine(private_pg.url, isolation_level="AUTOCOMMIT")

    def read_only(on: bool) -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f"alter system set default_transaction_read_only = "
                                 f"{'on' if on else 'off'}"))
            conn.execute(sa.text("select pg_reload_conf()"))

    read_only(True)
    try:
        marker = env.tmp / "ro.txt"
        task_id = _send_hold(env, marker)
        worker.wait_log(r"(cannot reserve tasks|stopped consuming)", timeout=30)
        assert not marker.exists()  # never run without a durable reservation
    finally:
        read_only(False)
    wait_for(lambda: _claim_state(env, task_id) == "succeeded", 60,
             "the task to run once the store takes writes again")
    assert marker.read_text().splitlines() == ["start 1", "end"]
    assert worker.proc.poll() is None
    admin.dispose()
