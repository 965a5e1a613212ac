"""Events of real ``celery worker -P pulse -E`` processes, received by a real
``celery.events.EventReceiver`` in a process of its own (tests/helpers/receiver.py), and
the task states a real ``celery.events.state.State`` (Flower's) makes of them.

Workers run :mod:`tests.apps.eventsapp` on the PostgreSQL store with short TTLs. A
worker is killed with SIGKILL on its whole process group, or paused with SIGSTOP (main
process and pool) past its lease and resumed with SIGCONT. Each held task waits for a
gate file of its own epoch, so a re-run (epoch 2) finishes at once while the first
attempt (epoch 1) is held.
"""

from __future__ import annotations

import re
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.helpers.publish import publish_raw
from tests.helpers.receiver import Event, EventLog
from tests.helpers.workers import ROOT, Env, Worker, assert_alive, stop_consuming, wait_for

APP = "tests.apps.eventsapp"
FAST: dict[str, Any] = {
    "pulse_lease_ttl": 3, "pulse_renew_interval": 0.5, "pulse_recover_interval": 0.5,
    "pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5, "pulse_leader_ttl": 3,
    "pulse_leader_interval": 0.5, "pulse_permit_wait_event": 0.5,
    "pulse_concurrency_limits": {"eventsapp.limited": 1}}
#: Kill or pause -> Recover's verdict: the lease runs out, a scan finds it (as in
#: tests/acceptance/test_recover.py), plus slack for a busy machine.
BOUND = FAST["pulse_lease_ttl"] + FAST["pulse_recover_interval"] + 1.0 + 10.0
#: Events the workers send within a moment (a renewal interval, a loop turn).
SOON = 15.0
#: Worker names: events carry them as ``hostname``.
A, B = "a@events-test", "b@events-test"
#: How long a held attempt would wait for its gate (never that long: it is killed).
HOLD = 120
#: The epoch a re-dispatched task runs under: Recover's takeover is epoch 2 (the claim
#: reopened under its publish lease), the new delivery's reservation epoch 3.
RERUN = 3


def documented_events() -> dict[str, list[str]]:
    """docs/monitoring.md's Events table: each ``pulse-*`` type and its fields."""
    text = (ROOT / "docs" / "monitoring.md").read_text()
    table = text[text.index("## Events"):text.index("### Task events")]
    out: dict[str, list[str]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`pulse-"):
            continue
        optional = re.findall(r"`(\w+)` \(if", cells[2])
        named = re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", cells[2]))  # not values
        fields = [f for f in named if f not in optional]
        for name in re.findall(r"`(pulse-[a-z-]+)`", cells[0]):
            out[name] = fields
    assert len(out) >= 8, out
    return out


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(params=["rabbitmq", "redis"])
def broker(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


@pytest.fixture
def eenv(make_env: Callable[..., Env], pg_url: str) -> Callable[[str], Env]:
    """An Env for the eventsapp on a fresh PostgreSQL store (migrated) and ``broker``."""
    def factory(broker_url: str) -> Env:
        env = make_env(pg_url, broker_url, FAST)
        return Env(env.store_url, env.broker_url, env.queue, env.tmp, env.conf, app=APP)
    return factory


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Callable[[str], EventLog]]:
    """Start an event receiver process on a broker; every one is killed at teardown."""
    started: list[EventLog] = []

    def start(broker_url: str) -> EventLog:
        log = EventLog(broker_url, tmp_path)
        started.append(log)
        return log

    yield start
    for log in started:
        log.kill()


@pytest.fixture
def client() -> Iterator[Callable[[str], Celery]]:
    made: list[Celery] = []

    def make(broker_url: str) -> Celery:
        app = Celery("events-client", broker=broker_url)
        made.append(app)
        return app

    yield make
    for app in made:
        app.close()


def start(workers: Callable[..., Worker], env: Env, name: str, concurrency: int = 1) -> Worker:
    return workers(env, name, concurrency=concurrency, extra=("-E",)).wait_ready()


def started(journal: Path, task_id: str) -> list[str]:
    """The ``start`` lines of ``task_id`` in the tasks' journal."""
    if not journal.exists():
        return []
    return [line for line in journal.read_text().splitlines()
            if line.startswith(f"start {task_id} ")]


def held_task(producer: Celery, env: Env, name: str, journal: Path, gate: Path) -> str:
    task_id: str = producer.send_task(name, args=[str(journal), HOLD, str(gate)],
                                      queue=env.queue).id
    return task_id


def task_events(log: EventLog, task_id: str) -> list[Event]:
    return [e for e in log.events() if e.get("uuid") == task_id
            and str(e.get("type", "")).startswith("task-")]


# -- every pulse-* event type, per broker ---------------------------------------------------
def test_every_documented_pulse_event_type_reaches_a_receiver(
        broker: str, eenv: Callable[[str], Env], workers: Callable[..., Worker],
        receiver: Callable[[str], EventLog], client: Callable[[str], Celery],
        tmp_path: Path) -> None:
    env = eenv(broker)
    log = receiver(broker)
    journal, gate, limit_gate = tmp_path / "journal", tmp_path / "gate", tmp_path / "limit"
    a = start(workers, env, A, concurrency=2)
    log.wait("pulse-leader-gained", SOON, hostname=A, key="beat")
    producer = client(broker)

    # Limit 1, two processes: the second task waits for the permit, and says so.
    limited = {producer.send_task("eventsapp.limited", args=[str(journal), HOLD,
                                                            str(limit_gate)],
                                  queue=env.queue).id for _ in range(2)}
    waited = log.wait("pulse-permit-wait", SOON, hostname=A)
    assert waited["uuid"] in limited and waited["permits"] == ["task:eventsapp.limited"]
    limit_gate.touch()

    # One publication delivered twice: the second delivery is dropped.
    twice = str(uuid.uuid4())
    for _ in range(2):
        publish_raw(producer, env.queue, "eventsapp.limited",
                    [str(journal), 0, str(limit_gate)], twice, "one-publication")
    log.wait("pulse-duplicate-dropped", SOON, uuid=twice, hostname=A)

    # Worker A paused past its leases (and its leadership): B recovers both tasks (one
    # re-dispatched, one to review) and leads; resumed, A finds out.
    redispatched = held_task(producer, env, "eventsapp.late", journal, gate)
    reviewed = held_task(producer, env, "eventsapp.plain", journal, gate)
    wait_for(lambda: started(journal, redispatched) and started(journal, reviewed), SOON,
             "both held tasks to start on A")
    b = start(workers, env, B)
    Path(f"{gate}.{RERUN}").touch()  # the re-dispatched task's next attempt finishes at once
    a.signal(signal.SIGSTOP)
    try:
        alive = lambda: assert_alive(b)  # noqa: E731
        log.wait("pulse-task-recovered", BOUND, uuid=redispatched, hostname=B, alive=alive)
        log.wait("pulse-needs-review", BOUND, uuid=reviewed, hostname=B, alive=alive)
        log.wait("pulse-leader-gained", BOUND, hostname=B, alive=alive)
    finally:
        a.signal(signal.SIGCONT)
    for task_id in (redispatched, reviewed):
        log.wait("pulse-lease-lost", SOON, uuid=task_id, hostname=A)
        log.wait("pulse-attempt-ended", SOON, uuid=task_id, hostname=A)
    log.wait("pulse-leader-lost", SOON, hostname=A)

    documented = documented_events()
    received = {e["type"]: e for e in log.events() if e["type"].startswith("pulse-")}
    assert set(documented) <= set(received), sorted(set(documented) - set(received))
    for type_, fields in documented.items():
        missing = [f for f in fields if f not in received[type_]]
        assert not missing, (type_, missing, received[type_])
    recovered = log.of("pulse-task-recovered", uuid=redispatched)[0]
    assert (recovered["state"], recovered["was"], recovered["epoch"], recovered["holder"]) == (
        "open", "running", 2, A)
    review = log.of("pulse-needs-review", uuid=reviewed)[0]
    assert (review["state"], review["was"], review["epoch"], review["holder"]) == (
        "needs_review", "running", 2, A)
    ended = log.of("pulse-attempt-ended", uuid=redispatched)[0]
    assert ended["epoch"] == 1 and ended["attempt"] == 1
    assert ended["outcome"] in ("failed", "succeeded")
    print(f"\nevent types received [{broker.split(':')[0]}]: "
          f"{sorted(t for t in {e['type'] for e in log.events()})}")


# -- truthful task states -------------------------------------------------------------------
def test_killed_workers_started_review_task_is_failed_with_needs_review_as_that_worker(
        eenv: Callable[[str], Env], broker: str, workers: Callable[..., Worker],
        receiver: Callable[[str], EventLog], client: Callable[[str], Celery],
        tmp_path: Path) -> None:
    env = eenv(broker)
    log = receiver(broker)
    journal, gate = tmp_path / "journal", tmp_path / "gate"
    a = start(workers, env, A)
    task_id = held_task(client(broker), env, "eventsapp.plain", journal, gate)
    log.wait("task-started", SOON, uuid=task_id, hostname=A)
    b = start(workers, env, B)

    a.kill()
    failed = log.wait("task-failed", BOUND, uuid=task_id, alive=lambda: assert_alive(b))
    assert failed["hostname"] == A  # the lost holder: no phantom worker in Flower
    assert failed["exception"] == repr_needs_review(A, 1)
    assert (failed["pulse_epoch"], failed["pulse_attempt"]) == (1, 1)
    received = log.of("task-received", uuid=task_id)[0]
    assert (received["hostname"], received["pulse_epoch"], received["pulse_attempt"]) == (A, 1, 1)
    assert log.of("task-started", uuid=task_id)[0]["pulse_epoch"] == 1

    task = log.state().tasks[task_id]
    assert task.state == "FAILURE", task.state
    assert "NeedsReview" in task.exception and task.worker.hostname == A
    assert set(log.state().workers) <= {A, B}
    assert len(started(journal, task_id)) == 1  # and nobody ran it again


def repr_needs_review(holder: str, epoch: int) -> str:
    return (f"NeedsReview('holder {holder} lost its lease at epoch {epoch}; outcome unknown: "
            "celery pulse review')")


def test_killed_workers_acks_late_task_is_retried_then_the_new_attempt_succeeds(
        eenv: Callable[[str], Env], broker: str, workers: Callable[..., Worker],
        receiver: Callable[[str], EventLog], client: Callable[[str], Celery],
        tmp_path: Path) -> None:
    env = eenv(broker)
    log = receiver(broker)
    journal, gate = tmp_path / "journal", tmp_path / "gate"
    a = start(workers, env, A)
    task_id = held_task(client(broker), env, "eventsapp.late", journal, gate)
    log.wait("task-started", SOON, uuid=task_id, hostname=A)
    b = start(workers, env, B)
    Path(f"{gate}.{RERUN}").touch()

    a.kill()
    log.wait("task-succeeded", BOUND, uuid=task_id, alive=lambda: assert_alive(b))
    events = [(e["type"], e["hostname"], e.get("pulse_epoch")) for e in task_events(log, task_id)]
    assert events == [("task-received", A, 1), ("task-started", A, 1), ("task-retried", A, 1),
                      ("task-received", B, RERUN), ("task-started", B, RERUN),
                      ("task-succeeded", B, RERUN)], events
    retried = log.of("task-retried", uuid=task_id)[0]
    assert retried["reason"] == f"holder {A} lost its lease at epoch 1: re-dispatched"
    assert "exception" not in retried  # Flower would keep it through the SUCCESS
    assert log.of("task-succeeded", uuid=task_id)[0]["pulse_attempt"] == 2

    task = log.state().tasks[task_id]
    assert task.state == "SUCCESS", task.state
    assert task.pulse_epoch == RERUN and task.pulse_attempt == 2
    assert task.worker.hostname == B and task.failed is None and task.exception is None


def test_paused_workers_stale_attempt_never_overwrites_the_state_of_the_current_one(
        eenv: Callable[[str], Env], broker: str, workers: Callable[..., Worker],
        receiver: Callable[[str], EventLog], client: Callable[[str], Celery],
        tmp_path: Path) -> None:
    """A paused worker's channel stays open, and the broker would hand it the
    re-dispatched delivery as readily as the live worker's: A stops consuming first
    (Celery's ``cancel_consumer``), so the new attempt runs on B."""
    env = eenv(broker)
    log = receiver(broker)
    journal, gate = tmp_path / "journal", tmp_path / "gate"
    a = start(workers, env, A)
    producer = client(broker)
    task_id = held_task(producer, env, "eventsapp.late", journal, gate)
    log.wait("task-started", SOON, uuid=task_id, hostname=A)
    b = start(workers, env, B)
    Path(f"{gate}.{RERUN}").touch()
    stop_consuming(producer, A, env.queue)

    a.signal(signal.SIGSTOP)
    try:
        log.wait("task-succeeded", BOUND, uuid=task_id, hostname=B,
                 alive=lambda: assert_alive(b))
    finally:
        a.signal(signal.SIGCONT)
    ended = log.wait("pulse-attempt-ended", SOON, uuid=task_id, hostname=A)
    assert (ended["epoch"], ended["outcome"]) == (1, "failed"), ended
    assert "LeaseLost" in ended["exception"]
    assert a.proc.poll() is None  # the paused worker goes on

    ends = [e for e in task_events(log, task_id)
            if e["type"] in ("task-succeeded", "task-failed")]
    assert [(e["type"], e["hostname"], e["pulse_epoch"]) for e in ends] == [
        ("task-succeeded", B, RERUN)], ends
    task = log.state().tasks[task_id]
    assert task.state == "SUCCESS", task.state
    assert task.failed is None and task.exception is None and task.traceback is None
    assert task.pulse_epoch == RERUN and task.worker.hostname == B


def test_killed_workers_task_with_no_attempt_left_is_failed_as_budget_exhausted(
        eenv: Callable[[str], Env], broker: str, workers: Callable[..., Worker],
        receiver: Callable[[str], EventLog], client: Callable[[str], Celery],
        tmp_path: Path) -> None:
    env = eenv(broker)
    log = receiver(broker)
    journal, gate = tmp_path / "journal", tmp_path / "gate"
    a = start(workers, env, A)
    task_id = held_task(client(broker), env, "eventsapp.once", journal, gate)
    log.wait("task-started", SOON, uuid=task_id, hostname=A)
    b = start(workers, env, B)

    a.kill()
    failed = log.wait("task-failed", BOUND, uuid=task_id, alive=lambda: assert_alive(b))
    assert failed["hostname"] == A and failed["pulse_epoch"] == 1
    assert failed["exception"] == (f"Terminal('attempt budget exhausted for task {task_id}: "
                                   "failed, not run')")
    log.wait("pulse-task-recovered", SOON, uuid=task_id, state="failed", holder=A)
    task = log.state().tasks[task_id]
    assert task.state == "FAILURE" and "budget exhausted" in task.exception
    assert len(started(journal, task_id)) == 1
