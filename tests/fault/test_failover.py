"""A real PostgreSQL failover under load: nothing lost, nothing run twice.

The store is a private primary streaming to a synchronous standby (``pg_basebackup -R``,
``synchronous_standby_names``, ``synchronous_commit=on``), reached through a multi-host
URL with ``target_session_attrs=read-write``. Three ``celery worker -P pulse`` workers
(``-c 2``) run a mix of tasks (no-ops, 10-50 ms of work, acks_late and default-acks,
retrying, a few longer than the lease TTL, a few limited by a cluster-wide permit) and a
1 s beat schedule. Mid-run the primary's postmaster and every process of it are
SIGKILLed (``killed``: 2,000 tasks), or the primary stays up and turns read-only
(``read_only``: a demoted primary, 1,000 tasks; afterwards no session may remain on
it); :data:`PROMOTE_AFTER` seconds later (an orchestrator noticing) the standby is
promoted. Every body writes its effect through ``lease.fenced(conn)`` and records its
run in a history database the failover never touches; the checker then asserts: every
task succeeded with exactly one fenced effect, or is in review for a started
default-acks task (counted); no fenced effect was written by an epoch after a newer
epoch of its task had started; no beat slot fired twice or was skipped; no permit over
its limit. Each worker must have fenced itself (or not needed to), re-registered and
completed tasks on the new primary. The time from the kill to the first task completed
on the new primary is printed (docs/production.md quotes it).
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from celery_pulse.store.sql.tables import permit_holds
from tests.fault.checker import ClaimState, Event, PermitHold, check
from tests.helpers import services
from tests.helpers.pg_ha import ReplicatedPostgres
from tests.helpers.workers import Env, Worker, assert_alive, wait_alive

#: Tasks published: 2,000 settle in ~40 s on a shared 2-core machine (the report line).
TASKS = int(os.environ.get("PULSE_FAILOVER_TASKS", "2000"))
#: The share of tasks settled before the primary is killed.
KILL_AT = 0.35
#: Seconds between the kill and the promotion (an orchestrator noticing the loss):
#: longer than the worker and lease TTLs (3 s), so that every worker self-fences and
#: every running lease expires during the outage, as in a real failover (~10 s).
PROMOTE_AFTER = 5.0
SETTLE = 120.0
TIMINGS = {"pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5, "pulse_lease_ttl": 3,
           "pulse_renew_interval": 0.5, "pulse_recover_interval": 0.5, "pulse_revoke_grace": 1,
           "pulse_leader_ttl": 3, "pulse_leader_interval": 1, "pulse_beat_catchup": "all",
           "pulse_max_attempts": 25, "pulse_store_connect_timeout": 30,
           "broker_connection_retry": True, "worker_prefetch_multiplier": 4}
LIMITED = "faultapp.limited"
#: (task, weight, seconds of work): mostly no-ops and 10-50 ms bodies.
MIX: list[tuple[str, int, tuple[float, float]]] = [
    ("faultapp.quick", 45, (0.0, 0.0)),
    ("faultapp.quick", 27, (0.01, 0.05)),
    ("faultapp.quick_review", 15, (0.0, 0.05)),  # default acks: a lost run goes to review
    ("faultapp.flaky", 8, (0.0, 0.0)),  # retries twice (a new run each), then succeeds
    (LIMITED, 4, (0.05, 0.2)),  # at most 2 at once across the cluster
    ("faultapp.long", 1, (3.5, 4.0)),  # longer than the lease TTL: renewed across the kill
]


#: Client sessions on a server other than the one asking.
OTHER_SESSIONS = ("select count(*) from pg_stat_activity where backend_type = 'client backend' "
                  "and pid <> pg_backend_pid()")


def _publish(env: Env, seed: int, tasks: int) -> list[str]:
    from celery import Celery

    rng = random.Random(seed)
    app = Celery("failover-producer", broker=env.broker_url)
    ids: list[str] = []
    weights = [w for _, w, _ in MIX]
    with app.producer_or_acquire() as producer:
        for _ in range(tasks):
            name, _, (low, high) = rng.choices(MIX, weights)[0]
            task_id = str(uuid.uuid4())
            args = [] if name == "faultapp.flaky" else [round(rng.uniform(low, high), 3)]
            app.send_task(name, args=args, task_id=task_id, queue=env.queue, producer=producer)
            ids.append(task_id)
    return ids


def _count(url: str, sql: str, params: dict[str, Any] | None = None) -> int:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool,
                              connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(sql), params or {}).scalar_one())
    except sa.exc.OperationalError:
        return -1
    finally:
        engine.dispose()


def _sessions(url: str) -> str:
    """The client sessions still on ``url``, to say which part of a worker kept one."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(
                "select application_name, state, backend_start, left(query, 120) "
                "from pg_stat_activity where backend_type = 'client backend' "
                "and pid <> pg_backend_pid()")).all()
    finally:
        engine.dispose()
    return "sessions left:\n" + "\n".join(" | ".join(map(str, row)) for row in rows)


def _read(store_url: str, history: str) -> tuple[list[ClaimState], list[Event],
                                                list[tuple[str, int, float]], list[Any],
                                                list[PermitHold], list[Any], set[str]]:
    store = sa.create_engine(store_url, poolclass=sa.pool.NullPool)
    hist = sa.create_engine(history, poolclass=sa.pool.NullPool)
    with store.connect() as conn:
        claims = [ClaimState(r.task_id, r.state, int(r.epoch), r.policy) for r in conn.execute(
            sa.text("select task_id, state, epoch, policy from pulse_claims"))]
        effects = [(r.task_id, int(r.epoch), float(r.at)) for r in conn.execute(sa.text(
            "select task_id, epoch, extract(epoch from at) as at from fault_effects"))]
        slots = [(r.entry, str(r.due_at)) for r in conn.execute(
            sa.text("select entry, due_at from pulse_beat_slots"))]
        holds = [PermitHold(r.key, r.task_id, int(r.epoch), bool(r.held))
                 for r in conn.execute(sa.select(permit_holds))]
        finished = list(conn.execute(sa.text(
            "select holder, finished_at from pulse_claims where state = 'succeeded'")))
        started = set(conn.execute(sa.text(
            "select task_id from pulse_claims where started_at is not null")).scalars())
    with hist.connect() as conn:
        events = [Event(r.kind, r.task_id, int(r.epoch), int(r.extra or 0)
                        if r.kind == "start" else 0, r.name or "", float(r.at), r.attempt or "",
                        r.worker or "")
                  for r in conn.execute(sa.text(
                      "select kind, task_id, epoch, extra, name, extract(epoch from at) as at, "
                      "attempt, worker from fault_events order by id"))]
    store.dispose()
    hist.dispose()
    return claims, events, effects, slots, holds, finished, started


def _print_failed(store_url: str) -> None:
    """The failed claims' task names and errors (a failover must fail none of them)."""
    store = sa.create_engine(store_url, poolclass=sa.pool.NullPool)
    with store.connect() as conn:
        for row in conn.execute(sa.text("select task_id, task_name, epoch, error "
                                        "from pulse_claims where state = 'failed'")):
            print(f"  FAILED {row.task_id} {row.task_name} epoch {row.epoch}: {row.error}")
    store.dispose()


def stale_effects(effects: list[tuple[str, int, float]], events: list[Event]) -> list[str]:
    """Fenced effects committed by an epoch after a newer epoch of the task had started
    (its body's ``start``, recorded after the store granted it): a stale holder's write.
    One clock: the store and the history server run on this host."""
    first_start: dict[tuple[str, int], float] = {}
    for e in events:
        if e.kind == "start":
            key = (e.task_id, e.epoch)
            first_start[key] = min(first_start.get(key, e.at), e.at)
    out = []
    for task_id, epoch, at in effects:
        newer = [t for (tid, ep), t in first_start.items() if tid == task_id and ep > epoch]
        if newer and min(newer) < at:
            out.append(f"{task_id}: effect of epoch {epoch} committed at {at:.3f}, after a "
                       f"newer epoch started at {min(newer):.3f}")
        if (task_id, epoch) not in first_start:
            out.append(f"{task_id}: effect of epoch {epoch}, which never started a body")
    return out


@pytest.mark.parametrize(("mode", "tasks"), [("killed", TASKS), ("read_only", TASKS // 2)])
def test_primary_lost_and_standby_promoted_under_load(
        mode: str, tasks: int, replicated_pg: ReplicatedPostgres, history: str,
        rabbitmq_vhost_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """``killed``: the primary's processes SIGKILLed (a lost host). ``read_only``: the
    primary stays up and refuses writes (a demoted primary): every connection of the
    workers, and of the tasks' own engine, must leave it for the new primary."""
    seed = int(os.environ.get("PULSE_FAULT_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"\nfailover seed: {seed} (replay with PULSE_FAULT_SEED={seed})")
    env = make_env(replicated_pg.url, rabbitmq_vhost_url, dict(TIMINGS))
    env.app = "tests.apps.faultapp"
    engine = sa.create_engine(replicated_pg.url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("create table fault_effects (task_id text not null, epoch bigint "
                             "not null, at timestamptz not null default clock_timestamp())"))
    engine.dispose()
    os.environ["PULSE_FAULT_HISTORY"] = history
    os.environ["PULSE_FAULT_TICK"] = "1.0"
    try:
        names = ["f1", "f2", "f3"]
        ws = tuple(workers(env, f"{n}@%h", concurrency=2, extra_env={"PULSE_FAULT_NODE": n})
                   for n in names)
        for w in ws:
            w.wait_ready(60)
    finally:
        os.environ.pop("PULSE_FAULT_TICK")
    started = time.monotonic()
    submitted = _publish(env, seed, tasks)
    published = time.monotonic() - started
    ends = "select count(distinct task_id) from fault_events where kind = 'end'"
    wait_alive(lambda: _count(history, ends) >= KILL_AT * tasks, 120,
               f"{KILL_AT:.0%} of the tasks to finish", ws, interval=0.2)
    done_before = _count(history, ends)
    killed_wall, killed = time.time(), time.monotonic()
    if mode == "killed":
        replicated_pg.kill_primary()
    else:
        replicated_pg.demote_primary()
    time.sleep(PROMOTE_AFTER)  # the failover's own delay, not a wait for an effect
    replicated_pg.promote()
    promoted = time.monotonic() - killed
    settled = ("select count(*) from pulse_claims where task_id = any(:ids) and state in "
               "('succeeded', 'failed', 'needs_review')")
    wait_alive(lambda: _count(replicated_pg.url, settled, {"ids": submitted}) == tasks,
               SETTLE, "every task to settle on the new primary", ws, interval=1.0)
    elapsed = time.monotonic() - started
    assert_alive(*ws)
    if mode == "read_only":  # nothing stays on the demoted primary
        try:
            wait_alive(lambda: _count(replicated_pg.primary.url, OTHER_SESSIONS) == 0, 15,
                       "the workers' sessions on the demoted primary to close", ws,
                       interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{_sessions(replicated_pg.primary.url)}\n{exc}") from None
    claims, events, effects, slots, holds, finished, started = _read(replicated_pg.url,
                                                                     history)
    report = check(submitted, claims, events, [(t, e) for t, e, _ in effects], slots,
                   slot_period=1.0, limits={LIMITED: 2}, permit_holds=holds)
    report.violations += stale_effects(effects, events)
    # In review: only a default-acks task the store had started (``running``: its body
    # may have begun, so it is never re-run), whether or not the body got to record it.
    bodies = {e.task_id for e in events if e.kind == "start"}
    in_review = [c for c in claims if c.state == "needs_review"]
    report.violations += [f"{c.task_id}: in review ({c.policy}) but never started"
                          for c in in_review
                          if c.policy != "review" or c.task_id not in started]
    ticks = sum(1 for e in events if e.kind == "tick")
    if ticks > elapsed + 5:  # a 1 s schedule: more ticks than seconds = a slot fired twice
        report.violations.append(f"{ticks} periodic ticks in {elapsed:.0f}s")
    # Nothing commits between the kill and the promotion (no primary): a finish later
    # than half a second after the kill (the kill takes less) is on the new primary.
    after = [(holder, at) for holder, at in finished if at > killed_wall + 0.5]
    first = min((at for _, at in after), default=None)
    to_first = None if first is None else first - killed_wall
    from_promotion = None if to_first is None else to_first - promoted
    logs = {w.name.split("@")[0]: w.log() for w in ws}
    report.duplicates_dropped = sum(log.count("duplicate delivery") for log in logs.values())
    report.recoveries = sum(log.count("pulse: recovered ") for log in logs.values())
    fenced = sorted(n for n, log in logs.items() if " fenced (" in log)
    resumed = sorted(n for n, log in logs.items() if "registered again: resuming" in log)
    print(f"[failover {mode}] seed={seed} tasks={tasks} published_in={published:.1f}s "
          f"done_before_kill={done_before} promoted_after={promoted:.1f}s "
          f"kill_to_first_completion_on_new_primary="
          f"{'none' if to_first is None else f'{to_first:.2f}s'} (after the promotion: "
          f"{'none' if from_promotion is None else f'{from_promotion:.2f}s'}) "
          f"total={elapsed:.1f}s "
          f"fenced={fenced} resumed={resumed} in_review_body_began="
          f"{sum(c.task_id in bodies for c in in_review)}/{len(in_review)} {report.summary()}")
    for violation in report.violations[:20]:
        print(f"  VIOLATION {violation}")
    _print_failed(replicated_pg.url)
    assert not report.violations, report.violations[:5]
    assert report.succeeded + report.needs_review == tasks
    assert to_first is not None and to_first > PROMOTE_AFTER
    # Every worker fenced itself and came back, or never needed to; each completed
    # tasks on the new primary (it reconnected, re-registered, resumed).
    assert set(fenced) <= set(resumed), (fenced, resumed)
    assert not any("commits do not wait" in log for log in logs.values())  # synchronous
    for w in ws:
        holder = w.name.split("@")[0]
        assert any(h and h.startswith(holder) for h, _ in after), f"{w.name}: nothing after"


def test_a_worker_warns_at_start_when_commits_do_not_wait_for_the_standby(
        rabbitmq_vhost_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    """A standby attached, ``synchronous_standby_names`` empty: the worker says so in its
    log, naming both settings and the docs, and starts anyway."""
    services.require("postgres")
    pair = ReplicatedPostgres(synchronous=False)
    try:
        pair.start()
        env = make_env(pair.url, rabbitmq_vhost_url, {})
        worker = workers(env, "async@%h").wait_ready(60)
        line = worker.wait_log(r"WARNING.*standby\(s\) attached but commits do not wait.*", 5)
        for words in ("synchronous_commit='on'", "synchronous_standby_names=''",
                      "docs/production.md"):
            assert words in line.group(0), line.group(0)
    finally:
        pair.destroy()
