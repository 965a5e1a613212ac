"""The leader-elected beat with real ``celery worker -P pulse`` processes (PostgreSQL, RabbitMQ).

The app is :mod:`tests.apps.beatapp`: interval entries running ``beatapp.tick``,
which journals ``<task id> <hostname> <pid> <time>`` per execution. The test reads
the store directly: ``pulse_leaders`` (who leads, which epoch), ``pulse_beat_slots``
(one row per fired slot, with the epoch of the term that inserted it and the store
time it was inserted) and ``pulse_claims`` (what happened to a task).

Timings are short (leader TTL 3 s, renewal every 1 s, a 1 s schedule). Failover is
bounded by ``leader_ttl + leader_interval`` plus beat's reaction; ``SLACK`` covers
process scheduling on a loaded 2-core machine.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_pulse.beat import slot_task_id
from celery_pulse.store.base import LeaderInfo, ScheduleRow
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.store.sql.tables import beat_slots, beat_state, claims
from tests.conftest import SERVERS
from tests.helpers.workers import Env, Worker, wait_for

LEADER_TTL = 3.0
LEADER_INTERVAL = 1.0
FAST = {"pulse_leader_ttl": LEADER_TTL, "pulse_leader_interval": LEADER_INTERVAL,
        "pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5, "pulse_lease_ttl": 3,
        "pulse_renew_interval": 0.5}
#: Process scheduling on a busy 2-core machine.
SLACK = 0.75
#: A crashed leader is replaced within its TTL plus one campaign interval; beat reacts
#: to the new leadership at once (and at worst after its 1 s nap).
FAILOVER_BOUND = LEADER_TTL + LEADER_INTERVAL + 1.0 + SLACK
APP = "tests.apps.beatapp"

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]


# -- reading the store ------------------------------------------------------------------
class View:
    """The test's own connection to the store."""

    def __init__(self, url: str) -> None:
        self.store: SqlStore = open_store(url, check_schema=False)
        self.store.migrate()

    def leader(self) -> LeaderInfo | None:
        return self.store.get_leader("beat")

    def live_leader(self) -> LeaderInfo | None:
        info = self.leader()
        return info if info is not None and info.alive else None

    def slots(self, entry: str | None = None) -> list[Any]:
        stmt = sa.select(beat_slots).order_by(beat_slots.c.entry, beat_slots.c.due_at)
        if entry is not None:
            stmt = stmt.where(beat_slots.c.entry == entry)
        with self.store.engine.connect() as conn:
            return list(conn.execute(stmt))

    def last_run(self) -> dict[str, float]:
        return self.store.last_run()

    def claim_states(self, task_ids: list[str]) -> dict[str, str]:
        with self.store.engine.connect() as conn:
            rows = conn.execute(sa.select(claims.c.task_id, claims.c.state)
                                .where(claims.c.task_id.in_(task_ids)))
            return {r.task_id: r.state for r in rows}


@pytest.fixture
def view(server_url: str) -> Iterator[View]:
    v = View(server_url)
    yield v
    v.store.close()


def journal(path: Path) -> list[tuple[str, str, float]]:
    """``(task_id, hostname, time)`` per execution of ``beatapp.tick``."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        task_id, host, _pid, at = line.split()
        out.append((task_id, host, float(at)))
    return out


def log_time(match: re.Match[str]) -> float:
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


# -- environment --------------------------------------------------------------------------
@pytest.fixture
def beat_env(server_url: str, rabbitmq_url: str, make_env: Callable[..., Env],
             tmp_path: Path) -> Callable[..., Env]:
    """An Env on PostgreSQL (or ``server_url``'s store) + RabbitMQ running
    ``tests.apps.beatapp``."""

    def factory(entries: dict[str, float], **conf: Any) -> Env:
        env = make_env(server_url, rabbitmq_url, {
            **FAST, **conf, "test_beat": entries, "test_journal": str(tmp_path / "ticks.log")})
        env.app = APP
        return env
    return factory


class BeatProcess:
    """One ``celery -A beatapp pulse beat`` replica in its own process group."""

    def __init__(self, env: Env, name: str) -> None:
        self.name = name
        self.log_path = env.tmp / f"beat-{name}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", env.app, "pulse", "beat", "--name", name],
            env=env.vars(), cwd=env.tmp, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def beat_replicas() -> Iterator[Callable[[Env, str], BeatProcess]]:
    started: list[BeatProcess] = []

    def start(env: Env, name: str) -> BeatProcess:
        proc = BeatProcess(env, name)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


# -- assertions shared by the tests ----------------------------------------------------------
def assert_slots_well_formed(rows: list[Any]) -> None:
    for r in rows:
        assert r.task_id == slot_task_id(r.entry, r.due_at), r


def assert_contiguous(rows: list[Any], period: float) -> None:
    """Every period has its slot: no slot skipped, none doubled (due times on one grid)."""
    due = [r.due_at for r in rows]
    steps = [round(b - a, 3) for a, b in itertools.pairwise(due)]
    assert steps == [period] * len(steps), f"due-time steps {steps}"


def assert_each_ran_once(view: View, path: Path, rows: list[Any], lost_ok: int = 0,
                         timeout: float = 20) -> None:
    """Every slot's task ran exactly once. A worker killed or paused in the middle of a
    tick loses that attempt (policy ``review``: needs_review, not re-run): at most
    ``lost_ok`` such slots, one per disrupted worker."""
    wanted = {r.task_id for r in rows}

    def settled() -> bool:
        ran = {tid for tid, _, _ in journal(path)}
        missing = wanted - ran
        states = view.claim_states(sorted(missing)) if missing else {}
        return all(states.get(tid) == "needs_review" for tid in missing)
    wait_for(settled, timeout, "every fired slot to run (or be parked for review)")
    counts = Counter(tid for tid, _, _ in journal(path))
    doubled = {tid: n for tid, n in counts.items() if n > 1}
    assert not doubled, f"slots executed more than once: {doubled}"
    unknown = set(counts) - {r.task_id for r in view.slots()}
    assert not unknown, f"executions of task ids that are no slot: {unknown}"
    missing = wanted - set(counts)
    if missing:
        print(f"slots lost mid-run by a disrupted worker (needs_review): {sorted(missing)}")
    assert len(missing) <= lost_ok, missing


def wait_new_term(view: View, old: LeaderInfo, timeout: float) -> LeaderInfo:
    found: LeaderInfo = wait_for(
        lambda: (info := view.live_leader()) is not None and info.epoch > old.epoch and info,
        timeout, f"a new leader after epoch {old.epoch}")
    return found


def first_slot_of_terms_after(view: View, epoch: int, timeout: float) -> Any:
    def first() -> Any:
        rows = [r for r in view.slots("tick") if r.leader_epoch > epoch]
        return min(rows, key=lambda r: r.created_at) if rows else None
    return wait_for(first, timeout, f"a slot fired by a term after epoch {epoch}")


def wait_more_slots(view: View, n: int, timeout: float = 15, entry: str = "tick") -> list[Any]:
    before = len(view.slots(entry))
    rows: list[Any] = wait_for(lambda: len(r := view.slots(entry)) >= before + n and r, timeout,
                               f"{n} more {entry} slots")
    return rows


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("server_url", SERVERS, indirect=True)
def test_crashes_and_a_pause_of_the_leader_fire_every_slot_exactly_once(
        beat_env: Callable[..., Env], workers: Callable[..., Worker], view: View,
        tmp_path: Path) -> None:
    """Three workers, a 1 s schedule, catchup "all"; the leader is SIGKILLed, SIGSTOPped
    (then SIGCONT), SIGKILLed. Every period gets exactly one slot, each slot runs once,
    failover stays within the bound, and the paused term inserts nothing once it lost."""
    env = beat_env({"tick": 1.0}, pulse_beat_catchup="all")
    nodes = {n: workers(env, f"{n}@%h") for n in ("c1", "c2", "c3")}
    for w in nodes.values():
        w.wait_ready()
    wait_for(view.live_leader, 10, "a leader")
    wait_more_slots(view, 2)
    started = time.monotonic()
    gaps: list[tuple[str, float, float]] = []
    paused: tuple[LeaderInfo, LeaderInfo] | None = None
    for action in ("SIGKILL", "SIGSTOP", "SIGKILL"):
        wait_more_slots(view, 4)  # the current leader runs normally for a while first
        old = view.live_leader()
        assert old is not None
        victim = nodes[old.holder.split("@")[0]]
        at = time.time()
        if action == "SIGKILL":
            victim.kill()
        else:
            victim.signal(signal.SIGSTOP)
        new = wait_new_term(view, old, FAILOVER_BOUND + 5)
        first = first_slot_of_terms_after(view, old.epoch, FAILOVER_BOUND + 5)
        gaps.append((action, new.acquired_at - at, first.created_at - at))
        assert new.holder != old.holder
        if action == "SIGSTOP":
            paused = (old, new)
            victim.signal(signal.SIGCONT)
            victim.wait_log(rf"lost leadership of beat \(epoch {old.epoch}\)", timeout=10)
    wait_more_slots(view, 4)
    print(f"\nchaos window {time.monotonic() - started:.1f}s; gaps after each action "
          f"(new term, first slot): " + ", ".join(f"{a} {t:.2f}s/{s:.2f}s" for a, t, s in gaps))
    for action, _term, slot_gap in gaps:
        assert slot_gap <= FAILOVER_BOUND, (action, slot_gap, FAILOVER_BOUND)

    rows = view.slots("tick")
    assert_slots_well_formed(rows)
    assert_contiguous(rows, 1.0)
    assert len({r.task_id for r in rows}) == len(rows)
    assert paused is not None
    old, new = paused
    late = [r for r in rows if r.leader_epoch == old.epoch and r.created_at >= new.acquired_at]
    assert not late, f"the paused term inserted slots after it lost: {late}"
    assert_each_ran_once(view, tmp_path / "ticks.log", rows, lost_ok=3)


def test_paused_leader_that_wakes_after_losing_fires_nothing(
        beat_env: Callable[..., Env], workers: Callable[..., Worker], view: View,
        tmp_path: Path) -> None:
    env = beat_env({"tick": 1.0}, pulse_beat_catchup="all")
    nodes = {n: workers(env, f"{n}@%h") for n in ("p1", "p2")}
    for w in nodes.values():
        w.wait_ready()
    wait_for(view.live_leader, 10, "a leader")
    wait_more_slots(view, 2)
    old = view.live_leader()
    assert old is not None
    victim = nodes[old.holder.split("@")[0]]
    victim.signal(signal.SIGSTOP)
    new = wait_new_term(view, old, FAILOVER_BOUND + 5)
    wait_more_slots(view, 2)  # the new leader is firing; the paused one has a backlog
    victim.signal(signal.SIGCONT)
    woke = time.time()
    victim.wait_log(rf"lost leadership of beat \(epoch {old.epoch}\)", timeout=10)
    wait_more_slots(view, 3)  # observation window: three periods after the wake-up

    rows = view.slots("tick")
    by_old = [r for r in rows if r.leader_epoch == old.epoch]
    assert by_old, "the first leader fired nothing before it was paused"
    assert max(r.created_at for r in by_old) < new.acquired_at, [
        (r.due_at, r.created_at) for r in by_old]
    assert {r.leader_epoch for r in rows if r.created_at >= new.acquired_at} == {new.epoch}
    # Nor did it publish anything new after it woke up: a "beat fired" line after the
    # wake-up can only be a slot its own term recorded before the pause (the publish the
    # pause interrupted; the new leader re-sent it under the same task id).
    own = {r.task_id for r in by_old}
    late = [m.group(2) for m in re.finditer(
        r"\[([^\]]+): INFO/MainProcess\] pulse: beat fired tick \S+ for \S+ as (\S+)",
        victim.log()) if log_time(m) >= woke]
    assert set(late) <= own, f"the woken ex-leader published slots of other terms: {late}"
    assert_contiguous(rows, 1.0)
    assert_each_ran_once(view, tmp_path / "ticks.log", rows, lost_ok=1)


def test_planned_handover_within_one_interval(
        beat_env: Callable[..., Env], workers: Callable[..., Worker], view: View,
        tmp_path: Path) -> None:
    env = beat_env({"tick": 1.0})
    nodes = {n: workers(env, f"{n}@%h") for n in ("h1", "h2")}
    for w in nodes.values():
        w.wait_ready()
    wait_for(view.live_leader, 10, "a leader")
    wait_more_slots(view, 2)
    old = view.live_leader()
    assert old is not None
    leaving = nodes[old.holder.split("@")[0]]
    leaving.signal_main(signal.SIGTERM)
    released = log_time(leaving.wait_log(
        r"\[([^\]]+): INFO/MainProcess\] pulse: released leadership of beat", timeout=20))
    new = wait_new_term(view, old, 10)
    first = first_slot_of_terms_after(view, old.epoch, 10)
    assert leaving.wait(20) == 0
    took = new.acquired_at - released
    # The new leader's first slot: at once if one was due, else at its due time.
    ticked = first.created_at - max(new.acquired_at, first.due_at)
    print(f"\nhandover: new term {took:.2f}s after the release, first slot {ticked:.2f}s after "
          f"max(term start, due time)")
    assert new.holder != old.holder
    assert took <= LEADER_INTERVAL + SLACK
    assert ticked <= SLACK
    wait_more_slots(view, 2)
    rows = view.slots("tick")
    assert_contiguous(rows, 1.0)  # no period lost in the handover
    assert_each_ran_once(view, tmp_path / "ticks.log", rows)


def test_restarting_every_worker_keeps_last_run(
        beat_env: Callable[..., Env], workers: Callable[..., Worker], view: View,
        tmp_path: Path) -> None:
    """A daily entry fires once and not again after a full restart; the 1 s entry resumes
    from its stored last_run_at (catchup "all": the periods missed while down are fired)."""
    env = beat_env({"tick": 1.0, "daily": 86400.0}, pulse_beat_catchup="all")
    # The daily entry last ran (almost) a day ago: it is due a few seconds from now.
    with view.store.engine.begin() as conn:
        conn.execute(sa.insert(beat_state).values(entry="daily",
                                                  last_run_at=view.store.now() - 86400 + 4))
    first = [workers(env, f"r{i}@%h") for i in (1, 2)]
    for w in first:
        w.wait_ready()
    (daily,) = wait_for(lambda: view.slots("daily"), 15, "the daily slot")
    wait_more_slots(view, 2)
    for w in first:
        w.signal_main(signal.SIGTERM)
    for w in first:
        assert w.wait(20) == 0, w.log()[-2000:]
    down = view.last_run()
    assert view.live_leader() is None  # released on the way out
    # Stay down for at least two periods of the 1 s entry (polled on the store clock).
    wait_for(lambda: view.store.now() >= down["tick"] + 2.5, 10, "two missed periods")
    restarted = view.store.now()
    second = [workers(env, f"r{i}@%h") for i in (1, 2)]
    for w in second:
        w.wait_ready()
    wait_for(lambda: view.last_run()["tick"] >= restarted + 2, 15, "the 1 s entry to resume")
    rows = view.slots("tick")
    assert_contiguous(rows, 1.0)  # resumed from the stored last_run_at, no gap
    key = ("daily", daily.due_at, daily.task_id, daily.leader_epoch)
    assert [(r.entry, r.due_at, r.task_id, r.leader_epoch) for r in view.slots("daily")] == [
        key]  # not fired again on restart
    assert view.last_run()["daily"] == daily.due_at
    assert_each_ran_once(view, tmp_path / "ticks.log", [*rows, daily])


def _run_parallel(env: Env, *commands: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: env.celery(*args), commands))


def test_dynamic_schedule_add_remove_and_validation(
        beat_env: Callable[..., Env], workers: Callable[..., Worker], view: View,
        tmp_path: Path) -> None:
    env = beat_env({"hourly": 3600.0})  # a static entry (first due in an hour)
    path = str(tmp_path / "ticks.log")
    # A malformed row written around the CLI never takes the scheduler down.
    view.store.put_schedule(ScheduleRow("broken", "beatapp.tick", "crontab", '{"minute": "99"}',
                                        "[]", "{}", "{}", True, 0.0))
    w = workers(env, "d1@%h").wait_ready()
    wait_for(view.live_leader, 10, "a leader")
    added = env.celery("pulse", "schedule", "add", "dyn", "--task", "beatapp.tick",
                       "--every", "1", "--args", json.dumps([path]))
    assert added.returncode == 0, added.stderr
    t_add = time.time()
    first = wait_for(lambda: view.slots("dyn"), 10, "the dynamic entry to fire")[0]
    # Seen within beat's 1 s nap, first due one period later, fired on time.
    assert first.due_at - t_add <= 1.0 + 1.0 + SLACK, first.due_at - t_add
    assert first.created_at - first.due_at <= SLACK
    wait_for(lambda: first.task_id in {t for t, _, _ in journal(Path(path))}, 10, "it to run")
    wait_more_slots(view, 2, entry="dyn")
    listed = {r["name"]: r for r in env.celery_json("pulse", "schedule", "list")}
    assert listed["dyn"]["source"] == "dynamic" and listed["dyn"]["enabled"]
    assert listed["dyn"]["last_run_at"] >= first.due_at
    assert "skipping malformed schedule entry 'broken'" in w.log()

    removed = env.celery("pulse", "schedule", "remove", "dyn")
    assert removed.returncode == 0, removed.stderr
    t_rm = time.time()
    # Observation window: three periods of the removed entry.
    wait_for(lambda: time.time() >= t_rm + 3, 5, "three periods", interval=0.2)
    after = [r for r in view.slots("dyn") if r.due_at > t_rm]
    assert not after, f"fired after removal: {[r.due_at for r in after]}"
    assert w.proc.poll() is None

    add = ("pulse", "schedule", "add")
    cases: dict[str, tuple[tuple[str, ...], str]] = {
        "bad json": (("x1", "--crontab", "{not json"), "invalid schedule entry 'x1'"),
        "bad crontab": (("x2", "--crontab", '{"minute": "99"}'), "99"),
        "unknown field": (("x3", "--crontab", '{"minutes": "5"}'), "invalid schedule entry"),
        "zero period": (("x4", "--every", "0"), "'every' must be"),
        "infinite period": (("x5", "--every", "inf"), "'every' must be"),
        "args not a list": (("x6", "--every", "1", "--args", '{"a": 1}'), "--args must be"),
        "no schedule": (("x7",), "exactly one of --every"),
        "a static entry's name": (("hourly", "--every", "1"), "static entry of beat_schedule"),
    }
    results = _run_parallel(
        env, *[(*add, *args, "--task", "beatapp.tick") for args, _ in cases.values()],
        ("pulse", "schedule", "remove", "nope"))
    for (what, (_, expected)), proc in zip(cases.items(), results, strict=False):
        assert proc.returncode != 0, what
        assert expected in proc.stderr and "Traceback" not in proc.stderr, (what, proc.stderr)
    assert results[-1].returncode != 0
    assert "no dynamic schedule entry 'nope'" in results[-1].stderr
    assert {r.name for r in view.store.list_schedule()} == {"broken"}


def test_standalone_beat_two_replicas_one_leads(
        beat_env: Callable[..., Env], workers: Callable[..., Worker],
        beat_replicas: Callable[[Env, str], BeatProcess], view: View, tmp_path: Path) -> None:
    # A 1 s leader TTL (renewed every 0.3 s) next to the default 30 s task-lease TTL, whose
    # 1 s safety margin must not swallow the whole leader term.
    env = beat_env({"tick": 1.0}, pulse_beat=False,  # the worker only runs tasks
                   pulse_leader_ttl=1.0, pulse_leader_interval=0.3, pulse_lease_ttl=30)
    workers(env, "exec@%h")
    a, b = beat_replicas(env, "beat-a"), beat_replicas(env, "beat-b")
    info = wait_for(view.live_leader, 20, "a beat replica to lead")
    assert info.holder in ("beat-a", "beat-b")
    wait_more_slots(view, 4)
    leader, standby = (a, b) if info.holder == "beat-a" else (b, a)
    assert "is now the leader" in leader.log()
    assert "is now the leader" not in standby.log()
    # A planned stop of the leading replica hands over to the other one.
    leader.proc.send_signal(signal.SIGTERM)
    assert leader.proc.wait(20) == 0, leader.log()
    new = wait_new_term(view, info, 10)
    assert new.holder == standby.name
    status = env.celery_json("pulse", "status")["leader"]
    assert (status["holder"], status["epoch"], status["alive"]) == (standby.name, new.epoch, True)
    wait_more_slots(view, 2)
    rows = view.slots("tick")
    assert {r.leader_epoch for r in rows} == {info.epoch, new.epoch}
    assert len({r.task_id for r in rows}) == len(rows)
    assert_each_ran_once(view, tmp_path / "ticks.log", rows)
    assert standby.proc.poll() is None
