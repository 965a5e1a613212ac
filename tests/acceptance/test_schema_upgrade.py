"""Rolling upgrades and concurrent ``pulse migrate`` (issue 36), on real databases.

A schema "ahead" of this code is simulated by stamping the version table and the
compatibility row a newer release's migration would have written; no fake migration
files are added to the package.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_pulse.errors import SchemaMissing
from celery_pulse.store.sql import open_store
from celery_pulse.store.sql.migrate import current_revision, head_revision
from tests.conftest import SERVERS, filesystem_broker
from tests.helpers.stores import migrated
from tests.helpers.workers import Env, Worker

HEAD = head_revision()
BEHIND = f"{int(HEAD) - 1:04d}"
AHEAD = f"{int(HEAD) + 1:04d}"


def _stamp(url: str, revision: str, oldest_code: str | None = None) -> None:
    """The schema at head, then marked as at ``revision`` (and what that one declares)."""
    store = migrated(url)
    try:
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE pulse_alembic_version SET version_num = :r"),
                         {"r": revision})
            if oldest_code is not None:
                conn.execute(sa.text("INSERT INTO pulse_schema_compat (revision, oldest_code)"
                                     " VALUES (:r, :o)"), {"r": revision, "o": oldest_code})
    finally:
        store.close()


def _check(url: str) -> None:
    """The store's startup check, as a worker runs it."""
    open_store(url).close()


@pytest.mark.parametrize("server_url", SERVERS, indirect=True)
def test_two_migrates_at_once_both_succeed_and_leave_one_schema(
        server_url: str, tmp_path: Path) -> None:
    env = Env(server_url, "memory://", "migrate", tmp_path)
    argv = [sys.executable, "-m", "celery", "-A", env.app, "pulse", "migrate"]
    procs = [subprocess.Popen(argv, env=env.vars(), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert not any("Traceback" in out for out in outputs), outputs
    assert sum(f"-> {HEAD}" in out for out in outputs) == 1, outputs
    assert sum("already at head" in out for out in outputs) == 1, outputs
    store = open_store(server_url)
    try:
        assert current_revision(store.engine) == HEAD
    finally:
        store.close()


def test_schema_one_revision_behind_is_refused_with_migrate_advice(store_url: str) -> None:
    _stamp(store_url, BEHIND)
    with pytest.raises(SchemaMissing) as refused:
        _check(store_url)
    message = str(refused.value)
    assert f"at revision {BEHIND}" in message and f"(revision {HEAD})" in message, message
    assert "older than this celery-pulse" in message and "pulse migrate" in message, message


def test_newer_schema_declared_compatible_is_used(store_url: str) -> None:
    _stamp(store_url, AHEAD, oldest_code=HEAD)
    store = open_store(store_url)
    try:
        assert store.list_workers() == []
    finally:
        store.close()


@pytest.mark.parametrize("oldest_code", [AHEAD, None], ids=["declared", "undeclared"])
def test_newer_schema_not_compatible_is_refused_with_upgrade_advice(
        store_url: str, oldest_code: str | None) -> None:
    _stamp(store_url, AHEAD, oldest_code=oldest_code)
    with pytest.raises(SchemaMissing) as refused:
        _check(store_url)
    message = str(refused.value)
    assert f"at revision {AHEAD}" in message and f"(revision {HEAD})" in message, message
    assert f"upgrade celery-pulse to a release that knows revision {AHEAD}" in message
    assert "run `celery" not in message, message  # never advise migrating


def test_migrate_by_older_code_says_upgrade_in_one_line(sqlite_url: str,
                                                         tmp_path: Path) -> None:
    _stamp(sqlite_url, AHEAD, oldest_code=AHEAD)
    cli = Env(sqlite_url, "memory://", "migrate", tmp_path).celery("pulse", "migrate")
    assert cli.returncode != 0, cli.stdout
    assert "Traceback" not in cli.stderr and len(cli.stderr.strip().splitlines()) == 1, \
        cli.stderr
    assert f"at revision {AHEAD}" in cli.stderr and "upgrade celery-pulse" in cli.stderr
    assert current_revision(sa.create_engine(sqlite_url)) == AHEAD  # left as it was


@pytest.mark.parametrize(("oldest_code", "runs"), [(HEAD, True), (AHEAD, False)])
def test_a_head_worker_on_a_newer_schema(oldest_code: str, runs: bool, sqlite_url: str,
                                         tmp_path: Path, make_env: Callable[..., Env],
                                         workers: Callable[..., Worker]) -> None:
    broker, conf = filesystem_broker(tmp_path)
    env: Any = make_env(sqlite_url, broker, conf, migrate=False)
    _stamp(sqlite_url, AHEAD, oldest_code=oldest_code)
    worker = workers(env, "rolling@%h")
    if runs:
        worker.wait_ready()
    else:
        assert worker.wait(30) == 78
        assert "upgrade celery-pulse" in worker.log() and "Traceback" not in worker.log(), \
            worker.log()
