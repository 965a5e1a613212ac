"""A lease lost while the body waits inside a database call (issue 35).

Real ``celery worker -P pulse -c 1`` processes; the task keeps its connection at
module level (``tests/apps/dbcallapp.py``), as applications do. The lease is lost the
way a takeover does it (the claim granted to someone else in the store while the task
runs): the next renewal is refused and LeaseLost is raised into the body, which is
inside ``pg_sleep(30)`` / ``SLEEP(30)`` at that moment. The statement is cancelled on the
server, the task ends on LeaseLost, and the five tasks that follow on that pool slot,
through the same module-level connection, succeed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.acceptance.test_leases import (
    FAST,
    Claims,
    _take_over,
    db,  # noqa: F401  (fixture)
    events,
    pid_alive,
    producer,
    wait_event,
)
from tests.conftest import filesystem_broker
from tests.helpers.workers import Env, Worker, wait_for

#: (store server, how the task reaches the database, broker): RabbitMQ, and once the
#: ``filesystem://`` broker, whose worker runs Celery's synchronous loop (no hub).
ROUTES = [("postgres", "psycopg", "rabbitmq"), ("postgres", "sqlalchemy", "rabbitmq"),
          ("mariadb", "pymysql", "rabbitmq"), ("mariadb", "sqlalchemy", "rabbitmq"),
          ("postgres", "psycopg", "filesystem")]

#: Seconds the interrupted statement would still run if nobody cancelled it.
SLEEP_S = 30
#: Seconds after the body saw LeaseLost by which the statement is gone on the server.
CANCELLED_WITHIN_S = 2.5


def _statement_running(store_db: Claims, server: str, session: int) -> bool:
    if server == "mariadb":
        sql = ("SELECT count(*) FROM information_schema.processlist "
               "WHERE id = :sid AND info LIKE 'SELECT SLEEP%%'")
    else:
        sql = ("SELECT count(*) FROM pg_stat_activity WHERE pid = :sid "
               "AND state = 'active' AND query LIKE 'SELECT pg_sleep%%'")
    return bool(store_db.execute(sql, sid=session).scalar_one())


@pytest.mark.parametrize(("server_url", "via", "broker"), ROUTES, indirect=["server_url"],
                         ids=["-".join(route) for route in ROUTES])
def test_lease_lost_inside_a_db_call_ends_leaselost_and_the_slot_stays_usable(
        server_url: str, via: str, broker: str, request: pytest.FixtureRequest,
        tmp_path: Path, make_env: Callable[..., Env], workers: Callable[..., Worker],
        db: Callable[[str], Claims]) -> None:  # noqa: F811
    server = request.node.callspec.params["server_url"]
    if broker == "filesystem":
        broker_url, conf = filesystem_broker(tmp_path)
    else:
        broker_url, conf = request.getfixturevalue("rabbitmq_url"), {}
    env = make_env(server_url, broker_url, {**FAST, **conf})
    env.app = "tests.apps.dbcallapp"
    store_db = db(server_url)
    w = workers(env, "dbcall@%h").wait_ready()
    path = tmp_path / "sleep.txt"
    with producer(env) as client:
        task_id = client.send_task("dbcall.sleep_in_db", args=[str(path), via, SLEEP_S]).id
        _, pid, session = wait_event(path, "start", 20, (w,))
        wait_for(lambda: _statement_running(store_db, server, int(session)), 10,
                 "the statement to run on the server")
        wait_for(lambda: store_db.state(task_id) == "running", 10, "the claim to be running")
        _take_over(store_db, task_id, expired_only=False)

        # The body saw LeaseLost, in the database call, and the task ended on it.
        raised = wait_event(path, "raised", FAST["pulse_renew_interval"] + 10, (w,))
        # PyMySQL closes the connection the interruption passed through, so under
        # SQLAlchemy the body meets the failed rollback on the way out (Celery's tracer
        # logs it); the task still ends on LeaseLost, not as a late outcome to keep.
        closes = (server, via) == ("mariadb", "sqlalchemy")
        if closes:
            assert raised[1].startswith("sqlalchemy.exc."), raised
        else:
            assert raised[1].endswith(".LeaseLost"), raised
        # The statement was cancelled on the server, not left to run its 30 s. (MariaDB
        # ends a SLEEP whose client went away only at its next 5 s check: KILL QUERY.)
        wait_for(lambda: not _statement_running(store_db, server, int(session)),
                 CANCELLED_WITHIN_S, "the interrupted statement to be cancelled on the server")
        w.wait_log(rf"dbcall.sleep_in_db\[{task_id}\] raised "
                   + ("unexpected: InterfaceError" if closes else r"expected: LeaseLost\("))
        w.wait_log(rf"task {task_id} epoch 1 ended failed as a stale attempt")
        assert "kept as evidence only" not in w.log()  # its end was the lost lease
        # The next five tasks on that pool slot, through the same module-level
        # connection, succeed: sent at once, so some reach the pool while the
        # interrupted process is being replaced.
        marker = tmp_path / "next.txt"
        ids = [client.send_task("dbcall.query", args=[str(marker), via]).id for _ in range(5)]
        # The process that was interrupted mid-call is replaced before its next task.
        wait_for(lambda: not pid_alive(int(pid)), 15, "the interrupted process to be replaced")
        wait_for(lambda: len([e for e in events(marker) if e[0] == "ok"]) == 5, 30,
                 "the next five tasks to succeed")
        wait_for(lambda: all(store_db.state(i) == "succeeded" for i in ids), 10,
                 "the next five claims to succeed")
        assert all(int(e[1]) != int(pid) for e in events(marker))
    assert "another command is already in progress" not in w.log()
    assert "Pool callback raised" not in w.log()  # the parent saw a plain LeaseLost
    assert store_db.get(task_id).holder == "thief"  # the stale attempt ended nothing
    assert w.proc.poll() is None
