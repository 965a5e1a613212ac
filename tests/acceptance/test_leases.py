"""Per-task leases with real ``celery worker -P pulse`` processes (issue: per-task leases).

Every task used here (``tests/apps/pulseapp.py``) writes one line per event into a
file of the test's own ("start <epoch> <pid>", "lost <wall time> ...", "end ..."),
so the tests count executions and time what the task itself saw. The claim table is
read directly with SQL. PostgreSQL + RabbitMQ unless a test says otherwise.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from kombu import Connection

from celery_pulse.store.sql.dialect import Dialect
from celery_pulse.store.sql.tables import claims
from tests.conftest import SERVERS, filesystem_broker
from tests.helpers.mariadb import PRIVATE_SERVERS, PrivateServer
from tests.helpers.publish import publish_raw
from tests.helpers.workers import Env, Worker, wait_for

FAST: dict[str, Any] = {"pulse_lease_ttl": 3, "pulse_renew_interval": 0.5,
                        "pulse_revoke_grace": 2, "pulse_worker_ttl": 3,
                        "pulse_heartbeat_interval": 0.5}


# -- helpers ---------------------------------------------------------------------------
@contextlib.contextmanager
def producer(env: Env) -> Iterator[Celery]:
    """A client app publishing to the test's queue on the test's broker."""
    app = Celery("pulse-test-client", broker=env.broker_url, set_as_current=False)
    app.conf.update({k: v for k, v in env.conf.items() if k.startswith("broker_")})
    app.conf.task_default_queue = env.queue
    try:
        yield app
    finally:
        app.close()


class Claims:
    """Direct SQL access to the store the workers use."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        #: The store clock in SQL, as the store evaluates it.
        self.now = Dialect(self.engine.dialect.name).clock

    def rows(self) -> dict[str, Any]:
        with self.engine.connect() as conn:
            return {r.task_id: r for r in conn.execute(sa.select(claims))}

    def get(self, task_id: str) -> Any:
        return self.rows().get(task_id)

    def state(self, task_id: str) -> str | None:
        row = self.get(task_id)
        return None if row is None else str(row.state)

    def execute(self, sql: str, **params: Any) -> Any:
        with self.engine.begin() as conn:
            return conn.execute(sa.text(sql), params)

    def close(self) -> None:
        self.engine.dispose()


@pytest.fixture
def db() -> Iterator[Callable[[str], Claims]]:
    opened: list[Claims] = []

    def open_(url: str) -> Claims:
        opened.append(Claims(url))
        return opened[-1]

    yield open_
    for c in opened:
        c.close()


def events(path: Path) -> list[list[str]]:
    """The lines a task wrote, split into words."""
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def first(path: Path, word: str) -> list[str] | None:
    return next((e for e in events(path) if e[0] == word), None)


def wait_event(path: Path, word: str, timeout: float, workers_: tuple[Worker, ...] = ()
               ) -> list[str]:
    def seen() -> list[str] | None:
        for w in workers_:
            if w.proc.poll() is not None:
                raise AssertionError(f"worker {w.name} exited:\n{w.log()[-3000:]}")
        return first(path, word)
    deadline = time.monotonic() + timeout
    while (found := seen()) is None:
        if time.monotonic() > deadline:  # say where the worker stopped, not only that
            recorded = path.read_text() if path.exists() else "(no file)"
            tails = "\n".join(f"--- {w.name}:\n{w.log()[-4000:]}" for w in workers_)
            pytest.fail(f"timed out after {timeout}s waiting for {path.name} to record "
                        f"{word!r}; it holds:\n{recorded}\n{tails}")
        time.sleep(0.02)
    return found


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def log_lines(ws: tuple[Worker, ...], pattern: str) -> list[str]:
    return [ln for w in ws for ln in w.log().splitlines() if re.search(pattern, ln)]


# -- 1. prefetched messages survive SIGKILL ---------------------------------------------------
def _broker_stack(kind: str, request: pytest.FixtureRequest, tmp_path: Path
                  ) -> tuple[str, str, dict[str, Any]]:
    if kind == "embedded":
        broker, conf = filesystem_broker(tmp_path)
        return request.getfixturevalue("sqlite_url"), broker, conf
    url = request.getfixturevalue("rabbitmq_url" if kind == "rabbitmq" else "redis_url")
    return request.getfixturevalue("pg_url"), url, {}


def _held_by_broker(kind: str, env: Env, task_ids: list[str]) -> int:
    """How many of ``task_ids`` the broker still holds (ready or unacknowledged)."""
    if kind == "rabbitmq":
        # Unacknowledged messages of a dead connection are back in the queue by now.
        with Connection(env.broker_url) as conn:
            _, depth, _ = conn.default_channel.queue_declare(env.queue, passive=True)
            return int(depth)
    if kind == "redis":
        import redis

        client = redis.Redis.from_url(env.broker_url)
        try:
            ready = list(client.lrange(env.queue, 0, -1))
            unacked = list(client.hvals("unacked"))
            return sum(1 for m in ready + unacked if any(t.encode() in m for t in task_ids))
        finally:
            client.close()
    folder = Path(env.conf["broker_transport_options"]["data_folder_in"])
    return sum(1 for f in folder.iterdir() if f.name.endswith(f".{env.queue}.msg"))


def _in_broker(kind: str, env: Env, task_id: str) -> bool:
    if kind == "embedded":
        folder = Path(env.conf["broker_transport_options"]["data_folder_in"])
        return any(task_id.encode() in f.read_bytes() for f in folder.iterdir()
                   if f.name.endswith(f".{env.queue}.msg"))
    return _held_by_broker(kind, env, [task_id]) > 0


#: Prefetched (reserved, not started) tasks a -c 1 worker with multiplier 4 ends up
#: holding. The embedded broker has no async transport, so Celery runs its blocking
#: loop and prefork blocks the consumer in ``apply_async`` until a process is free
#: (``pool_putlocks``): it fetches one message beyond the running one, the rest stay
#: in the broker. Plain Celery does the same; nothing is lost either way.
PREFETCHED = {"rabbitmq": 4, "redis": 4, "embedded": 1}


@pytest.mark.parametrize("kind", ["rabbitmq", "redis", "embedded"])
def test_prefetched_messages_survive_sigkill(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path,
        make_env: Callable[..., Env], workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    store, broker, conf = _broker_stack(kind, request, tmp_path)
    env = make_env(store, broker, {**conf, **FAST, "worker_prefetch_multiplier": 4})
    w = workers(env, "pf@%h", concurrency=1).wait_ready()
    store_db = db(store)
    long_path = tmp_path / "long.txt"
    expected = PREFETCHED[kind]
    with producer(env) as client:
        long_id = client.send_task("pulseapp.leased_sleep", args=[60, str(long_path)]).id
        wait_event(long_path, "start", 20, (w,))
        outs = [tmp_path / f"touched-{i}.txt" for i in range(4)]
        rest = [client.send_task("pulseapp.touch", args=[str(p)]).id for p in outs]

    def reserved() -> bool:
        rows = store_db.rows()
        held = [t for t in rest if rows.get(t) is not None and rows[t].state == "reserved"]
        return (len(held) == expected and rows.get(long_id) is not None
                and rows[long_id].state == "running")
    wait_for(reserved, 20, f"the running task and {expected} prefetched one(s) in the claims")
    # The ack follows the reservation's commit; Celery logs "received" right after it.
    held = [t for t in rest if t in store_db.rows()]
    wait_for(lambda: all(f"[{t}] received" in w.log() for t in held), 10,
             "the reserved messages to be acknowledged and handed to Celery")
    w.kill()

    rows = store_db.rows()
    assert rows[long_id].state == "running"
    kept = 0
    for task_id, out in zip(rest, outs, strict=True):
        assert not out.exists()  # never ran
        row = rows.get(task_id)
        if row is None:  # never fetched: still in the broker (embedded only)
            assert _in_broker(kind, env, task_id), f"{task_id} is lost"
            continue
        kept += 1
        assert row.state == "reserved", row
        assert row.holder.startswith("pf@") and row.epoch == 1 and row.attempts == 1
        assert row.task_name == "pulseapp.touch"
        assert json.loads(row.headers)["id"] == task_id
        args, kwargs, _embed = json.loads(bytes(row.body))  # the body as published
        assert args == [str(out)] and kwargs == {}
        assert row.content_type == "application/json"
    assert kept == expected
    # The broker no longer holds the reserved ones: they were acknowledged on
    # reservation. RabbitMQ requeues a dead connection's unacked messages at once,
    # so watch for a moment (bounded observation window).
    reserved_ids = [t for t in rest if t in rows]
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert not any(_in_broker(kind, env, t) for t in reserved_ids)
        assert _held_by_broker(kind, env, rest) == len(rest) - expected
        time.sleep(0.1)


@pytest.mark.parametrize("kind", ["rabbitmq", "redis"])
def test_worker_never_holds_more_than_the_prefetch_limit(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path,
        make_env: Callable[..., Env], workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    """Acking on reservation switches off the broker's prefetch limit: the worker keeps
    ``worker_prefetch_multiplier x concurrency`` reservations. On RabbitMQ further
    deliveries are held unacknowledged (a dead connection's are redelivered at once);
    on Redis, which would keep them until ``visibility_timeout``, the worker stops
    consuming instead and reserves the few already in flight. Either way nothing the
    worker did not reserve stays out of the broker's queue when it dies."""
    store, broker, conf = _broker_stack(kind, request, tmp_path)
    env = make_env(store, broker, {**conf, **FAST, "worker_prefetch_multiplier": 2})
    w = workers(env, "lim@%h", concurrency=2).wait_ready()
    store_db = db(store)
    limit = 2 * 2
    #: Redis: deliveries already fetched when consumption paused (at most its prefetch).
    excess = 0 if kind == "rabbitmq" else limit
    busy = [tmp_path / "busy-1.txt", tmp_path / "busy-2.txt"]
    with producer(env) as client:
        for path in busy:
            client.send_task("pulseapp.leased_sleep", args=[60, str(path)])
        for path in busy:
            wait_event(path, "start", 20, (w,))
        ids = [client.send_task("pulseapp.touch", args=[str(tmp_path / f"t{i}.txt")]).id
               for i in range(12)]

    def reserved() -> int:
        rows = store_db.rows()
        return sum(1 for t in ids if t in rows)
    wait_for(lambda: reserved() >= limit, 20, f"{limit} reservations")
    if kind == "redis":
        w.wait_log(r"stopped consuming \(prefetch limit\)", timeout=10)
        # The deliveries fetched before the pause are reserved (and acked) one by one after
        # the line: wait until none is in flight, every task reserved or ready in the queue.
        wait_for(lambda: reserved() + _ready_in_redis(env, ids) == len(ids), 10,
                 "the deliveries fetched before the pause to be reserved")
    held = reserved()
    assert limit <= held <= limit + excess
    # Bounded observation window: it stays there.
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert reserved() == held
        time.sleep(0.1)
    assert w.proc.poll() is None
    w.kill()
    if kind == "rabbitmq":
        wait_for(lambda: _held_by_broker(kind, env, ids) == len(ids) - held, 15,
                 "every task not reserved to be back in the broker after the worker died")
    else:
        assert _ready_in_redis(env, ids) == len(ids) - held  # none left unacknowledged
    assert reserved() == held


def _ready_in_redis(env: Env, task_ids: list[str]) -> int:
    import redis

    client = redis.Redis.from_url(env.broker_url)
    try:
        return sum(1 for m in client.lrange(env.queue, 0, -1) if any(t.encode() in m
                                                                     for t in task_ids))
    finally:
        client.close()


# -- 2. long tasks are renewed throughout ------------------------------------------------------
@pytest.mark.parametrize("server_url", SERVERS, indirect=True)
def test_task_running_five_lease_ttls_completes_once_under_epoch_1(
        server_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    ttl = 2.0
    env = make_env(server_url, rabbitmq_url, {**FAST, "pulse_lease_ttl": ttl,
                                          "pulse_renew_interval": 0.4})
    w = workers(env, "long@%h").wait_ready()
    store_db = db(server_url)
    path = tmp_path / "long.txt"
    with producer(env) as client:
        task_id = client.send_task("pulseapp.leased_sleep", args=[5 * ttl, str(path)]).id
    wait_for(lambda: store_db.state(task_id) == "succeeded", 5 * ttl + 20,
             "the long task to succeed")
    row = store_db.get(task_id)
    assert (row.epoch, row.attempts) == (1, 1)
    assert row.holder.startswith("long@")
    assert row.started_at is not None and row.finished_at - row.started_at >= 5 * ttl
    assert [e[0] for e in events(path)] == ["start", "end"], events(path)
    assert first(path, "start")[1] == "1" and first(path, "end")[1] == "1"  # type: ignore[index]
    assert "lease lost" not in w.log()


def test_retry_releases_the_claim_and_runs_under_the_next_epoch(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    env = make_env(pg_url, rabbitmq_url, FAST)
    w = workers(env, "retry@%h").wait_ready()
    store_db = db(pg_url)
    path = tmp_path / "retry.txt"
    with producer(env) as client:
        task_id = client.send_task("pulseapp.retry_once", args=[str(path)]).id
    wait_for(lambda: store_db.state(task_id) == "succeeded", 20, "the retried task to succeed")
    assert events(path) == [["attempt", "0", "1"], ["attempt", "1", "2"]], events(path)
    row = store_db.get(task_id)
    # The retry is a new publication of the task id: a new epoch, its own attempt budget.
    assert (row.epoch, row.attempts, row.retries) == (2, 1, 1)
    assert "duplicate delivery" not in w.log()


def test_eta_task_stays_reserved_and_renewed_until_it_runs(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    ttl = FAST["pulse_lease_ttl"]
    env = make_env(pg_url, rabbitmq_url, FAST)
    w = workers(env, "eta@%h").wait_ready()
    store_db = db(pg_url)
    path = tmp_path / "eta.txt"
    countdown = 2 * ttl
    with producer(env) as client:
        sent = time.time()
        task_id = client.send_task("pulseapp.leased_sleep", args=[0.1, str(path)],
                                   countdown=countdown).id
    wait_for(lambda: store_db.state(task_id) == "reserved", 10, "the ETA task's reservation")
    seen: set[float] = set()

    def renewed_until_started() -> bool:
        row = store_db.get(task_id)
        if row.state == "reserved":
            seen.add(row.lease_until)
        return bool(row.state != "reserved")
    wait_for(renewed_until_started, countdown + 10, "the ETA task to start", interval=0.1)
    wait_for(lambda: store_db.state(task_id) == "succeeded", 10, "the ETA task to succeed")
    started = float(wait_event(path, "start", 1)[3])
    assert started - sent >= countdown - 0.5, (sent, started)
    assert len(seen) >= 3, f"the reservation was not renewed while held: {seen}"
    row = store_db.get(task_id)
    assert (row.epoch, row.attempts) == (1, 1)
    assert [e[0] for e in events(path)] == ["start", "end"]
    assert "lease lost" not in w.log()


# -- 3. Redis visibility_timeout no longer causes a second execution ---------------------------
def test_redis_visibility_timeout_does_not_rerun_and_republish_is_dropped(
        pg_url: str, redis_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    visibility = 5
    # Restore sweeps every second, so an unacknowledged message would come back
    # ~visibility_timeout after delivery (kombu's default sweep is every 100 s).
    transport = {"visibility_timeout": visibility, "unacked_restore_interval": 1,
                 "unacked_restore_throttle": 1}
    env = make_env(pg_url, redis_url, {**FAST, "broker_transport_options": transport})
    ws = (workers(env, "va@%h"), workers(env, "vb@%h"))
    for w in ws:
        w.wait_ready()
    store_db = db(pg_url)
    path = tmp_path / "late.txt"
    seconds = 3 * visibility
    dup = r"duplicate delivery of pulseapp\.late_sleep\[{}\]"
    with producer(env) as client:
        task_id = client.send_task("pulseapp.late_sleep", args=[seconds, str(path)]).id
        wait_event(path, "start", 20, ws)
        # Acknowledged on reservation: not among Redis's unacked messages.
        assert _held_by_broker("redis", env, [task_id]) == 0
        # A copy of the same publication (as a redelivery would be; send_task would make a
        # new publication of the id, which runs after this one).
        publication = store_db.get(task_id).publication
        publish_raw(client, env.queue, "pulseapp.late_sleep", [seconds, str(path)], task_id,
                    publication)
        wait_for(lambda: log_lines(ws, dup.format(task_id)), 15,
                 "the re-publish during the run to be dropped as a duplicate")
        wait_for(lambda: store_db.state(task_id) == "succeeded", seconds + 20,
                 "the acks_late task to succeed")
        # Over the whole run (3 x visibility_timeout) nothing but our re-publish came back.
        assert len(log_lines(ws, dup.format(task_id))) == 1
        publish_raw(client, env.queue, "pulseapp.late_sleep", [seconds, str(path)], task_id,
                    publication)
        wait_for(lambda: len(log_lines(ws, dup.format(task_id))) == 2, 15,
                 "the re-publish after the run to be dropped as a duplicate")
    assert [e[0] for e in events(path)] == ["start", "end"], events(path)
    during, after = sorted(log_lines(ws, dup.format(task_id)))  # log lines start with the time
    assert "already held by this worker" in during or "(running)" in during, during
    assert "already finished (succeeded)" in after, after
    row = store_db.get(task_id)
    assert (row.state, row.epoch, row.attempts) == ("succeeded", 1, 1)
    assert _held_by_broker("redis", env, [task_id]) == 0


# -- 4. a paused holder is fenced ------------------------------------------------------------------
def _take_over(store_db: Claims, task_id: str, expired_only: bool = True) -> int:
    """Grant the claim to someone else the way Recover would: epoch + 1, new token."""
    cond = f"AND lease_until <= {store_db.now}" if expired_only else ""
    taken = store_db.execute(
        f"UPDATE pulse_claims SET epoch = epoch + 1, holder = 'thief', token = :tok, "
        f"lease_until = {store_db.now} + 60 WHERE task_id = :tid {cond}",
        tok="x" * 32, tid=task_id).rowcount
    assert taken == 1, "the claim could not be taken over"
    return int(store_db.get(task_id).epoch)


@pytest.mark.parametrize("server_url", SERVERS, indirect=True)
@pytest.mark.parametrize("paused", [True, False], ids=["sigstop", "live"])
def test_taken_over_holder_gets_lease_lost_and_its_fenced_writes_are_rejected(
        paused: bool, server_url: str, rabbitmq_url: str, tmp_path: Path,
        make_env: Callable[..., Env], workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    """``sigstop``: the whole worker is paused past the lease TTL and the claim is granted
    to someone else meanwhile. ``live``: the claim is taken over while the task runs, so
    until the next renewal only the store-side check of ``lease.fenced`` stands between
    the stale holder (writing every 50 ms) and the table."""
    env = make_env(server_url, rabbitmq_url, FAST)
    store_db = db(server_url)
    table = "fence_rows_" + uuid.uuid4().hex[:8]
    store_db.execute(f"CREATE TABLE {table} (task_id text, epoch bigint, seq int)")

    def rows_written() -> int:
        return int(store_db.execute(f"SELECT count(*) FROM {table}").scalar_one())

    w = workers(env, "fenced@%h").wait_ready()
    path = tmp_path / "fenced.txt"
    with producer(env) as client:
        task_id = client.send_task("pulseapp.fenced_writer", args=[str(path), table, 60]).id
    wait_event(path, "start", 20, (w,))
    wait_for(lambda: rows_written() >= 3, 10, "fenced writes while the lease holds")

    if paused:
        w.signal(signal.SIGSTOP)
        # Past the lease TTL, the store sees the lease expired (store clock) ...
        wait_for(lambda: store_db.execute(
            f"SELECT lease_until <= {store_db.now} AS expired FROM pulse_claims WHERE task_id = :t",
            t=task_id).scalar_one(), FAST["pulse_lease_ttl"] + 5, "the lease to expire")
    # ... and someone else is granted the task. (If the child was stopped inside a
    # fenced block, this waits until the block's transaction times out: <= TTL.)
    assert _take_over(store_db, task_id, expired_only=paused) == 2
    # Every row committed so far was written under a valid lease; none may follow.
    before = rows_written()
    resumed = time.time()
    if paused:
        w.signal(signal.SIGCONT)

    lost = wait_event(path, "lost", FAST["pulse_renew_interval"] + 5, (w,))
    assert float(lost[1]) - resumed <= FAST["pulse_renew_interval"] + 1, (lost, resumed)
    w.wait_log(rf"lease lost for task {task_id} epoch 1")
    # The task ended on LeaseLost; not one row landed after the takeover.
    assert rows_written() == before
    assert store_db.execute(f"SELECT count(*) FROM {table} WHERE epoch <> 1").scalar_one() == 0
    assert first(path, "end") is None
    row = store_db.get(task_id)
    assert (row.holder, row.epoch, row.token) == ("thief", 2, "x" * 32)  # not overwritten
    assert w.proc.poll() is None


def test_task_ignoring_lease_lost_is_hard_stopped_and_worker_goes_on(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    env = make_env(pg_url, rabbitmq_url, FAST)
    store_db = db(pg_url)
    w = workers(env, "hard@%h").wait_ready()
    path = tmp_path / "stubborn.txt"
    marker = tmp_path / "after.txt"
    grace, interval = FAST["pulse_revoke_grace"], FAST["pulse_renew_interval"]
    with producer(env) as client:
        task_id = client.send_task("pulseapp.stubborn", args=[str(path), 30]).id
        pid = int(wait_event(path, "start", 20, (w,))[1])
        wait_for(lambda: store_db.state(task_id) == "running", 10, "the claim to be running")
        _take_over(store_db, task_id, expired_only=False)
        ignored = float(wait_event(path, "ignored", interval + 5, (w,))[1])
        wait_for(lambda: not pid_alive(pid), grace + interval + 5, "the child to be killed")
        gone = time.time()
        ticks = [float(e[1]) for e in events(path) if e[0] == "tick"]
        # It kept running for the grace period, then was stopped (not before, not long after).
        assert ticks[-1] - ignored >= grace - 0.5, (ignored, ticks[-1])
        assert gone - ignored <= grace + interval + 1.5, (ignored, gone)
        assert first(path, "end") is None
        w.wait_log(rf"task {task_id} epoch 1 ignored LeaseLost")
        # The pool replaced the child: the worker serves the next task.
        client.send_task("pulseapp.touch", args=[str(marker)])
        wait_for(marker.exists, 20, "the next task to run after the hard stop")
    assert first(path, "end") is None
    assert w.proc.poll() is None
    assert store_db.get(task_id).holder == "thief"


def test_reservation_lost_while_waiting_is_dropped_not_run(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    env = make_env(pg_url, rabbitmq_url, FAST)
    store_db = db(pg_url)
    w = workers(env, "drop@%h").wait_ready()
    path, marker, after = tmp_path / "busy.txt", tmp_path / "dropped.txt", tmp_path / "after.txt"
    with producer(env) as client:
        busy_id = client.send_task("pulseapp.leased_sleep", args=[4, str(path)]).id
        wait_event(path, "start", 20, (w,))
        task_id = client.send_task("pulseapp.touch", args=[str(marker)]).id
        wait_for(lambda: store_db.state(task_id) == "reserved", 10, "the reservation")
        _take_over(store_db, task_id, expired_only=False)
        w.wait_log(rf"lease lost for task {task_id} epoch 1 .*was reserved", timeout=5)
        # When the pool frees up the lost reservation is dropped instead of run.
        wait_for(lambda: store_db.state(busy_id) == "succeeded", 20, "the busy task to finish")
        w.wait_log(rf"task {task_id} epoch 1 dropped, not run", timeout=10)
        client.send_task("pulseapp.touch", args=[str(after)])
        wait_for(after.exists, 20, "the next task to run")
    assert not marker.exists()
    assert "hard stop" not in w.log() and "SIGKILL" not in w.log()
    row = store_db.get(task_id)
    assert (row.holder, row.epoch, row.state) == ("thief", 2, "reserved")


# -- 5. store outage: self-fence before the store could re-grant -------------------------------
def _audit_leases(store_db: Claims) -> None:
    """Keep every lease_until the store ever grants in ``lease_audit`` (Recover may
    rewrite the claim row later)."""
    store_db.execute("CREATE TABLE lease_audit (task_id varchar(255), epoch bigint, "
                     "holder varchar(255), lease_until double precision)")
    insert = ("INSERT INTO lease_audit VALUES (NEW.task_id, NEW.epoch, NEW.holder, "
              "NEW.lease_until)")
    if store_db.engine.dialect.name == "postgresql":
        store_db.execute("CREATE FUNCTION audit_lease() RETURNS trigger LANGUAGE plpgsql "
                         f"AS $$ BEGIN {insert}; RETURN NEW; END $$")
        store_db.execute("CREATE TRIGGER audit_lease AFTER INSERT OR UPDATE ON pulse_claims "
                         "FOR EACH ROW EXECUTE FUNCTION audit_lease()")
    else:  # MySQL/MariaDB: one trigger per event, the body a single statement
        for event in ("INSERT", "UPDATE"):
            store_db.execute(f"CREATE TRIGGER audit_lease_{event.lower()} AFTER {event} "
                             f"ON pulse_claims FOR EACH ROW {insert}")


@pytest.mark.parametrize("private_server", list(PRIVATE_SERVERS), indirect=True)
def test_store_outage_self_fences_running_task_and_pauses_intake(
        private_server: PrivateServer, rabbitmq_url: str, tmp_path: Path,
        make_env: Callable[..., Env], workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:
    ttl = FAST["pulse_lease_ttl"]
    env = make_env(private_server.url, rabbitmq_url, FAST)
    store_db = db(private_server.url)
    _audit_leases(store_db)
    w = workers(env, "outage@%h").wait_ready()
    path = tmp_path / "watched.txt"
    marker = tmp_path / "meanwhile.txt"
    with producer(env) as client:
        task_id = client.send_task("pulseapp.leased_sleep", args=[60, str(path)]).id
        wait_event(path, "start", 20, (w,))
        wait_for(lambda: store_db.state(task_id) == "running", 10, "the claim to be running")
        private_server.stop()
        stopped = time.time()
        # Delivered while the store is down: it cannot be reserved, so it is neither
        # acknowledged nor run, and the worker stops consuming.
        client.send_task("pulseapp.touch", args=[str(marker)])
        lost = float(wait_event(path, "lost", ttl + 5, (w,))[1])
        w.wait_log(r"stopped consuming", timeout=FAST["pulse_worker_ttl"] + 5)
        w.wait_log(r"cannot reserve tasks .*not acknowledging", timeout=5)
        # Bounded observation window: while the store is down the task must not run.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert not marker.exists()
            time.sleep(0.1)
        private_server.start()
        wait_for(marker.exists, 40, "the task sent during the outage to run")
    granted = store_db.execute(
        "SELECT max(lease_until) FROM lease_audit WHERE task_id = :t AND epoch = 1",
        t=task_id).scalar_one()
    # LeaseLost came before the store could consider the lease expired: the last
    # lease_until it granted (store clock = this host's clock) was still ahead.
    assert lost < granted, (lost, granted)
    assert lost - stopped <= ttl, (stopped, lost)
    assert first(path, "end") is None
    assert w.proc.poll() is None


# -- 6. warm shutdown under load: every task runs once, none goes to review --------------------
def test_warm_shutdown_under_load_runs_or_releases_every_task(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims]) -> None:
    # Jobs are started (running) before they reach a pool process; a worker that stops
    # in between must give them back as never run, or Recover would send these
    # default-acks tasks to review although they never started.
    env = make_env(pg_url, rabbitmq_url, FAST)
    store_db = db(pg_url)
    w = workers(env, "warm@%h", concurrency=2).wait_ready()
    outs = [tmp_path / f"task-{i}.txt" for i in range(300)]
    with producer(env) as client:
        ids = [client.send_task("pulseapp.sleep", args=[0.01, str(p)]).id for p in outs]
        wait_for(lambda: sum(p.exists() for p in outs) >= 40, 30, "some tasks to run")
        w.signal_main(signal.SIGTERM)
        assert w.wait(60) == 0, w.log()[-3000:]
        workers(env, "after@%h", concurrency=2).wait_ready()

        def settled() -> bool:
            rows = store_db.rows()
            return all(rows.get(t) is not None and rows[t].state in ("succeeded", "needs_review")
                       for t in ids)
        wait_for(settled, 90, "every task to be settled by the second worker")
    rows = store_db.rows()
    ran = {t: events(p) for t, p in zip(ids, outs, strict=True)}
    # Every task started exactly once: never twice, and none left unrun. A job that
    # never reached a pool process was given back and run by the second worker; only
    # a job that was in the pool when the first worker stopped (its end unseen by the
    # parent, so it may have run) may wait in review, having run once.
    assert {t: e for t, e in ran.items() if e.count(["start"]) != 1} == {}
    assert [t for t in ids if rows[t].state not in ("succeeded", "needs_review")] == []
    reviewed = [t for t in ids if rows[t].state == "needs_review"]
    assert len(reviewed) <= 2, reviewed  # at most one job per pool process (-c 2)
