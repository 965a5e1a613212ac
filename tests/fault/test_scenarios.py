"""Fault injection with a history checker: nothing lost, nothing run twice.

Three workers run a steady stream of mixed tasks (short, long > lease TTL,
non-idempotent, retrying) and a 1 s beat schedule while a seeded nemesis SIGKILLs
and SIGSTOPs workers, drops the broker and stops the store. Then the checker reads
the history and the store and asserts every invariant (see ``checker.check``).

The store is a private PostgreSQL server; the RabbitMQ scenario runs on a private
MariaDB server too. The history stays on the shared PostgreSQL: the nemesis never
touches it.

Replay a run with ``PULSE_FAULT_SEED=<seed>``; soak by hand with
``PULSE_FAULT_DURATION=600``. Each scenario prints its summary line.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests.fault.checker import ClaimState, Event, Report, check
from tests.fault.nemesis import Cluster, Nemesis, PrivateRedis, rabbit_fault, redis_fault
from tests.helpers import services
from tests.helpers.mariadb import PRIVATE_SERVERS, PrivateServer
from tests.helpers.pg import Schema
from tests.helpers.workers import Env, Worker, wait_for

DURATION = float(os.environ.get("PULSE_FAULT_DURATION", "24"))
TIMINGS = {"pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5, "pulse_lease_ttl": 3,
           "pulse_renew_interval": 0.5, "pulse_recover_interval": 0.5, "pulse_revoke_grace": 1,
           "pulse_leader_ttl": 3, "pulse_leader_interval": 1, "pulse_beat_catchup": "all",
           "pulse_max_attempts": 25, "pulse_store_connect_timeout": 30,
           "broker_connection_retry": True, "worker_prefetch_multiplier": 2}


@pytest.fixture
def history() -> Iterator[str]:
    services.require("postgres")
    schema = Schema(services.PG_ADMIN_URL).create()
    engine = sa.create_engine(schema.url)
    with engine.begin() as conn:
        conn.execute(sa.text("create table fault_events (id bigserial primary key, kind text, "
                             "task_id text, epoch bigint, worker text, pid int, "
                             "at timestamptz, extra text)"))
    engine.dispose()
    try:
        yield schema.url
    finally:
        schema.drop()


def _seed() -> int:
    seed = int(os.environ.get("PULSE_FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"\nfault seed: {seed} (replay with PULSE_FAULT_SEED={seed})")
    return seed


class Producer(threading.Thread):
    """Publishes a seeded mix of tasks at a steady rate; keeps the ids it published."""

    def __init__(self, seed: int, env: Env, duration: float, rate: float = 4.0) -> None:
        super().__init__(name="producer", daemon=True)
        self.rng = random.Random(seed + 1)
        self.env = env
        self.duration = duration
        self.rate = rate
        self.submitted: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            from celery import Celery

            # A client app of its own: nothing cached from another test's broker.
            app = Celery("fault-producer", broker=self.env.broker_url)
            end = time.monotonic() + self.duration
            while time.monotonic() < end:
                task_id = str(uuid.uuid4())
                kind = self.rng.choices(["short", "long", "review", "flaky"],
                                        [50, 20, 15, 15])[0]
                args: list[Any] = {"long": [self.rng.uniform(3.5, 6.0)],
                                   "review": [self.rng.uniform(0.5, 4.0)]}.get(kind, [])
                app.send_task(f"faultapp.{kind}", args=args, task_id=task_id,
                              queue=self.env.queue, retry=True,
                              retry_policy={"max_retries": 30, "interval_start": 0.2,
                                            "interval_step": 0.5, "interval_max": 2})
                self.submitted.append(task_id)
                time.sleep(1.0 / self.rate)
        except BaseException as exc:
            self.error = exc


def _read_state(env: Env, history: str) -> tuple[list[ClaimState], list[Event],
                                                  list[tuple[str, int]], list[tuple[str, str]]]:
    store = sa.create_engine(env.store_url)
    hist = sa.create_engine(history)
    with store.connect() as conn:
        claims = [ClaimState(r.task_id, r.state, int(r.epoch), r.policy) for r in conn.execute(
            sa.text("select task_id, state, epoch, policy from pulse_claims"))]
        effects = [(r.task_id, int(r.epoch)) for r in conn.execute(
            sa.text("select task_id, epoch from fault_effects"))]
        slots = [(r.entry, str(r.due_at)) for r in conn.execute(
            sa.text("select entry, due_at from pulse_beat_slots"))]
    with hist.connect() as conn:
        events = [Event(r.kind, r.task_id, int(r.epoch), int(r.extra or 0)) for r in
                  conn.execute(sa.text("select kind, task_id, epoch, extra from fault_events "
                                       "where kind <> 'tick'"))]
        events += [Event("tick", r.task_id, int(r.epoch)) for r in conn.execute(
            sa.text("select task_id, epoch from fault_events where kind = 'tick'"))]
    store.dispose()
    hist.dispose()
    return claims, events, effects, slots


def _settled(env: Env, submitted: list[str]) -> bool:
    engine = sa.create_engine(env.store_url)
    try:
        with engine.connect() as conn:
            done = conn.execute(sa.text(
                "select count(*) from pulse_claims where task_id in :ids and state in "
                "('succeeded', 'failed', 'needs_review')").bindparams(
                    sa.bindparam("ids", expanding=True)), {"ids": submitted}).scalar_one()
        return int(done) == len(submitted)
    except sa.exc.OperationalError:
        return False
    finally:
        engine.dispose()


def _run_scenario(name: str, env: Env, store: PrivateServer, history: str,
                  workers: Callable[..., Worker], broker_fault: Callable[[], None],
                  skews: dict[str, float] | None = None) -> Report:
    seed = _seed()
    name = f"{name} on {make_url(env.store_url).get_backend_name()}"
    engine = sa.create_engine(env.store_url)
    with engine.begin() as conn:
        conn.execute(sa.text("create table if not exists fault_effects "
                             "(task_id text not null, epoch bigint not null)"))
    engine.dispose()
    env.conf.update(TIMINGS)
    os.environ["PULSE_FAULT_HISTORY"] = history
    os.environ["PULSE_FAULT_TICK"] = "1.0"
    cluster = Cluster(env, workers, ["f1", "f2", "f3"], skews=skews)
    for worker in cluster.workers.values():
        worker.wait_ready(60)
    started = time.monotonic()
    producer = Producer(seed, env, DURATION)
    nemesis = Nemesis(seed, cluster, store, broker_fault, DURATION)
    producer.start()
    nemesis.start()
    producer.join(DURATION + 120)
    nemesis.stop()
    nemesis.join(60)
    assert producer.error is None, f"producer failed: {producer.error!r}"
    assert nemesis.error is None, f"nemesis failed: {nemesis.error!r}"
    cluster.heal()
    submitted = producer.submitted
    # If they never settle, the checker below says exactly which are lost or stuck.
    with contextlib.suppress(AssertionError):
        wait_for(lambda: _settled(env, submitted), 120, "every submitted task to settle",
                 interval=1.0)
    claims, events, effects, slots = _read_state(env, history)
    report = check(submitted, claims, events, effects, slots, slot_period=1.0)
    elapsed = time.monotonic() - started
    if report.ticks > elapsed + 5:  # 1 s schedule: more ticks than seconds = fired early
        report.violations.append(f"{report.ticks} periodic ticks in {elapsed:.0f}s")
    logs = cluster.logs()
    report.duplicates_dropped = logs.count("duplicate delivery")
    report.recoveries = logs.count("pulse: recovered ")
    print(f"[{name}] seed={seed} {report.summary()}")
    print("\n".join(f"  nemesis: {line}" for line in nemesis.log))
    for violation in report.violations[:20]:
        print(f"  VIOLATION {violation}")
    assert not report.violations, (f"[{name}] seed {seed}: {len(report.violations)} invariant "
                                   f"violation(s), first: {report.violations[:5]}")
    assert report.submitted >= DURATION  # the load actually ran
    assert any("store down" in line for line in nemesis.log), "the store was never stopped"
    return report


@pytest.fixture
def fault_env(private_server: PrivateServer, make_env: Callable[..., Env]
              ) -> Callable[[str], Env]:
    def make(broker: str) -> Env:
        env = make_env(private_server.url, broker, {})
        env.app = "tests.apps.faultapp"
        return env
    return make


@pytest.mark.parametrize("private_server", list(PRIVATE_SERVERS), indirect=True)
def test_rabbitmq_scenario(fault_env: Callable[[str], Env], private_server: PrivateServer,
                           rabbitmq_url: str, history: str,
                           workers: Callable[..., Worker]) -> None:
    _run_scenario("rabbitmq", fault_env(rabbitmq_url), private_server, history, workers,
                  rabbit_fault)


def test_redis_scenario_with_broker_restarts(fault_env: Callable[[str], Env],
                                             private_server: PrivateServer, history: str,
                                             workers: Callable[..., Worker]) -> None:
    services.require("redis")
    redis = PrivateRedis().start()
    try:
        _run_scenario("redis", fault_env(redis.url), private_server, history, workers,
                      redis_fault(redis))
    finally:
        redis.destroy()


def test_clock_skew_changes_nothing(fault_env: Callable[[str], Env],
                                    private_server: PrivateServer, rabbitmq_url: str,
                                    history: str, workers: Callable[..., Worker]) -> None:
    """Workers whose wall clock is an hour ahead / behind: the store clock judges."""
    _run_scenario("skew", fault_env(rabbitmq_url), private_server, history, workers,
                  rabbit_fault, skews={"f1": 3600.0, "f2": -3600.0})
