"""Recover with real ``celery worker -P pulse`` processes (DESIGN §3.3-§3.4).

Workers run :mod:`tests.apps.recoverapp` on the PostgreSQL store; the tasks write a
journal (``start``/``end`` lines with task id, lease epoch, worker and wall time) so
the test counts executions and times them. Workers are killed with SIGKILL on their
whole process group (main process and pool), like a machine that vanishes.

Timing bound for a takeover, from the kill: the victim renewed its lease at most
``lease_ttl`` before it expires, a scanner looks every ``recover_interval``, and
re-publishing, reserving and starting take well under a second: ``lease_ttl +
recover_interval + 1`` s, plus ``SLACK`` for process scheduling on a busy machine.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.result import AsyncResult

from celery_pulse.errors import Terminal
from celery_pulse.store.base import ClaimInfo
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.store.sql.tables import reviews
from tests.conftest import SERVERS
from tests.helpers.workers import Env, Worker, wait_for

APP = "tests.apps.recoverapp"
FAST: dict[str, Any] = {"pulse_lease_ttl": 3, "pulse_renew_interval": 0.5,
                        "pulse_recover_interval": 0.5, "pulse_worker_ttl": 3,
                        "pulse_heartbeat_interval": 0.5}
BOUND = FAST["pulse_lease_ttl"] + FAST["pulse_recover_interval"] + 1.0
#: Process-scheduling slack on top of BOUND (CI machines run many workers at once).
SLACK = 2.0
#: How long we watch for something that must NOT happen (a re-run of a review task):
#: longer than a lease plus two recover scans, so a wrong re-dispatch would show.
OBSERVE = FAST["pulse_lease_ttl"] + 2 * FAST["pulse_recover_interval"]


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    task_id: str
    epoch: int
    host: str
    pid: int
    at: float


def read_journal(path: Path) -> list[Event]:
    """The journal's complete lines (a line being written right now is left out)."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if text and not text.endswith("\n"):
        lines = lines[:-1]
    events = []
    for line in lines:
        kind, task_id, epoch, host, pid, at = line.split()
        events.append(Event(kind, task_id, int(epoch), host, int(pid), float(at)))
    return events


def events_of(path: Path, task_id: str, kind: str = "start") -> list[Event]:
    return [e for e in read_journal(path) if e.task_id == task_id and e.kind == kind]


def claim(store: SqlStore, task_id: str) -> ClaimInfo:
    found = [c for c in store.list_claims(limit=10_000) if c.task_id == task_id]
    assert len(found) == 1, f"claim {task_id}: {found}"
    return found[0]


def claim_in(store: SqlStore, task_id: str, state: str) -> ClaimInfo | None:
    """The claim if it exists and is in ``state`` (for polling)."""
    found = [c for c in store.list_claims(limit=10_000) if c.task_id == task_id]
    return found[0] if found and found[0].state == state else None


def short(host: str) -> str:
    return host.split("@")[0]


# -- fixtures ---------------------------------------------------------------------------
@pytest.fixture(params=["rabbitmq", "redis"])
def broker(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue(f"{request.param}_url")
    return url


@pytest.fixture
def renv(make_env: Callable[..., Env]) -> Callable[..., Env]:
    """Like ``make_env`` (store migrated), for the recoverapp."""
    def factory(store_url: str, broker_url: str, conf: dict[str, Any] | None = None) -> Env:
        env = make_env(store_url, broker_url, conf)
        return Env(env.store_url, env.broker_url, env.queue, env.tmp, env.conf, app=APP)
    return factory


@pytest.fixture
def client() -> Iterator[Callable[..., Celery]]:
    """Producer-side Celery apps (the test process never imports the workers' app)."""
    made: list[Celery] = []

    def make(broker_url: str, backend: str | None = None) -> Celery:
        app = Celery("recover-client", broker=broker_url, backend=backend)
        made.append(app)
        return app

    yield make
    for app in made:
        app.close()


@pytest.fixture
def claims_store(server_url: str) -> Iterator[SqlStore]:
    """The store the test's workers use (PostgreSQL unless ``server_url`` says otherwise)."""
    store = open_store(server_url, check_schema=False)
    store.migrate()
    yield store
    store.close()


def start_all(env: Env, workers: Callable[..., Worker], *names: str,
              concurrency: int = 1) -> list[Worker]:
    started = [workers(env, name, concurrency=concurrency) for name in names]
    for w in started:
        w.wait_ready()
    return started


# -- 1. acks_late task on a killed worker: re-run elsewhere --------------------------------
# On pytest-celery's celery_worker_cluster: tests/plugin/test_cluster.py
# (test_killed_node_acks_late_task_reruns_on_the_other, on RabbitMQ and Redis with the
# PostgreSQL store, and on the embedded default).


# -- 2. plain task on a killed worker: needs review, not re-run -------------------------------
@pytest.mark.parametrize("server_url", SERVERS, indirect=True)
def test_killed_plain_task_needs_review_then_retry_and_resolve(
        server_url: str, claims_store: SqlStore, broker: str, renv: Callable[..., Env],
        workers: Callable[..., Worker], client: Callable[..., Celery], tmp_path: Path) -> None:
    env = renv(server_url, broker, FAST)
    journal, gate = tmp_path / "journal.txt", tmp_path / "gate"
    (a,) = start_all(env, workers, "a@%h", concurrency=2)
    producer = client(broker)
    t1, t2 = (producer.send_task("recoverapp.plain", args=[str(journal), 120, str(gate)],
                                 queue=env.queue).id for _ in range(2))
    wait_for(lambda: events_of(journal, t1) and events_of(journal, t2), 20, "both tasks to start")
    start_all(env, workers, "b@%h")

    a.kill()
    killed = time.time()
    wait_for(lambda: {i.task_id for i in claims_store.list_review()} >= {t1, t2},
             BOUND + SLACK + 10, "both tasks to need review")
    delay = time.time() - killed
    print(f"\nplain kill -> needs_review (store poll) [{broker.split(':')[0]}]: {delay:.3f}s")
    assert delay <= BOUND + SLACK, delay
    gate.touch()  # a wrong re-run would now run to its end: easy to see

    listed = {i["task_id"]: i for i in env.celery_json("pulse", "review")}
    assert set(listed) == {t1, t2}
    assert listed[t1]["task_name"] == "recoverapp.plain"
    assert {short(i["last_holder"] or "-") for i in listed.values()} == {"a"}

    # Observation window: nobody re-runs them; meanwhile `pulse status` says "a human is needed".
    window_end = time.monotonic() + OBSERVE
    status = env.celery("pulse", "status", "--json")
    assert status.returncode == 1, status.stdout + status.stderr
    assert json.loads(status.stdout)["claims"]["needs_review"] == 2
    while time.monotonic() < window_end:
        assert len(events_of(journal, t1)) == 1 and len(events_of(journal, t2)) == 1
        time.sleep(0.1)
    assert claim(claims_store, t1).state == claim(claims_store, t2).state == "needs_review"

    retried = env.celery("pulse", "review", "retry", t1, "--note", "checked: not applied")
    assert retried.returncode == 0, retried.stderr
    done = wait_for(lambda: claim_in(claims_store, t1, "succeeded"), 20, "the retried task to succeed")
    assert [short(e.host) for e in events_of(journal, t1, "end")] == ["b"]

    resolved = env.celery("pulse", "review", "resolve", t2, "--outcome", "failed",
                          "--note", "customer refunded")
    assert resolved.returncode == 0, resolved.stderr
    assert claim(claims_store, t2).state == "failed"
    # Both decided: status is healthy again (this CLI call also spans a second observation
    # window in which the retried task must not run a second time).
    assert env.celery("pulse", "status").returncode == 0
    starts = events_of(journal, t1)
    assert len(starts) == 2 and starts[1].epoch == done.epoch, starts
    assert len(events_of(journal, t2)) == 1 and not events_of(journal, t2, "end")

    with claims_store.engine.connect() as conn:
        audit = conn.execute(sa.select(reviews.c.task_id, reviews.c.action, reviews.c.outcome,
                                       reviews.c.note, reviews.c.decided_by)
                             .order_by(reviews.c.id)).all()
    assert [(r.task_id, r.action, r.outcome, r.note) for r in audit] == [
        (t1, "retry", None, "checked: not applied"),
        (t2, "resolve", "failed", "customer refunded")]
    assert all(r.decided_by for r in audit)


# -- 3. three scanners over 200 expired reservations ------------------------------------------
@pytest.mark.parametrize("server_url", SERVERS, indirect=True)
def test_three_workers_recover_200_expired_reservations_exactly_once(
        server_url: str, claims_store: SqlStore, rabbitmq_url: str, renv: Callable[..., Env],
        workers: Callable[..., Worker], client: Callable[..., Celery], tmp_path: Path) -> None:
    # The hoarder prefetches without limit (multiplier 0) and its only pool process is
    # busy with a long task, so it reserves all 200 real deliveries and runs none.
    hoard_env = renv(server_url, rabbitmq_url, {**FAST, "worker_prefetch_multiplier": 0})
    # Small batches: the three scanners interleave instead of one taking everything.
    env = renv(server_url, rabbitmq_url, {**FAST, "pulse_recover_batch": 5})
    journal, block_journal = tmp_path / "journal.txt", tmp_path / "block.txt"
    (hoarder,) = start_all(hoard_env, workers, "hoard@%h")
    producer = client(rabbitmq_url)
    blocker = producer.send_task("recoverapp.plain", args=[str(block_journal), 300],
                                 queue=env.queue).id
    wait_for(lambda: events_of(block_journal, blocker), 20, "the blocker to start")
    ids = [producer.send_task("recoverapp.plain", args=[str(journal)], queue=env.queue).id
           for _ in range(200)]
    wait_for(lambda: claims_store.claim_counts().get("reserved") == 200, 30,
             "200 reservations held by the hoarder")
    assert not read_journal(journal)

    scanners = start_all(env, workers, "r0@%h", "r1@%h", "r2@%h")
    hoarder.kill()
    wait_for(lambda: claims_store.claim_counts().get("succeeded") == 200, 90,
             "all 200 tasks to succeed")

    starts = Counter(e.task_id for e in read_journal(journal) if e.kind == "start")
    assert set(starts) == set(ids)
    assert [t for t, n in starts.items() if n != 1] == []
    assert {e.epoch for e in read_journal(journal)} == {3}
    for c in claims_store.list_claims(["succeeded"], limit=1000):
        assert (c.epoch, c.attempts) == (3, 2), c

    pattern = re.compile(r"pulse: recovered recoverapp\.plain\[([0-9a-f-]+)\] \(was reserved\): "
                         r"re-dispatched as epoch 2")
    by_scanner = {w.name: pattern.findall(w.log()) for w in scanners}
    recovered = Counter(t for found in by_scanner.values() for t in found)
    assert set(recovered) == set(ids)
    assert [t for t, n in recovered.items() if n != 1] == []
    duplicates = sum(w.log().count("duplicate delivery of") for w in scanners)
    assert duplicates == 0
    print(f"\nrecovered per scanner: { {n: len(f) for n, f in by_scanner.items()} }")
    # Precondition of the scenario: the scanners really did work on the same backlog.
    assert sum(1 for found in by_scanner.values() if found) >= 2, by_scanner

    # The started blocker was not re-run: it waits for review.
    assert claim(claims_store, blocker).state == "needs_review"
    assert len(events_of(block_journal, blocker)) == 1


# -- 4. killed on every attempt: failed after the budget ---------------------------------------
@pytest.mark.parametrize("server_url", SERVERS, indirect=True)
def test_task_killed_on_every_attempt_fails_after_max_attempts(
        server_url: str, claims_store: SqlStore, rabbitmq_url: str, redis_url: str,
        renv: Callable[..., Env], workers: Callable[..., Worker],
        client: Callable[..., Celery], tmp_path: Path) -> None:
    backend = redis_url.rsplit("/", 1)[0] + "/1"
    env = renv(server_url, rabbitmq_url, {**FAST, "pulse_max_attempts": 2,
                                          "result_backend": backend})
    ws = start_all(env, workers, "k0@%h", "k1@%h", "k2@%h")
    journal = tmp_path / "journal.txt"
    task_id = client(rabbitmq_url).send_task("recoverapp.doomed", args=[str(journal)],
                                             queue=env.queue).id
    # Read through the result backend only (no pub/sub subscription left behind).
    result: AsyncResult = AsyncResult(task_id, app=client(rabbitmq_url, backend))

    failed = wait_for(lambda: claim_in(claims_store, task_id, "failed"),
                      2 * (BOUND + SLACK) + 20, "the claim to fail")
    starts = events_of(journal, task_id)
    # Attempt 1 (epoch 1) killed; Recover re-opened it (epoch 2); attempt 2 (epoch 3)
    # killed; Recover found the budget spent: failed (epoch 4).
    assert [e.epoch for e in starts] == [1, 3], starts
    assert starts[0].host != starts[1].host
    assert (failed.epoch, failed.attempts, failed.outcome) == (4, 2, "exhausted")
    dead = {w.name.split("@")[0] for w in ws if w.proc.poll() is not None}
    assert dead == {short(e.host) for e in starts}
    (survivor,) = (w for w in ws if w.proc.poll() is None)
    # An acks_late start is recorded in the background while the body already runs
    # (for a re-dispatchable task "started" is information, not a fence): the kill can
    # beat that commit, and Recover then finds the attempt still reserved.
    # Recover logs after its commit: the claim can be read as failed a moment earlier.
    survivor.wait_log(rf"recovered recoverapp\.doomed\[{task_id}\] \(was (running|reserved)\): "
                      "failed", 10)

    (listed,) = env.celery_json("pulse", "claims", "--state", "failed")
    assert (listed["task_id"], listed["task"], listed["epoch"], listed["attempts"],
            listed["max_attempts"], listed["outcome"]) == (
        task_id, "recoverapp.doomed", 4, 2, 2, "exhausted")
    wait_for(lambda: result.state == "FAILURE", 10, "FAILURE in the result backend")
    assert isinstance(result.result, Terminal), result.result
    assert "attempt budget exhausted" in str(result.result)
