"""What a new user reads from ``celery -A app pulse status|claims|review``.

Real ``celery -A tests.apps.pulseapp pulse ...`` processes against a real SQLite
store, seeded through the store's own API (the rows a worker and Recover write).
Output goes to a pipe, as in a script or a CI log: colour codes are stripped there,
which is where misaligned columns used to show.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from celery_pulse.store.base import NEEDS_REVIEW, RESERVED, RUNNING, SUCCEEDED, Completion, Grant
from celery_pulse.store.checkpoints import CheckpointWrite, encode_checkpoint
from celery_pulse.store.records import LOST_TOKEN
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.timefmt import iso
from tests.contract.test_recover_contract import request
from tests.helpers.workers import Env, wait_for

APP = "tests.apps.pulseapp"
HOLDER = "w1@host"


@pytest.fixture
def env(sqlite_url: str, tmp_path: Path) -> Env:
    env = Env(sqlite_url, "memory://", "cli-output", tmp_path, app=APP)
    env.celery("pulse", "migrate", check=True)
    return env


@pytest.fixture
def store(env: Env) -> Callable[[], SqlStore]:
    opened: list[SqlStore] = []

    def get() -> SqlStore:
        if not opened:
            opened.append(open_store(env.store_url))
        return opened[0]
    yield get  # type: ignore[misc]
    for s in opened:
        s.close()


def reserved(store: SqlStore, *, policy: str = "redispatch") -> Grant:
    task_id = str(uuid.uuid4())
    (grant,) = store.reserve(HOLDER, [request(task_id, policy=policy)], 60.0)
    assert isinstance(grant, Grant), grant
    return grant


def running(store: SqlStore, *, ttl: float = 60.0, policy: str = "redispatch") -> Grant:
    grant = reserved(store, policy=policy)
    assert store.start(HOLDER, grant.task_id, grant.epoch, grant.token, ttl) is not None
    return grant


def out(env: Env, *args: str, code: int = 0) -> str:
    proc = env.celery("pulse", *args)
    assert proc.returncode == code, proc.stdout + proc.stderr
    return proc.stdout


def test_claims_state_is_validated_and_takes_comma_lists(
        env: Env, store: Callable[[], SqlStore]) -> None:
    a, b = reserved(store()), running(store())
    proc = env.celery("pulse", "claims", "--state", "bogus")
    assert proc.returncode == 2, proc.stdout + proc.stderr  # a usage error, not "no claims"
    assert "unknown state 'bogus'" in proc.stderr
    assert "reserved, running, open, succeeded, failed, needs_review, revoked" in proc.stderr
    proc = env.celery("pulse", "claims", "--state", "running,bogus,nope")
    assert proc.returncode == 2 and "'bogus', 'nope'" in proc.stderr, proc.stderr

    both = env.celery_json("pulse", "claims", "--state", "reserved,running")
    assert {(r["task_id"], r["state"]) for r in both} == {(a.task_id, RESERVED),
                                                          (b.task_id, RUNNING)}
    only = env.celery_json("pulse", "claims", "--state", "running")
    assert [r["task_id"] for r in only] == [b.task_id]
    repeated = env.celery_json("pulse", "claims", "--state", "running", "--state", "reserved")
    assert len(repeated) == 2
    text = out(env, "claims", "--state", "running, reserved").splitlines()
    header = text[0]
    assert header.split() == ["TASK", "ID", "STATE", "HOLDER", "EPOCH", "LEASE", "ATTEMPTS",
                              "CHECKPOINT", "TASK"]
    for line in text[1:]:
        assert line.index(HOLDER) == header.index("HOLDER"), text


def test_review_has_a_header_the_time_it_entered_review_and_the_next_step(
        env: Env, store: Callable[[], SqlStore]) -> None:
    s = store()
    # 1. The holder itself could not tell what its attempt did: a completion to review.
    told = running(s, policy="review")
    before = s.now()
    assert s.complete(HOLDER, [Completion(told.task_id, told.epoch, told.token,
                                          NEEDS_REVIEW, "outcome unknown")]) == {
        told.task_id: "applied"}
    # 2. Its lease expired while running: Recover moved it to review.
    lost = running(s, ttl=0.05, policy="review")
    deadline = time.monotonic() + 15
    while not any(i.task_id == lost.task_id for i in s.recover("w2@host", 10, 5.0)):
        assert time.monotonic() < deadline, "Recover never moved the lost task to review"
        time.sleep(0.05)
    claims = {c.task_id: c for c in s.list_claims([NEEDS_REVIEW])}
    assert claims[told.task_id].finished_at is not None
    assert claims[told.task_id].finished_at >= before

    lines = out(env, "review").splitlines()
    header = lines[0]
    assert header.split()[:7] == ["TASK", "ID", "TASK", "LAST", "HOLDER", "EPOCH", "ATTEMPTS"]
    assert "IN REVIEW SINCE" in header and header.rstrip().endswith("ARGS")
    rows = {line.split()[0]: line for line in lines[1:3]}
    assert set(rows) == {told.task_id, lost.task_id}
    since = header.index("IN REVIEW SINCE")
    assert rows[told.task_id][since:].startswith(iso(claims[told.task_id].finished_at))
    # Recover's move records when (finished_at: retention never purges needs_review).
    assert claims[lost.task_id].finished_at >= claims[lost.task_id].started_at
    assert rows[lost.task_id][since:].startswith(iso(claims[lost.task_id].finished_at))
    for row in rows.values():
        assert row.index(HOLDER) == header.index("LAST HOLDER"), lines
    text = "\n".join(lines)
    assert f"celery -A {APP} pulse review show TASK_ID" in text
    assert f"celery -A {APP} pulse review retry TASK_ID" in text
    assert f"celery -A {APP} pulse review resolve TASK_ID --outcome succeeded|failed" in text

    items = {i["task_id"]: i for i in env.celery_json("pulse", "review")}
    assert items[told.task_id]["entered_review_at"] == claims[told.task_id].finished_at
    assert items[told.task_id]["entered_review"] == iso(claims[told.task_id].finished_at)
    assert items[lost.task_id]["entered_review_at"] == claims[lost.task_id].finished_at
    assert items[lost.task_id]["reason"] == (f"holder {HOLDER} lost its lease at epoch "
                                             f"{lost.epoch} after it started; outcome unknown")
    assert items[told.task_id]["reason"] == "outcome unknown"
    assert {"since", "last_holder", "args_summary", "epoch", "attempts"} <= set(
        items[lost.task_id])  # what scripts read before stays


def test_review_show_lists_the_late_outcomes_of_stale_attempts(
        env: Env, store: Callable[[], SqlStore]) -> None:
    """What the reviewer needs: the lost attempt's late result, kept as evidence."""
    s = store()
    g = running(s, policy="review")
    late = Completion(g.task_id, g.epoch, LOST_TOKEN, SUCCEEDED, returned="'charged'")
    assert s.complete(HOLDER, [late]) == {g.task_id: "evidence"}
    text = out(env, "review", "show", g.task_id)
    assert f"{g.task_id}" in text and "running at epoch 1" in text, text
    (row,) = [line for line in text.splitlines() if "'charged'" in line]
    assert row.split()[:4] == ["1", HOLDER, "succeeded", "'charged'"], text
    payload = env.celery_json("pulse", "review", "show", g.task_id, "--json")
    assert [(e["epoch"], e["outcome"], e["result"], e["error"])
            for e in payload["evidence"]] == [(1, "succeeded", "'charged'", None)]
    assert "no claim for task nope" in env.celery("pulse", "review", "show", "nope").stderr


def test_a_checkpoint_shows_in_claims_review_and_review_show(
        env: Env, store: Callable[[], SqlStore]) -> None:
    """How far a task got: its checkpoint's size and age in the tables, its value in
    ``review show`` (cut at 200 characters; ``--json`` has all of it)."""
    s = store()
    g, plain = running(s, policy="review"), running(s)
    value = {"cursor": 350, "rows": list(range(100))}
    text = encode_checkpoint(value)
    assert s.checkpoint(HOLDER, [CheckpointWrite(g.task_id, g.epoch, g.token, 1, text)])[0] == {
        g.task_id}
    lines = out(env, "claims").splitlines()
    column = lines[0].index("CHECKPOINT")
    (row,) = [line for line in lines if line.startswith(g.task_id)]
    assert row[column:].startswith(f"{len(text)} B, ") and "s ago" in row, lines
    (other,) = [line for line in lines if line.startswith(plain.task_id)]
    assert other[column:].split()[0] == "-", lines
    listed = {r["task_id"]: r for r in env.celery_json("pulse", "claims")}
    assert listed[g.task_id]["checkpoint_size"] == len(text)
    assert 0 <= listed[g.task_id]["checkpoint_age"] < 60
    assert listed[plain.task_id]["checkpoint_at"] is None

    assert s.complete(HOLDER, [Completion(g.task_id, g.epoch, g.token, NEEDS_REVIEW,
                                          "can't tell")]) == {g.task_id: "applied"}
    review = out(env, "review").splitlines()
    (row,) = [line for line in review if line.startswith(g.task_id)]
    assert row[review[0].index("CHECKPOINT"):].startswith(f"{len(text)} B, "), review
    shown = out(env, "review", "show", g.task_id)
    (line,) = [x for x in shown.splitlines() if x.startswith("checkpoint: ")]
    assert line.startswith('checkpoint: {"cursor": 350, "rows": [0, 1, 2') and "…" in line
    assert f"(epoch {g.epoch}, {len(text)} B, written " in line
    payload = env.celery_json("pulse", "review", "show", g.task_id, "--json")
    assert payload["checkpoint"]["value"] == value
    assert "checkpoint: none" in out(env, "review", "show", plain.task_id)


def test_status_columns_line_up_and_the_hint_names_the_app(
        env: Env, store: Callable[[], SqlStore]) -> None:
    s = store()
    s.register("a@h", {"pool": "pulse", "concurrency": 2}, 60.0)
    s.register("a-much-longer-worker-name@some.host", {"pool": "pulse"}, 60.0)
    s.register("gone@h", {"pool": "pulse"}, 0.05)
    deadline = time.monotonic() + 15
    while any(w.alive for w in s.list_workers() if w.worker_id == "gone@h"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    told = running(s, policy="review")
    s.complete(HOLDER, [Completion(told.task_id, told.epoch, told.token, NEEDS_REVIEW)])

    lines = out(env, "status", code=1).splitlines()  # exit 1: a task needs review
    start = next(i for i, line in enumerate(lines) if line.startswith("WORKER"))
    header, rows = lines[start], lines[start + 1:start + 4]
    assert len(rows) == 3 and all("@" in r.split()[0] for r in rows), lines
    for row in rows:
        worker, via, alive, expires, labels = row.split()[:5]
        assert row.index(via, len(worker)) == header.index("VIA"), lines
        assert row.index(alive, header.index("ALIVE")) == header.index("ALIVE"), lines
        # EXPIRES IN is right-aligned: values end where its header ends.
        end = header.index("EXPIRES IN") + len("EXPIRES IN")
        assert row[:end].endswith(expires), lines
        assert row.index(labels, end) == header.index("LABELS"), lines
    assert f"! 1 task(s) need review: celery -A {APP} pulse review" in lines
    payload = json.loads(out(env, "status", "--json", code=1))
    assert payload["needs_attention"] == [f"1 task(s) need review: celery -A {APP} pulse review"]


def test_status_shows_how_far_retention_is_behind(env: Env, store: Callable[[], SqlStore]
                                                  ) -> None:
    """Passes if ``pulse status`` prints retention's lag (0 while nothing finished is past
    ``pulse_retention``) and, once a finished claim is past it, a lag above 0, also in
    ``--json``."""
    env.conf = {"pulse_retention": 0.5, "pulse_purge_interval": 30}
    assert "retention: oldest finished claim 0.0s past pulse_retention (0.5s), purge every " \
           "30s" in out(env, "status").splitlines()
    s = store()
    done = running(s)
    s.complete(HOLDER, [Completion(done.task_id, done.epoch, done.token, SUCCEEDED)])
    wait_for(lambda: s.retention_lag(0.5) > 0.5, 10, "the claim to be past retention")
    payload = json.loads(out(env, "status", "--json"))
    assert payload["retention"]["lag"] > 0.5
    assert payload["retention"]["retention"] == 0.5
    line = next(x for x in out(env, "status").splitlines() if x.startswith("retention:"))
    assert float(line.split()[4].rstrip("s")) > 0.5, line
