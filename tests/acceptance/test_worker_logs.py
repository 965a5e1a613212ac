"""What a real ``-P pulse`` worker's log says: at start, and when a paused copy wakes up.

Real ``celery worker`` processes on PostgreSQL (the takeover) or SQLite (the start)
with Redis as the broker; the log is the worker's own file, read as an operator would.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from pathlib import Path

from tests.acceptance.test_leases import FAST, Claims, db, events, producer, wait_event
from tests.helpers.workers import Env, Worker, wait_for

__all__ = ["db"]  # the fixture, imported from the lease tests


def test_a_stale_attempt_logs_one_warning_naming_both_holders_and_no_traceback(
        pg_url: str, redis_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker], db: Callable[[str], Claims], tmp_path: Path) -> None:
    env = make_env(pg_url, redis_url, FAST)
    store_db = db(pg_url)
    a = workers(env, "a@%h").wait_ready()
    path = tmp_path / "late.txt"
    with producer(env) as client:
        task_id = client.send_task("pulseapp.late_sleep", args=[60, str(path)]).id
    wait_event(path, "start", 20, (a,))
    b = workers(env, "b@%h").wait_ready()

    a.signal(signal.SIGSTOP)  # past its lease: Recover on b takes the task over
    wait_for(lambda: len([e for e in events(path) if e[0] == "start"]) >= 2,
             FAST["pulse_lease_ttl"] + 15, "b to run the task taken over from paused a")
    row = store_db.get(task_id)
    assert row.holder.startswith("b@") and row.epoch >= 2 and row.state == "running", row
    a.signal(signal.SIGCONT)

    line = a.wait_log(rf"WARNING/\S+\] pulse: task pulseapp\.late_sleep\[{task_id}\] lost its "
                      rf"lease: was held by (a@\S+) at epoch 1; (b@\S+) holds epoch (\d+) "
                      rf"\(running\)", timeout=15)
    assert line.group(1).startswith("a@")
    assert (line.group(2), int(line.group(3))) == (row.holder, row.epoch)
    wait_event(path, "lost", 10, (a,))
    wait_for(lambda: re.search(rf"{task_id}\] raised expected: LeaseLost", a.log()), 10,
             "Celery's own line about the failure")
    log = a.log()
    about_task = [ln for ln in log.splitlines() if task_id in ln]
    print("\n".join(about_task))
    warnings = [ln for ln in about_task if re.search(r"\[[^\]]*: (WARNING|ERROR)/", ln)]
    assert len(warnings) == 1 and line.group(0) in warnings[0], about_task
    assert "Traceback" not in log, log[-4000:]
    assert "raised unexpected" not in log
    assert b.proc.poll() is None and a.proc.poll() is None


def test_a_worker_start_logs_no_alembic_lines_and_leadership_at_info(
        sqlite_url: str, redis_url: str, make_env: Callable[..., Env],
        workers: Callable[..., Worker]) -> None:
    env = make_env(sqlite_url, redis_url, FAST)
    w = workers(env, "starting@%h").wait_ready()
    w.wait_log(r"is now the leader of beat", timeout=15)
    log = w.log()
    # Celery's log format has no logger name: Alembic's lines are known by their text.
    alembic = re.compile(r"alembic|Context impl \w+|Will assume \S+ DDL|Running upgrade",
                         re.IGNORECASE)
    assert not [ln for ln in log.splitlines() if alembic.search(ln)], log
    (leader,) = [ln for ln in log.splitlines() if "is now the leader of beat" in ln]
    assert "INFO/MainProcess" in leader, leader
