"""MariaDB: a lone write (``mark_published``, ``release``, ``deregister``...) that InnoDB
picks as a deadlock's victim is run again, not reported.

CI met it: ``celery pulse review retry`` marked its re-publication against a worker's
Recover scan on the same rows and failed with "store contended during mark_published:
(1213, 'Deadlock found ...')". Here the deadlock is made on purpose, against a second
real connection holding more row locks (InnoDB rolls back the lighter transaction).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import sqlalchemy as sa

from celery_pulse.store.sql.connections import Connections

pytestmark = pytest.mark.mariadb

ROWS = 20


def _waiting_for_a_lock(admin: sa.Connection) -> bool:
    waiting = admin.exec_driver_sql(
        "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'"
    ).scalar()
    admin.rollback()
    return bool(waiting)


def test_a_lone_write_that_loses_a_deadlock_is_run_again(
        mariadb_url: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = sa.create_engine(mariadb_url)
    rows = sa.table("pt_rows", sa.column("id"), sa.column("v"))
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE pt_rows (id INT PRIMARY KEY, v INT NOT NULL)")
            conn.execute(rows.insert(), [{"id": i, "v": 0} for i in range(1, ROWS + 1)])
        conns = Connections(engine)
        answer: list[int | BaseException] = []

        def lone_write() -> None:
            try:  # locks row 1, then waits for row 2
                answer.append(conns.statement("the lone write", sa.update(rows).where(
                    rows.c.id.in_([1, 2])).values(v=rows.c.v + 10)))
            except BaseException as exc:  # reported to the test below
                answer.append(exc)

        caplog.set_level(logging.DEBUG, logger="celery_pulse.store.sql.mysql")
        with engine.connect() as heavy, engine.connect() as admin:
            heavy.exec_driver_sql("BEGIN")
            heavy.execute(sa.update(rows).where(rows.c.id >= 2).values(v=rows.c.v + 1))
            writer = threading.Thread(target=lone_write)
            writer.start()
            deadline = time.monotonic() + 20
            while not _waiting_for_a_lock(admin):
                assert time.monotonic() < deadline, f"the lone write never waited: {answer}"
                time.sleep(0.2)  # InnoDB refreshes this table's cache no more often
            # Row 1 is the lone write's: a cycle. The heavy transaction (19 rows) wins.
            heavy.execute(sa.update(rows).where(rows.c.id == 1).values(v=rows.c.v + 1))
            heavy.exec_driver_sql("COMMIT")
            writer.join(30)
        assert answer == [2], answer
        assert "the lone write rolled back" in caplog.text  # it did lose the deadlock
        with engine.connect() as conn:
            values = {r.id: r.v for r in conn.execute(sa.select(rows.c.id, rows.c.v))}
        assert values[1] == values[2] == 11 and values[3] == 1
    finally:
        engine.dispose()
