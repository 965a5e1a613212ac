"""``celery -A app pulse credentials create|list|revoke`` as an operator runs them (issue 18).

Real ``celery`` processes against a SQLite and a PostgreSQL store; what they create is
checked with the store's own :meth:`authenticate`, the way the gateway will.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator

import pytest

from celery_pulse.gateway.credentials import CONNECT, CONSUME, Unauthenticated, parse_token
from celery_pulse.store.sql import SqlStore, open_store
from tests.helpers.workers import Env


@pytest.fixture(params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, make_env: Callable[..., Env]) -> Env:
    url: str = request.getfixturevalue({"sqlite": "sqlite_url", "postgres": "pg_url"}[
        request.param])
    made = make_env(url, "memory://")
    made.app = "tests.apps.opsapp"
    return made


@pytest.fixture
def store(env: Env) -> Iterator[SqlStore]:
    opened = open_store(env.store_url)
    try:
        yield opened
    finally:
        opened.close()


def _ok(env: Env, *args: str) -> str:
    proc = env.celery("pulse", "credentials", *args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


def _refused(env: Env, *args: str) -> str:
    proc = env.celery("pulse", "credentials", *args)
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_create_list_revoke(env: Env, store: SqlStore) -> None:
    proc = env.celery("pulse", "credentials", "create", "runner-1", "--queue", "objects",
                      "--queue", "images")
    assert proc.returncode == 0, proc.stderr
    token = proc.stdout.strip()
    assert proc.stdout == token + "\n"  # the token alone: TOKEN=$(celery ... create ...)
    credential_id, secret = parse_token(token)
    assert credential_id in proc.stderr and "once" in proc.stderr
    record = store.credentials.authenticate(token)
    assert (record.name, record.credential_id) == ("runner-1", credential_id)
    assert record.scopes == {CONNECT, CONSUME} and record.queues == ("images", "objects")
    assert "@" in record.created_by

    listed = _ok(env, "list", "--json")
    assert secret not in listed and token not in listed
    assert "digest" not in listed
    [row] = json.loads(listed)
    assert row["name"] == "runner-1" and row["credential_id"] == credential_id
    assert row["active"] is True and row["queues"] == ["images", "objects"]
    assert row["scopes"] == [CONNECT, CONSUME]
    text = _ok(env, "list")
    assert "runner-1" in text and credential_id in text and secret not in text

    assert "revoked" in _ok(env, "revoke", "runner-1")
    with pytest.raises(Unauthenticated):
        store.credentials.authenticate(token)
    again = _ok(env, "revoke", credential_id)  # idempotent, by id too
    assert "runner-1" in again
    [row] = json.loads(_ok(env, "list", "--json"))
    assert row["active"] is False and row["revoked_at"] is not None
    assert "@" in row["revoked_by"]
    assert "revoked" in _ok(env, "list")


def test_output_writes_a_private_credentials_file(env: Env, store: SqlStore) -> None:
    path = env.tmp / "worker.credentials.json"
    out = _ok(env, "create", "runner-2", "--queue", "objects", "--scope", CONNECT,
              "--scope", CONSUME, "--output", str(path))
    assert str(path) in out and "pgw1_" not in out
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    written = json.loads(path.read_text())
    assert set(written) == {"credential_id", "name", "token"}
    record = store.credentials.authenticate(written["token"])
    assert (record.credential_id, record.name) == (written["credential_id"], "runner-2")

    # an existing file is not overwritten, and nothing is created for it
    refused = _refused(env, "create", "runner-3", "--queue", "objects", "--output", str(path))
    assert "exists" in refused
    assert json.loads(path.read_text()) == written
    assert [c.name for c in store.credentials.list_credentials()] == ["runner-2"]


def test_connect_only_scope(env: Env, store: SqlStore) -> None:
    token = _ok(env, "create", "watcher", "--scope", CONNECT).strip()
    record = store.credentials.authenticate(token)
    assert record.scopes == {CONNECT} and record.queues == ()


def test_mistakes_are_clear_errors(env: Env, store: SqlStore) -> None:
    assert "at least one queue" in _refused(env, "create", "runner")
    assert "unknown scope" in _refused(env, "create", "runner", "--queue", "q",
                                       "--scope", "workers:admin")
    assert "invalid credential name" in _refused(env, "create", "no spaces", "--queue", "q")
    _ok(env, "create", "runner", "--queue", "q")
    assert "already exists" in _refused(env, "create", "runner", "--queue", "q")
    assert "no credential" in _refused(env, "revoke", "nobody")
    assert [c.name for c in store.credentials.list_credentials()] == ["runner"]


def test_expiry_and_rotation_from_the_command_line(env: Env, store: SqlStore) -> None:
    token = _ok(env, "create", "temp", "--queue", "q", "--expires-in", "1h").strip()
    [row] = json.loads(_ok(env, "list", "--json"))
    assert row["expires_at"] == pytest.approx(store.now() + 3600, abs=60)
    assert row["active"] is True and row["expired"] is False
    assert "expires 20" in _ok(env, "list")
    path = env.tmp / "rotated.json"
    out = _ok(env, "rotate", "temp", "--grace", "10m", "--output", str(path))
    assert "rotated" in out and "600 s" in out and "pgw1_" not in out
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    new = json.loads(path.read_text())["token"]
    for live in (token, new):  # two live secrets during the grace
        assert store.credentials.authenticate(live).name == "temp"
    [row] = json.loads(_ok(env, "list", "--json"))
    assert row["rotated_at"] is not None and "@" in row["rotated_by"]
    assert row["previous_secret_until"] == pytest.approx(row["rotated_at"] + 600, abs=1)
    assert "rotated 20" in _ok(env, "list")
    for wrong in ("--expires-in", "soon"), ("--expires-in", "-5m"):
        assert "duration" in _refused(env, "create", "temp2", "--queue", "q", *wrong)
    assert "expiry" in _refused(env, "create", "temp2", "--queue", "q", "--expires-in", "0")
    assert "no credential" in _refused(env, "rotate", "nobody")
    _ok(env, "revoke", "temp")
    assert "revoked" in _refused(env, "rotate", "temp")
