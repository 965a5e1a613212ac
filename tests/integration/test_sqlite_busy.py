"""SQLite under several processes: a process holding the file's write lock (a worker
frozen mid-transaction by SIGSTOP or a GC pause, a slow writer under CPU load) never
fails the others' reads, and their writes wait for it instead of failing.

The lock holder is a real second process with its own connection to the file.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_pulse.store.sql import SqlStore, open_store

#: How long the holder keeps its write transaction once told to finish it.
HOLD = 1.0

HOLDER = textwrap.dedent("""
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
    conn.execute("BEGIN IMMEDIATE")  # the write lock, as a pulse write transaction takes it
    conn.execute("CREATE TABLE IF NOT EXISTS pt_holder (n INTEGER)")
    conn.execute("INSERT INTO pt_holder VALUES (1)")
    print("locked", flush=True)
    sys.stdin.readline()             # held until the test says so, then HOLD more seconds
    time.sleep(float(sys.argv[2]))
    conn.execute("COMMIT")
    print("released", flush=True)
""")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    opened = open_store(f"sqlite:///{tmp_path / 'pulse.sqlite3'}", check_schema=False)
    opened.migrate()
    yield opened
    opened.close()


@pytest.fixture
def holder(store: SqlStore) -> Iterator[subprocess.Popen[str]]:
    """A second process inside a write transaction on the store's file."""
    database = store.engine.url.database
    assert database
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, database, str(HOLD)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_reads_do_not_wait_for_a_writer_and_writes_wait_it_out(
        store: SqlStore, holder: subprocess.Popen[str]) -> None:
    # Registered before the lock was taken; read while another process holds it.
    assert holder.poll() is None
    workers = store.list_workers()  # used to wait for the lock (and fail after 30 s)
    store.claim_counts()
    store.get_leader("beat")
    assert store.now() > 0
    assert workers == []
    assert holder.poll() is None, "the holder let go before the reads were done"

    # A write waits for the holder's commit (HOLD seconds after this) and then succeeds.
    assert holder.stdin is not None
    holder.stdin.write("finish\n")
    holder.stdin.flush()
    started = time.monotonic()
    store.register("after@h", {"pid": 1}, 30.0)
    waited = time.monotonic() - started
    assert waited >= HOLD * 0.8, f"wrote after {waited:.2f}s while the file was locked"
    assert holder.wait(30) == 0
    assert holder.stdout is not None and holder.stdout.read().strip() == "released"
    assert [w.worker_id for w in store.list_workers()] == ["after@h"]
