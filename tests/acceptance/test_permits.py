"""Cluster-wide concurrency permits with real ``celery worker -P pulse`` processes (issue 19).

Workers run :mod:`tests.apps.permitapp`. Every task body journals its start and end
(task, id, permit key, lease epoch, worker, pid, a per-execution marker and
``time.time()``, all workers on this host: one clock) into a file of the test's own, so
a test rebuilds the history of executions and computes how many of a kind ran at
once. The store is read with its own API (``permit_usage()``) and, for the claims'
states, epochs and leases, with SQL. PostgreSQL + RabbitMQ unless a test says otherwise.

How many ran at once: each execution is the interval from its ``start`` line to its
``end`` line, both written inside the body. A start is authorised by the store before
the body runs, and the permit is given back by the completion, which follows the body's
``end``; so if the store never let more than N hold a key, the body intervals never
overlap more than N deep. An execution that never wrote its ``end`` (its worker was
SIGKILLed) is counted until its permit could first have been given back: the lease
it held, as the store last granted it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_pulse.store.base import Grant, Permit, PermitUsage
from celery_pulse.store.sql import SqlStore, open_store
from tests.contract import test_claims_contract as contract
from tests.helpers.services import cut_vhost_connections, private_vhost, tidy_queue
from tests.helpers.workers import Env, Worker, assert_alive, wait_alive

APP = "tests.apps.permitapp"
LIMITED, FREE, PER_CUSTOMER, GATED = ("permitapp.limited", "permitapp.free",
                                      "permitapp.per_customer", "permitapp.gated")
#: Short leases, frequent Recover scans (the fault tests: SIGKILL, SIGSTOP).
FAST: dict[str, Any] = {"pulse_lease_ttl": 3, "pulse_renew_interval": 0.5,
                        "pulse_recover_interval": 0.5, "pulse_worker_ttl": 3,
                        "pulse_heartbeat_interval": 0.5, "pulse_revoke_grace": 2}
#: From a worker's death to Recover's takeover of its claims (see test_recover.py).
BOUND = FAST["pulse_lease_ttl"] + FAST["pulse_recover_interval"] + 1.0
#: Process-scheduling slack on top of BOUND (a 2-core machine running 2-3 workers).
SLACK = 2.0


def task_key(name: str) -> str:
    return f"task:{name}"


# -- the journal ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    name: str
    task_id: str
    key: str
    epoch: int
    host: str
    pid: int
    attempt: str
    at: float


@dataclasses.dataclass
class Run:
    """One execution of a body: its start and (if it got there) its end."""

    start: Event
    end: Event | None = None

    @property
    def task_id(self) -> str:
        return self.start.task_id


def read_journal(path: Path) -> list[Event]:
    """The journal's complete lines (a line being written right now is left out)."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if text and not text.endswith("\n"):
        lines = lines[:-1]
    found = []
    for line in lines:
        kind, name, task_id, key, epoch, host, pid, attempt, at = line.split()
        found.append(Event(kind, name, task_id, key, int(epoch), host, int(pid), attempt,
                           float(at)))
    return found


def runs(path: Path, name: str | None = None) -> list[Run]:
    """Executions in the journal (of task ``name``), in the order they started."""
    by_attempt: dict[str, Run] = {}
    for event in read_journal(path):
        if name is not None and event.name != name:
            continue
        if event.kind == "start":
            assert event.attempt not in by_attempt, f"two starts of one execution: {event}"
            by_attempt[event.attempt] = Run(event)
        else:
            run = by_attempt.get(event.attempt)
            assert run is not None and run.end is None, f"an end without its start: {event}"
            run.end = event
    return sorted(by_attempt.values(), key=lambda r: r.start.at)


def ended(path: Path, name: str) -> int:
    return sum(1 for e in read_journal(path) if e.kind == "end" and e.name == name)


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """How many intervals were open at once, at most. An end at the very instant of a
    start counts as before it (the permit went back before the next start took it)."""
    edges = sorted((t, delta) for start, end in intervals for t, delta in ((start, 1),
                                                                         (end, -1)))
    depth = deepest = 0
    for _, delta in edges:
        depth += delta
        deepest = max(deepest, depth)
    return deepest


def closed(run: Run, open_until: dict[str, float] | None = None) -> tuple[float, float]:
    """The run's interval; one without an end is held until ``open_until[attempt]``."""
    if run.end is not None:
        return run.start.at, run.end.at
    assert open_until is not None and run.start.attempt in open_until, \
        f"execution without an end: {run}"
    return run.start.at, open_until[run.start.attempt]


# -- the store --------------------------------------------------------------------------------
def usage(store: SqlStore, key: str) -> PermitUsage | None:
    return next((u for u in store.permit_usage() if u.key == key), None)


def claim_rows(store_url: str, ids: Iterable[str] | None = None) -> dict[str, Any]:
    engine = sa.create_engine(store_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = {r.task_id: r for r in conn.execute(sa.text(
                "SELECT task_id, state, epoch, holder, lease_until FROM pulse_claims"))}
    finally:
        engine.dispose()
    return rows if ids is None else {t: rows[t] for t in ids if t in rows}


def all_in_state(store_url: str, ids: list[str], state: str) -> bool:
    rows = claim_rows(store_url, ids)
    return len(rows) == len(ids) and all(r.state == state for r in rows.values())


class Sampler:
    """Samples ``permit_usage()`` for one key every 20 ms in a thread of the test, with
    a store of its own: what the store showed while the test went on."""

    def __init__(self, store_url: str, key: str) -> None:
        self.store = open_store(store_url, check_schema=False)
        self.key = key
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="permit-sampler", daemon=True)
        self.error: BaseException | None = None

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                found = usage(self.store, self.key)
                if found is not None:
                    self.samples.append((time.time(), found.running, found.waiting))
                self._stop.wait(0.02)
        except BaseException as exc:  # reported by max_running()
            self.error = exc

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.store.close()

    def max_running(self, since: float = 0.0) -> int:
        assert self.error is None, f"the sampler failed: {self.error!r}"
        return max((r for at, r, _ in self.samples if at >= since), default=0)


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture
def penv(make_env: Callable[..., Env]) -> Callable[..., Env]:
    """Like ``make_env`` (store migrated), for the permitapp."""
    def factory(store_url: str, broker_url: str, conf: dict[str, Any] | None = None) -> Env:
        env = make_env(store_url, broker_url, conf)
        env.app = APP
        return env
    return factory


class Cluster:
    """Starts workers (``workers`` fixture); queues of a worker's own are deleted at
    teardown after every worker is dead (a queue deleted under a live consumer would
    be declared again by it)."""

    def __init__(self, start: Callable[..., Worker]) -> None:
        self._start = start
        self.started: list[Worker] = []
        self.side_queues: list[tuple[str, str]] = []

    def worker(self, env: Env, name: str, concurrency: int = 1, **kwargs: Any) -> Worker:
        w = self._start(env, name, concurrency=concurrency, **kwargs)
        self.started.append(w)
        return w

    def ready(self, *started: Worker) -> None:
        for w in started:
            w.wait_ready(60)

    def side_env(self, env: Env, suffix: str) -> Env:
        """``env`` on a queue of its own (``<queue>-<suffix>``)."""
        queue = f"{env.queue}-{suffix}"
        self.side_queues.append((env.broker_url, queue))
        return Env(env.store_url, env.broker_url, queue, env.tmp, env.conf, app=env.app)

    def close(self) -> None:
        for w in self.started:
            w.kill()
        for broker, queue in self.side_queues:
            tidy_queue(broker, queue)


@pytest.fixture
def cluster(workers: Callable[..., Worker]) -> Iterator[Cluster]:
    made = Cluster(workers)
    yield made
    made.close()


@contextlib.contextmanager
def producer(env: Env) -> Iterator[Celery]:
    app = Celery("permit-client", broker=env.broker_url, set_as_current=False)
    app.conf.task_default_queue = env.queue
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def store_of() -> Iterator[Callable[[str], SqlStore]]:
    opened: list[SqlStore] = []

    def open_(url: str) -> SqlStore:
        opened.append(open_store(url, check_schema=False))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


def store_param(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue({"postgres": "pg_url", "sqlite": "sqlite_url",
                                        "pgb-session": "pgb_session_url",
                                        "pgb-transaction": "pgb_transaction_url"}
                                       [request.param])
    return url


@pytest.fixture(params=["postgres", "sqlite", "pgb-transaction"])
def either_store(request: pytest.FixtureRequest) -> str:
    """The PostgreSQL store, a SQLite one, and PostgreSQL through PgBouncer in transaction
    mode (no LISTEN: waiters poll) (all with RabbitMQ)."""
    return store_param(request)


@pytest.fixture(params=["postgres", "pgb-session", "pgb-transaction"])
def pg_or_pooled(request: pytest.FixtureRequest) -> str:
    """PostgreSQL, directly and through PgBouncer in session and in transaction mode."""
    return store_param(request)


# -- 1. a limited kind on three workers: never more than the limit, others flow -----------------
def test_limit_holds_across_three_workers_and_unlimited_tasks_flow(
        either_store: str, rabbitmq_url: str, tmp_path: Path, penv: Callable[..., Env],
        cluster: Cluster, store_of: Callable[[str], SqlStore]) -> None:
    """3 workers x ``-c 4``; 200 tasks limited to 2 (``pulse_concurrency=2``) of 20 ms and
    200 unlimited ones of 10 ms, published interleaved (the issue's numbers). Passes if
    the history never shows more than 2 limited bodies at once and does show 2 (the
    limit was reached, so the check proves something), every task ran exactly once, and
    every unlimited task had ended before half of the limited ones had: they were not
    queued behind them."""
    N = 200  # of each kind
    env = penv(either_store, rabbitmq_url)
    store = store_of(either_store)
    journal = tmp_path / "journal.txt"
    ws = tuple(cluster.worker(env, f"w{i}@%h", concurrency=4) for i in range(3))
    cluster.ready(*ws)
    began = time.monotonic()
    with producer(env) as client:
        ids: dict[str, list[str]] = {LIMITED: [], FREE: []}
        for _ in range(N):
            ids[LIMITED].append(client.send_task(LIMITED, (str(journal), 0.02)).id)
            ids[FREE].append(client.send_task(FREE, (str(journal), 0.01)).id)
    wait_alive(lambda: ended(journal, LIMITED) == N and ended(journal, FREE) == N, 120,
               f"all {2 * N} tasks to end", ws)
    wait_alive(lambda: all_in_state(either_store, ids[LIMITED] + ids[FREE], "succeeded"),
               30, "every claim to succeed", ws)
    elapsed = time.monotonic() - began

    limited, free = runs(journal, LIMITED), runs(journal, FREE)
    assert sorted(r.task_id for r in limited) == sorted(ids[LIMITED])  # each exactly once
    assert sorted(r.task_id for r in free) == sorted(ids[FREE])
    deepest = max_overlap(closed(r) for r in limited)
    assert deepest == 2, f"at most 2 limited tasks may run at once; the history shows {deepest}"
    hosts = {r.start.host for r in limited}
    half_done = sorted(r.end.at for r in limited if r.end)[N // 2 - 1]
    last_free = max(r.end.at for r in free if r.end)
    print(f"\n[{either_store.split(':')[0]}] {2 * N} tasks in {elapsed:.2f}s; limited ran on "
          f"{len(hosts)} worker(s); last unlimited end {last_free - limited[0].start.at:.3f}s "
          f"after the first limited start, half the limited done at "
          f"{half_done - limited[0].start.at:.3f}s")
    assert last_free < half_done, "unlimited tasks waited behind the limited kind"
    assert usage(store, task_key(LIMITED)) == PermitUsage(task_key(LIMITED), 2, 0, 0)
    for w in ws:
        assert "Traceback" not in w.log(), w.log()[-3000:]


# -- 2. per-key limits -------------------------------------------------------------------------
def test_per_key_limit_holds_per_key_and_keys_run_side_by_side(
        pg_or_pooled: str, rabbitmq_url: str, tmp_path: Path, penv: Callable[..., Env],
        cluster: Cluster, store_of: Callable[[str], SqlStore]) -> None:
    """``pulse_concurrency=1`` with ``pulse_concurrency_key`` on ``kwargs["customer"]``:
    10 tasks for each of 5 customers on 2 workers x ``-c 4``. Passes if no customer ever
    has two bodies running at once, different customers do run at the same time, each
    task runs once, and the store knows one limit per customer, all free at the end.
    Directly and through PgBouncer in both modes."""
    pg_url = pg_or_pooled
    env = penv(pg_url, rabbitmq_url)
    store = store_of(pg_url)
    journal = tmp_path / "journal.txt"
    ws = tuple(cluster.worker(env, f"k{i}@%h", concurrency=4) for i in range(2))
    cluster.ready(*ws)
    with producer(env) as client:
        ids = [client.send_task(PER_CUSTOMER, (str(journal), 0.05), {"customer": i % 5}).id
               for i in range(50)]
    wait_alive(lambda: ended(journal, PER_CUSTOMER) == 50, 90, "all 50 tasks to end", ws)
    wait_alive(lambda: all_in_state(pg_url, ids, "succeeded"), 30, "every claim to succeed", ws)

    history = runs(journal, PER_CUSTOMER)
    assert sorted(r.task_id for r in history) == sorted(ids)
    for customer in map(str, range(5)):
        mine = [r for r in history if r.start.key == customer]
        assert len(mine) == 10
        deepest = max_overlap(closed(r) for r in mine)
        assert deepest == 1, f"customer {customer}: {deepest} ran at once (limit 1)"
    across = max_overlap(closed(r) for r in history)
    print(f"\nper-key: up to {across} customers ran at once")
    assert across >= 2, "different keys never ran at the same time"
    expected = [PermitUsage(f"{task_key(PER_CUSTOMER)}[{c}]", 1, 0, 0) for c in range(5)]
    assert [u for u in store.permit_usage() if u.key.startswith(task_key(PER_CUSTOMER))] \
        == expected


# -- 3. SIGKILL: the permits come back with Recover's takeover ------------------------------
def test_permits_of_a_killed_worker_come_back_with_recover(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, penv: Callable[..., Env],
        cluster: Cluster, store_of: Callable[[str], SqlStore]) -> None:
    """Limit 2 (``pulse_concurrency_limits``); worker A runs two long ``acks_late`` tasks,
    four short ones wait for the permits (on A or B). A is SIGKILLed. Passes if Recover
    takes A's two claims over within ``lease_ttl + recover_interval + 1`` s (+ slack),
    every task then ends on B (the two killed ones re-run), the history never shows more
    than 2 at once when A's two executions are counted until their leases ran out (so no
    permit came back before the store could take it back), and no permit is left held
    or waited for at the end."""
    env = penv(pg_url, rabbitmq_url, {**FAST, "pulse_concurrency_limits": {GATED: 2}})
    store = store_of(pg_url)
    journal, gates = tmp_path / "journal.txt", tmp_path / "gates"
    gates.mkdir()
    a = cluster.worker(env, "a@%h", concurrency=4)
    cluster.ready(a)
    with producer(env) as client:
        held = [client.send_task(GATED, (str(journal), str(gates), 60)).id for _ in range(2)]
        wait_alive(lambda: {r.task_id for r in runs(journal, GATED)} == set(held), 20,
                   "both long tasks to start on A", (a,))
        b = cluster.worker(env, "b@%h", concurrency=4)
        cluster.ready(b)
        waiting = [client.send_task(GATED, (str(journal), str(gates), 0.3)).id
                   for _ in range(4)]
    key = task_key(GATED)
    wait_alive(lambda: usage(store, key) == PermitUsage(key, 2, 2, 4), 20,
               "2 running and 4 waiting for the permits", (a, b))
    assert {r.start.host.split("@")[0] for r in runs(journal, GATED)} == {"a"}

    a.kill()
    killed = time.time()
    # The lease each of A's executions held as the store last granted it: its permit
    # cannot come back before that.
    lease_of = {t: float(r.lease_until) for t, r in claim_rows(pg_url, held).items()}
    wait_alive(lambda: all(r.epoch >= 2 for r in claim_rows(pg_url, held).values()),
               BOUND + SLACK + 10, "Recover to take A's two claims over", (b,), interval=0.02)
    delay = time.time() - killed
    print(f"\nkill -> both claims taken over: {delay:.3f}s (bound {BOUND}s + {SLACK}s slack)")
    assert delay <= BOUND + SLACK, delay
    (gates / "all").touch()  # the re-runs of the long ones end at once
    wait_alive(lambda: all_in_state(pg_url, held + waiting, "succeeded"), 30,
               "every task to succeed on B", (b,))

    history = runs(journal, GATED)
    killed_runs = [r for r in history if r.end is None]
    assert sorted(r.task_id for r in killed_runs) == sorted(held)
    assert all(r.start.host.startswith("a@") and r.start.epoch == 1 for r in killed_runs)
    open_until = {r.start.attempt: lease_of[r.task_id] for r in killed_runs}
    deepest = max_overlap(closed(r, open_until) for r in history)
    assert deepest == 2, f"{deepest} ran at once (limit 2): {history}"
    finished = [r for r in history if r.end is not None]
    assert sorted(r.task_id for r in finished) == sorted(held + waiting)  # once each
    assert all(r.start.host.startswith("b@") for r in finished)
    first_after = min(r.start.at for r in finished)
    print(f"first start on B {first_after - killed:.3f}s after the kill; leases ran out "
          f"{min(lease_of.values()) - killed:.3f}s after it")
    # A waiter on B learns of a permit freed by another worker's Recover at its next
    # retry (backoff at most 1 s).
    assert first_after - killed <= BOUND + SLACK + 1.0, first_after - killed
    assert usage(store, key) == PermitUsage(key, 2, 0, 0)


# -- 4. a paused holder: its stale completion frees nothing ---------------------------------
@pytest.mark.parametrize("pause", ["worker", "main"])
def test_stale_completion_of_a_paused_worker_frees_no_permit(
        pause: str, pg_url: str, rabbitmq_url: str, tmp_path: Path, penv: Callable[..., Env],
        cluster: Cluster, store_of: Callable[[str], SqlStore]) -> None:
    """Limit 1. A runs T1; B (on a queue of its own) holds T2 and T3, waiting for the
    permit. A is SIGSTOPped past its lease and Recover (B's) takes T1 over (re-dispatched:
    ``acks_late``); the permit goes to one of B's tasks (X). Then T1's first execution is
    let finish and A is resumed (SIGCONT): that execution is stale.

    ``worker``: the whole worker is paused (main process and pool), as a frozen VM
    would be. ``main``: only its main process; the body ends during the pause, its
    result waiting in the pool's pipe. On resuming, A's watchdog finds the lease past its
    local deadline and may stop the body or drop its result first (no completion sent),
    or the completion may reach the store first (kept as evidence only): a race, and
    both are stale; neither may give a permit back.

    Passes if neither B's other task nor T1's re-run (reserved by A, waiting too) starts
    while X runs, a sampler of ``permit_usage()`` never sees more than 1 running, B's
    tasks kept their first reservation while waiting, a completion that reached the
    store is kept as evidence only, and at the end every task succeeded and the permit
    is free."""
    env = penv(pg_url, rabbitmq_url, {**FAST, "pulse_concurrency_limits": {GATED: 1}})
    store = store_of(pg_url)
    key = task_key(GATED)
    journal, gates = tmp_path / "journal.txt", tmp_path / "gates"
    gates.mkdir()
    a = cluster.worker(env, "a@%h", concurrency=1)
    b_env = cluster.side_env(env, "b")
    b = cluster.worker(b_env, "b@%h", concurrency=2)
    cluster.ready(a, b)
    with Sampler(pg_url, key) as sampler, producer(env) as client:
        t1 = client.send_task(GATED, (str(journal), str(gates), 60)).id
        wait_alive(lambda: any(r.task_id == t1 for r in runs(journal, GATED)), 20,
                   "T1 to start on A", (a, b))
        on_b = [client.send_task(GATED, (str(journal), str(gates), 60), queue=b_env.queue).id
                for _ in range(2)]
        wait_alive(lambda: usage(store, key) == PermitUsage(key, 1, 1, 2), 20,
                   "B's two tasks to wait for the permit", (a, b))

        paused = time.time()
        (a.signal if pause == "worker" else a.signal_main)(signal.SIGSTOP)
        wait_alive(lambda: claim_rows(pg_url, [t1])[t1].epoch >= 2, BOUND + SLACK + 10,
                   "Recover to take T1 over", (b,), interval=0.02)
        print(f"\n{pause} -> T1 taken over: {time.time() - paused:.3f}s")
        x_run = wait_alive(lambda: next((r for r in runs(journal, GATED)
                                         if r.task_id in on_b), None), 10,
                           "one of B's tasks to get the permit", (b,))
        x = x_run.task_id
        (y,) = set(on_b) - {x}
        assert x_run.start.host.startswith("b@")

        # T1's first execution finishes (its lease long gone) and A runs on: either its
        # completion reaches the store, which keeps it as evidence only, or A's watchdog
        # finds the lease past its deadline first and stops the body (LeaseLost, no
        # completion). Both are stale; neither may give a permit back.
        (gates / f"{t1}.1").touch()

        def stale_ended() -> Run | None:
            return next((r for r in runs(journal, GATED) if r.task_id == t1
                         and r.start.epoch == 1 and r.end), None)
        if pause == "main":  # the pool runs on: the body ends while the parent is paused
            wait_alive(stale_ended, 10, "T1's stale execution to end", (a, b))
        a.signal(signal.SIGCONT)
        resumed = time.time()
        stale = wait_alive(stale_ended, 15, "T1's stale execution to end", (a, b))
        assert stale.end is not None
        a.wait_log(rf"late outcome \S+ for task {t1} epoch 1 kept as evidence"
                   rf"|lease lost for task {t1} epoch 1", 15)
        # T1 re-dispatched to A's queue: reserved by A, it waits for the permit as well.
        wait_alive(lambda: usage(store, key) == PermitUsage(key, 1, 1, 2), 15,
                   "T1's re-run and B's other task to wait for the permit", (a, b))
        # Observation window: longer than the waiters' longest backoff (1 s) plus a few
        # renewals, so a permit wrongly given back would have been taken by now.
        window_end = time.monotonic() + 3.0
        while time.monotonic() < window_end:
            assert_alive(a, b)
            history = runs(journal, GATED)
            assert y not in {r.task_id for r in history}, \
                "B's other task started while X held the permit"
            assert not [r for r in history if r.task_id == t1 and r.start.epoch > 1], \
                "T1's re-run started while X held the permit"
            time.sleep(0.05)
        assert usage(store, key) == PermitUsage(key, 1, 1, 2)
        assert claim_rows(pg_url, [x])[x].state == "running"

        (gates / "all").touch()
        wait_alive(lambda: all_in_state(pg_url, [t1, *on_b], "succeeded"), 40,
                   "every task to succeed", (a, b))
        assert sampler.max_running() == 1, sampler.samples
        assert sampler.max_running(since=resumed) == 1

    late = _evidence(pg_url, t1)
    path = ("its completion kept as evidence" if late else "its result dropped by A"
            if stale.end.kind == "end" else "stopped by LeaseLost")
    print(f"T1's stale execution: {stale.end.kind}, {path} {late}")
    print("\n".join(ln for ln in a.log().splitlines() if t1 in ln and "pulse:" in ln))
    if late:
        assert stale.end.kind == "end", stale
        assert late == [(1, "succeeded")], late
        a.wait_log(f"late outcome 'succeeded' for task {t1} epoch 1 kept as evidence", 10)
    rows = claim_rows(pg_url, [t1, x, y])
    # B's two tasks kept their first reservation while they waited (renewed throughout,
    # A's pause included); T1 ran again under a later epoch.
    assert (rows[x].epoch, rows[y].epoch) == (1, 1), rows
    history = runs(journal, GATED)
    reruns = [r for r in history if r.task_id == t1 and r.start.epoch > 1]
    assert len(reruns) == 1 and reruns[0].end is not None, history
    # Apart from the stale execution, never more than 1 at once.
    assert max_overlap(closed(r) for r in history if r.start.attempt
                       != stale.start.attempt) == 1
    assert usage(store, key) == PermitUsage(key, 1, 0, 0)


def _evidence(store_url: str, task_id: str) -> list[tuple[int, str]]:
    engine = sa.create_engine(store_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [(int(r.epoch), str(r.outcome)) for r in conn.execute(sa.text(
                "SELECT epoch, outcome FROM pulse_evidence WHERE task_id = :t ORDER BY id"),
                {"t": task_id})]
    finally:
        engine.dispose()


# -- 5. bad declarations fail at startup -------------------------------------------------------
@pytest.mark.parametrize(("conf", "bad", "expected"), [
    ({"pulse_concurrency_limits": {"x": 0}}, None, "pulse_concurrency_limits"),
    ({"pulse_concurrency_limits": {LIMITED: "two"}}, None, "pulse_concurrency_limits"),
    ({"pulse_concurrency_limits": ["x"]}, None, "pulse_concurrency_limits"),
    ({}, "zero", "pulse_concurrency"),
    ({}, "key", "pulse_concurrency_key"),
], ids=["limit-0", "limit-not-int", "limits-not-a-dict", "task-option-0", "key-not-callable"])
def test_bad_declarations_exit_78_naming_the_setting(
        conf: dict[str, Any], bad: str | None, expected: str, pg_url: str, rabbitmq_url: str,
        penv: Callable[..., Env], cluster: Cluster) -> None:
    """Passes if the worker exits with 78 and one ``cannot start`` line that names the
    setting or task option, without a traceback."""
    env = penv(pg_url, rabbitmq_url, conf)
    w = cluster.worker(env, "bad@%h", extra_env={"PERMITAPP_BAD": bad} if bad else None)
    assert w.wait(30) == 78, w.log()[-3000:]
    lines = [ln for ln in w.log().splitlines() if "cannot start" in ln]
    print(f"\n{lines}")
    assert len(lines) == 1 and expected in lines[0], w.log()[-3000:]
    assert "Traceback" not in w.log(), w.log()[-3000:]


# -- 6. visible: pulse status and the worker stats ------------------------------------------
def test_status_and_worker_stats_show_permits(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, penv: Callable[..., Env],
        cluster: Cluster, store_of: Callable[[str], SqlStore]) -> None:
    """Limit 2 on a task name and 20 on the queue; 5 long tasks on 2 workers x ``-c 4``.
    Passes if ``pulse status --json`` shows the task limit with 2 running and 3 waiting
    and the queue limit with the same 2 running and none waiting for it (the CLI reads
    the store: the cluster's numbers), the text view lists the busy limit, the workers'
    ``inspect stats`` "permits" "waiting" add up to the same 3, and both show everything
    free once the tasks end."""
    env = penv(pg_url, rabbitmq_url)
    # The queue's routing key is the test's queue name (the default exchange).
    env.conf["pulse_concurrency_limits"] = {GATED: 2, f"queue:{env.queue}": 20}
    store = store_of(pg_url)
    journal, gates = tmp_path / "journal.txt", tmp_path / "gates"
    gates.mkdir()
    # -c 4: a worker running both permitted tasks still has processes for the others to
    # try their start with (and be refused: only then does the store count them waiting).
    ws = tuple(cluster.worker(env, f"s{i}@%h", concurrency=4) for i in range(2))
    cluster.ready(*ws)
    names = [w.wait_log(r"pulse: registered (\S+)").group(1) for w in ws]
    key, qkey = task_key(GATED), f"queue:{env.queue}"

    def permits() -> dict[str, dict[str, Any]]:
        proc = env.celery("pulse", "status", "--json")
        assert proc.returncode in (0, 1), proc.stderr  # 1: "something needs a human"
        return {p["key"]: p for p in json.loads(proc.stdout).get("permits", [])}

    with producer(env) as client:
        ids = [client.send_task(GATED, (str(journal), str(gates), 60)).id for _ in range(5)]
        shown = wait_alive(lambda: (p := permits()).get(key, {}).get("waiting") == 3 and p,
                           30, "pulse status to show 2 running and 3 waiting", ws,
                           interval=0.3)
        print(f"\n{json.dumps(shown, indent=1)}")
        # When the oldest of the 3 waiters began waiting (store clock); none for the queue.
        assert isinstance(shown[key].pop("oldest_waiting_since"), float), shown
        # (window: a rate's; None for a concurrency limit)
        assert shown[key] == {"key": key, "limit": 2, "running": 2, "waiting": 3,
                              "window": None}
        # The queue's permit is held by the same 2; nobody waits for it (it has room).
        assert shown[qkey] == {"key": qkey, "limit": 20, "running": 2, "waiting": 0,
                               "oldest_waiting_since": None, "window": None}, shown
        text = env.celery("pulse", "status").stdout  # the human view lists busy limits
        assert f"permits {key}: 2 of 2 running, 3 waiting" in text, text

        def stats_waiting() -> int | None:
            stats = client.control.inspect(timeout=2, destination=names).stats() or {}
            if set(stats) != set(names):
                return None
            return sum(int(s["pulse"]["permits"]["waiting"]) for s in stats.values())
        assert wait_alive(lambda: stats_waiting() == 3, 20,
                          "the workers' stats to show 3 waiting", ws, interval=0.5)

        (gates / "all").touch()
        wait_alive(lambda: all_in_state(pg_url, ids, "succeeded"), 30, "every task to succeed", ws)
        wait_alive(lambda: stats_waiting() == 0, 20, "the workers' stats to show none waiting",
                   ws, interval=0.5)
    final = permits()
    assert final[key] == {"key": key, "limit": 2, "running": 0, "waiting": 0,
                          "oldest_waiting_since": None, "window": None}
    assert (final[qkey]["running"], final[qkey]["waiting"]) == (0, 0)
    assert usage(store, key) == PermitUsage(key, 2, 0, 0)
    assert max_overlap(closed(r) for r in runs(journal, GATED)) == 2


# -- 7. a queue's limit ---------------------------------------------------------------------------
def test_queue_limit_holds_for_every_task_of_the_queue(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, penv: Callable[..., Env],
        cluster: Cluster, store_of: Callable[[str], SqlStore]) -> None:
    """``pulse_concurrency_limits = {"queue:<routing key>": 3}`` with 2 workers x ``-c 4``
    and 30 unlimited tasks of 50 ms: passes if never more than 3 run at once, 3 do, and
    each runs once."""
    env = penv(pg_url, rabbitmq_url)
    env.conf["pulse_concurrency_limits"] = {f"queue:{env.queue}": 3}
    store = store_of(pg_url)
    journal = tmp_path / "journal.txt"
    ws = tuple(cluster.worker(env, f"q{i}@%h", concurrency=4) for i in range(2))
    cluster.ready(*ws)
    with producer(env) as client:
        ids = [client.send_task(FREE, (str(journal), 0.05)).id for _ in range(30)]
    wait_alive(lambda: ended(journal, FREE) == 30, 60, "all 30 tasks to end", ws)
    wait_alive(lambda: all_in_state(pg_url, ids, "succeeded"), 30, "every claim to succeed", ws)
    history = runs(journal, FREE)
    assert sorted(r.task_id for r in history) == sorted(ids)
    assert max_overlap(closed(r) for r in history) == 3
    qkey = f"queue:{env.queue}"
    assert usage(store, qkey) == PermitUsage(qkey, 3, 0, 0)


# -- 8. a broker reconnect while a waiter's turn waits for a pool process ------------------------
def hold_permit(store: SqlStore, permit: Permit) -> Grant:
    """A claim of another holder (not a worker: the test itself) holding ``permit``."""
    g = contract.grant(store, "elsewhere@test", contract.request(), ttl=120)
    waiting: set[str] = set()
    started = store.start_many("elsewhere@test", [contract.key(g)], 120,
                               {g.task_id: [permit]}, waiting)
    assert set(started) == {g.task_id} and not waiting, (started, waiting)
    return g


def test_a_reconnect_never_leaves_later_waiters_stuck(
        pg_url: str, rabbitmq_url: str, tmp_path: Path, penv: Callable[..., Env],
        cluster: Cluster, store_of: Callable[[str], SqlStore]) -> None:
    """A limited task's turn came while every pool process was busy: its start waits in
    Celery's semaphore, which a broker reconnect clears (callbacks included). Passes if
    the task, released with the reconnect and re-dispatched by Recover, waits again and
    then runs once the permit frees. (It was stuck for good: the cleared start kept its
    keys' turn, and every later waiter of those keys queued behind it; a fault-suite run
    caught it.) One worker ``-c 1``, limit 1, the permit held by the test as another
    holder; a gated unlimited task keeps the one process busy."""
    store = store_of(pg_url)
    key, journal, gates = task_key(LIMITED), tmp_path / "journal.txt", tmp_path / "gates"
    gates.mkdir()
    with private_vhost(rabbitmq_url) as broker:
        env = penv(pg_url, broker, dict(FAST))
        env.conf["pulse_concurrency_limits"] = {LIMITED: 1}
        w = cluster.worker(env, "r@%h", concurrency=1)
        cluster.ready(w)
        name = w.wait_log(r"pulse: registered (\S+)").group(1)
        elsewhere = hold_permit(store, Permit(key, 1))
        with producer(env) as client:
            limited = client.send_task(LIMITED, (str(journal), 0.01)).id
            wait_alive(lambda: (u := usage(store, key)) is not None and u.waiting == 1, 30,
                       "the limited task to wait for the permit", (w,))
            busy = client.send_task(GATED, (str(journal), str(gates), 120)).id
            wait_alive(lambda: all_in_state(pg_url, [busy], "running"), 30,
                       "the gated task to hold the pool process", (w,))
            contract.complete(store, "elsewhere@test", elsewhere)  # the permit frees...

            def awaiting() -> int | None:
                stats = client.control.inspect(timeout=2, destination=[name]).stats() or {}
                return stats[name]["pulse"]["permits"]["awaiting_process"] if stats else None
            # ... the limited task's turn comes, and waits in the semaphore for the process
            wait_alive(lambda: awaiting() == 1, 30, "the limited task to wait for a process",
                       (w,), interval=0.3)
        first_epoch = claim_rows(pg_url, [limited])[limited].epoch
        elsewhere = hold_permit(store, Permit(key, 1))  # so the re-dispatched one waits again
        cut_vhost_connections(broker, "pulse test: reconnect")
        wait_alive(lambda: claim_rows(pg_url, [limited])[limited].epoch > first_epoch
                   and (u := usage(store, key)) is not None and u.waiting == 1, 30,
                   "the released task to be re-dispatched and wait again", (w,))
        contract.complete(store, "elsewhere@test", elsewhere)
        (gates / "all").touch()
        wait_alive(lambda: all_in_state(pg_url, [limited, busy], "succeeded"), 30,
                   "the limited task to run once the permit is free", (w,))
        assert [r.task_id for r in runs(journal, LIMITED)] == [limited]  # ran once
        assert usage(store, key) == PermitUsage(key, 1, 0, 0)
        w.kill()  # before its vhost goes
