"""The Pulse page inside Flower: a real ``celery pulse flower`` process, its JSON API, its
auth and XSRF, its ``--url_prefix``, and a real headless Chromium pressing its buttons.

Claims are seeded through the store's own API (the rows a worker writes) where a test is
about the page's reading and filtering; the browser test runs real ``-P pulse`` workers,
kills one with SIGKILL and lets the other's Recover move its task to review.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from celery_pulse.store.base import (
    NEEDS_REVIEW,
    Completion,
    Grant,
    Message,
    Permit,
    ReserveRequest,
)
from celery_pulse.store.sql import SqlStore, open_store
from tests.helpers.services import IN_CI
from tests.helpers.workers import ROOT, Env, Worker, wait_for

FAST = {"pulse_worker_ttl": 3, "pulse_heartbeat_interval": 0.5, "pulse_lease_ttl": 3,
        "pulse_renew_interval": 0.5, "pulse_revoke_grace": 2, "pulse_leader_ttl": 3,
        "pulse_leader_interval": 1, "worker_send_task_events": True,
        "task_send_sent_event": True,
        "beat_schedule": {"hourly": {"task": "opsapp.noop", "schedule": 3600.0}}}
ARTIFACTS = ROOT / "test-artifacts"
#: ``PULSE_DOCS_SCREENSHOTS=1``: the browser test also writes its screenshots to docs/img.
DOCS_IMG = ROOT / "docs" / "img"
HOLDER = "seed@host"
STATES = "reserved, running, open, succeeded, failed, needs_review, revoked"


class Answer:
    def __init__(self, status: int, body: bytes, headers: Any) -> None:
        self.status, self.body, self.headers = status, body, headers

    def json(self) -> Any:
        return json.loads(self.body)

    def ok(self) -> Any:
        """The JSON of a 200 answer (anything else fails, showing the body)."""
        assert self.status == 200, (self.status, self.text[:2000])
        return self.json()

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


def http(method: str, url: str, data: dict[str, Any] | None = None,
         headers: dict[str, str] | None = None, opener: Any = None) -> Answer:
    body = None if data is None else urlencode(data, doseq=True).encode()
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with (opener or urllib.request.build_opener()).open(req, timeout=15) as resp:
            return Answer(resp.status, resp.read(), resp.headers)
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read(), exc.headers)


class PulseFlower:
    """One ``celery -A app pulse flower ...`` process, killed by the fixture."""

    def __init__(self, env: Env, *args: str, variables: dict[str, str] | None = None,
                 prefix: str = "") -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.log_path = env.tmp / f"flower-{port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        variables = {**env.vars(), **(variables or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", env.app, "pulse", "flower",
             f"--port={port}", "--address=127.0.0.1", *args],
            env=variables, cwd=env.tmp, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.root = f"http://127.0.0.1:{port}"
        self.url = self.root + (f"/{prefix}" if prefix else "")

    def wait_ready(self) -> PulseFlower:
        def answers() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"flower exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                return http("GET", self.url + "/healthcheck").status == 200
            except OSError:
                return False
        wait_for(answers, 60, "celery pulse flower to answer")
        return self

    def get(self, path: str, **kwargs: Any) -> Answer:
        return http("GET", self.url + path, **kwargs)

    def post(self, path: str, data: dict[str, Any], **kwargs: Any) -> Answer:
        return http("POST", self.url + path, data, **kwargs)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()


@pytest.fixture
def page_env(pg_url: str, rabbitmq_url: str, make_env: Callable[..., Env]) -> Env:
    env = make_env(pg_url, rabbitmq_url, FAST)
    env.app = "tests.apps.pageapp"
    return env


@pytest.fixture
def flower(page_env: Env) -> Iterator[Callable[..., PulseFlower]]:
    """``flower(*flower_args, variables=..., prefix=...)``: a ready Flower with pulse's pages."""
    started: list[PulseFlower] = []

    def start(*args: str, variables: dict[str, str] | None = None,
              prefix: str = "") -> PulseFlower:
        f = PulseFlower(page_env, *args, variables=variables, prefix=prefix)
        started.append(f)
        return f.wait_ready()

    yield start
    for f in started:
        f.stop()


OPEN_API = {"FLOWER_UNAUTHENTICATED_API": "true"}


@pytest.fixture
def store(page_env: Env) -> Iterator[SqlStore]:
    opened = open_store(page_env.store_url)
    yield opened
    opened.close()


def seed(store: SqlStore, *, name: str = "page.charge", queue: str = "billing",
         holder: str = HOLDER, start: bool = False, review: bool = False) -> Grant:
    """A claim as a worker writes it; ``review``: its holder then said "I can't tell"."""
    task_id = str(uuid.uuid4())
    body = json.dumps([[42], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                  "chord": None}]).encode()
    headers = {"lang": "py", "task": name, "id": task_id, "root_id": task_id, "retries": 0,
               "argsrepr": "(42,)", "kwargsrepr": "{}"}
    # The default exchange: a retry re-publishes to a queue nobody consumes, harmlessly.
    message = Message(body, headers, {"correlation_id": task_id, "delivery_mode": 2},
                      {"exchange": "", "routing_key": queue}, "application/json", "utf-8")
    (grant,) = store.reserve(holder, [ReserveRequest(task_id, name, message, "review", 5)], 60)
    assert isinstance(grant, Grant), grant
    if start or review:
        assert store.start(holder, task_id, grant.epoch, grant.token, 60) is not None
    if review:
        done = store.complete(holder, [Completion(task_id, grant.epoch, grant.token,
                                                  NEEDS_REVIEW, "the card network timed out")])
        assert done == {task_id: "applied"}, done
    return grant


def state_of(store: SqlStore, task_id: str) -> tuple[str, int]:
    detail = store.claim_detail(task_id)
    assert detail is not None
    return detail.claim.state, detail.claim.epoch


# -- the JSON API: filters, pagination, bad input ------------------------------------------

def test_claims_api_filters_paginates_and_answers_400_naming_valid_values(
        flower: Callable[..., PulseFlower], store: SqlStore) -> None:
    made = {}
    for i in range(7):
        g = seed(store, name=f"page.t{i % 2}", queue=f"q{i % 3}", holder=f"h{i % 2}@host",
                 start=bool(i % 2))
        made[g.task_id] = {"task": f"page.t{i % 2}", "queue": f"q{i % 3}",
                           "worker": f"h{i % 2}@host", "state": "running" if i % 2 else "reserved"}
    f = flower(variables=OPEN_API)

    every = f.get("/api/pulse/claims").ok()
    assert every["total"] == 7 and {c["task_id"] for c in every["claims"]} == set(made)
    for key, value in [("state", "running"), ("task", "page.t0"), ("queue", "q1"),
                       ("worker", "h1@host")]:
        got = f.get(f"/api/pulse/claims?{key}={value}").ok()
        want = {t for t, m in made.items() if m[key] == value}
        assert {c["task_id"] for c in got["claims"]} == want and got["total"] == len(want), key
    both = f.get("/api/pulse/claims?state=running&queue=q1").ok()
    assert {c["task_id"] for c in both["claims"]} == {
        t for t, m in made.items() if m["state"] == "running" and m["queue"] == "q1"}

    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        page = f.get("/api/pulse/claims?" + urlencode(
            {"limit": 3, **({"after": cursor} if cursor else {})})).ok()
        assert page["total"] == 7 and len(page["claims"]) <= 3
        seen += [c["task_id"] for c in page["claims"]]
        pages += 1
        cursor = page["next"]
        if cursor is None:
            break
    assert pages == 3 and sorted(seen) == sorted(made) and len(set(seen)) == 7
    created = [c["created_at"] for c in every["claims"]]
    assert created == sorted(created, reverse=True)  # newest first

    bad = f.get("/api/pulse/claims?state=bogus")
    assert bad.status == 400 and "'bogus'" in bad.json()["error"]
    assert STATES in bad.json()["error"]
    assert f.get("/api/pulse/claims?limit=0").status == 400
    unknown = f.get("/api/pulse/claims?colour=red")
    assert unknown.status == 400 and "state, queue, task, worker, limit" in unknown.text
    assert f.get("/pulse/claims?state=bogus").status == 400  # the page refuses it too

    one = next(iter(made))
    detail = f.get(f"/api/pulse/claim/{one}").ok()
    assert detail["claim"]["task_id"] == one and "42" in detail["args_summary"]
    assert f.get("/api/pulse/claim/no-such-task").status == 404

    page = f.get("/pulse/claims?state=running")
    assert page.status == 200
    assert all((t in page.text) == (m["state"] == "running") for t, m in made.items())
    for path in ("/api/pulse/workers", "/api/pulse/leader", "/api/pulse/permits"):
        answer = f.get(path)
        assert answer.status == 200 and "now" in answer.json(), path
    for path in ("/pulse/workers", "/pulse/leader", "/pulse/permits", "/pulse/review",
                 f"/pulse/claim/{one}"):
        assert f.get(path).status == 200, path
    assert 'href="/pulse"' in f.get("/workers").text  # "Pulse" in Flower's own navbar


def test_the_permits_page_shows_a_rate_as_starts_per_window(
        flower: Callable[..., PulseFlower], store: SqlStore) -> None:
    """A rate key (issue 39) is shown with its window, the starts in it and its waiters,
    beside a concurrency key with its holders."""
    rate, permit = Permit("rate:task:page.charge", 2, 60.0), Permit("task:page.refund", 5)
    charges = [seed(store) for _ in range(3)]
    refund = seed(store, name="page.refund")
    waiting: set[str] = set()
    started = store.start_many(HOLDER, [(g.task_id, g.epoch, g.token) for g in charges], 60,
                               {g.task_id: [rate] for g in charges}, waiting)
    assert len(started) == 2 and len(waiting) == 1
    assert store.start_many(HOLDER, [(refund.task_id, refund.epoch, refund.token)], 60,
                            {refund.task_id: [permit]})
    f = flower(variables=OPEN_API)
    rows = {p["key"]: p for p in f.get("/api/pulse/permits").ok()["permits"]}
    assert (rows["rate:task:page.charge"]["window"], rows["rate:task:page.charge"]["held"],
            rows["rate:task:page.charge"]["waiting"]) == (60.0, 2, 1)
    assert (rows["task:page.refund"]["window"], rows["task:page.refund"]["held"]) == (None, 1)
    page = f.get("/pulse/permits").text
    assert "2 per 60 s" in page and "2 started in the window" in page


def test_drain_and_undrain_from_the_api_and_the_page(
        flower: Callable[..., PulseFlower], store: SqlStore) -> None:
    store.register("w9@host", {"pool": "pulse"}, 60)
    f = flower(variables=OPEN_API)

    def state() -> str:
        rows = f.get("/api/pulse/workers").ok()["workers"]
        return next(str(w["state"]) for w in rows if w["id"] == "w9@host")
    assert state() == "alive"
    assert f.post("/api/pulse/worker/drain/w9@host", {}).ok()["draining"] is True
    assert state() == "draining"
    assert 'value="undrain"' in f.get("/pulse/workers").text
    assert f.post("/api/pulse/worker/undrain/w9@host", {}).ok()["draining"] is False
    assert state() == "alive"
    missing = f.post("/api/pulse/worker/drain/nobody@host", {})
    assert missing.status == 404 and "nobody@host" in missing.text


# -- review actions: once, and 409 on a claim that moved on -----------------------------------

def test_review_actions_apply_once_and_answer_409_when_the_claim_moved_on(
        page_env: Env, flower: Callable[..., PulseFlower], store: SqlStore) -> None:
    failed, retried = seed(store, review=True), seed(store, review=True)
    bulk = [seed(store, review=True, name="page.bulk") for _ in range(2)]
    f = flower(variables=OPEN_API)

    assert f.get("/api/pulse/review?limit=2").ok()["total"] == 4
    items = {i["task_id"]: i for i in f.get("/api/pulse/review").ok()["items"]}
    assert set(items) == {failed.task_id, retried.task_id, *(g.task_id for g in bulk)}
    assert "the card network timed out" in items[failed.task_id]["reason"]

    form = {"task_id": failed.task_id, "epoch": failed.epoch, "outcome": "failed",
            "note": "refunded"}
    first = f.post("/api/pulse/review/resolve", form)
    assert first.status == 200, first.text
    assert state_of(store, failed.task_id) == ("failed", failed.epoch)
    again = f.post("/api/pulse/review/resolve", {**form, "outcome": "succeeded"})
    assert again.status == 409, again.text
    assert failed.task_id in again.json()["error"]
    assert state_of(store, failed.task_id) == ("failed", failed.epoch)  # nothing changed
    audit = store.claim_detail(failed.task_id)
    assert audit is not None and [r.outcome for r in audit.reviews] == ["failed"]
    cli = page_env.celery("pulse", "review", "resolve", failed.task_id, "--outcome",
                          "succeeded", "--epoch", str(failed.epoch))  # the same module
    assert cli.returncode == 1 and "nothing was changed" in cli.stderr, cli.stderr

    go = f.post("/api/pulse/review/retry", {"task_id": retried.task_id,
                                             "epoch": retried.epoch})
    assert go.status == 200, go.text
    (done,) = go.json()["done"]
    assert done["epoch"] > retried.epoch
    twice = f.post("/api/pulse/review/retry", {"task_id": retried.task_id,
                                                "epoch": retried.epoch})
    assert twice.status == 409, twice.text
    assert state_of(store, retried.task_id)[1] == done["epoch"]

    assert f.post("/api/pulse/review/resolve", {"task_id": bulk[0].task_id,
                                                 "outcome": "maybe"}).status == 400
    assert f.post("/api/pulse/review/retry", {}).status == 400
    everything = f.post("/api/pulse/review/resolve", {"all": 1, "task": "page.bulk",
                                                       "outcome": "succeeded"}).json()
    assert sorted(d["task_id"] for d in everything["done"]) == sorted(g.task_id for g in bulk)
    assert all(state_of(store, g.task_id)[0] == "succeeded" for g in bulk)
    assert f.get("/api/pulse/review").json()["items"] == []

    # Flower, a real event receiver, saw the events the actions sent.
    def flower_says(task_id: str, state: str) -> dict[str, Any] | None:
        answer = f.get(f"/api/task/info/{task_id}")
        info = answer.json() if answer.status == 200 else None
        return info if info and info.get("state") == state else None
    shown = wait_for(lambda: flower_says(failed.task_id, "FAILURE"), 30,
                     "Flower to show the resolved-failed task FAILED", interval=0.5)
    assert "resolved failed by" in shown["exception"] and "refunded" in shown["exception"]
    assert shown["worker"] == HOLDER  # sent as the claim's last holder: no phantom node
    again_shown = wait_for(lambda: flower_says(retried.task_id, "RETRY"), 30,
                           "Flower to show the retried task RETRY", interval=0.5)
    # No exception (Flower would keep showing it after the new attempt succeeds): the
    # who and why go in the event's ``reason``, which Flower's task state does not keep.
    assert not again_shown["exception"] and again_shown["worker"] == HOLDER


# -- auth, XSRF, url_prefix ----------------------------------------------------------------------

def test_a_forged_post_needs_the_xsrf_token_and_the_api_needs_flowers_auth(
        flower: Callable[..., PulseFlower], store: SqlStore) -> None:
    item = seed(store, review=True)
    f = flower(variables=OPEN_API)
    form = {"task_id": item.task_id, "epoch": item.epoch, "outcome": "failed"}
    forged = f.post("/api/pulse/review/resolve", form,
                    headers={"Origin": "http://evil.example", "Cookie": "_xsrf=forged"})
    assert forged.status == 403, forged.text
    page_post = f.post("/pulse/review/action", {**form, "action": "failed"},
                       headers={"Sec-Fetch-Site": "same-origin"})
    assert page_post.status == 403, page_post.text
    assert state_of(store, item.task_id) == (NEEDS_REVIEW, item.epoch)

    # The page's own form carries the token of its cookie: that POST goes through.
    jar = CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    assert http("GET", f.url + "/pulse/review", opener=browser).status == 200
    token = next(c.value for c in jar if c.name == "_xsrf")
    done = http("POST", f.url + "/pulse/review/action",
                {**form, "action": "failed", "_xsrf": token}, opener=browser)
    assert done.status == 200 and "resolved failed" in done.text, done.text
    assert state_of(store, item.task_id)[0] == "failed"
    twice = http("POST", f.url + "/pulse/review/action",
                 {**form, "action": "succeeded", "_xsrf": token}, opener=browser)
    assert twice.status == 200 and "nothing was changed" in twice.text, twice.text
    assert state_of(store, item.task_id)[0] == "failed"

    frozen = flower("--read_only=true", variables=OPEN_API)
    last = seed(store, review=True)
    refused = frozen.post("/api/pulse/review/retry", {"task_id": last.task_id})
    assert refused.status == 403 and "read_only" in refused.text, refused.text
    assert state_of(store, last.task_id) == (NEEDS_REVIEW, last.epoch)
    assert 'value="retry"' not in frozen.get("/pulse/review").text

    locked = flower("--basic_auth=op:s3cret")
    assert locked.get("/api/pulse/claims").status == 401
    auth = {"Authorization": "Basic " + __import__("base64").b64encode(b"op:s3cret").decode()}
    assert locked.get("/api/pulse/claims", headers=auth).status == 200
    other = seed(store, review=True)
    ok = locked.post("/api/pulse/review/retry", {"task_id": other.task_id}, headers=auth)
    assert ok.status == 200, ok.text
    detail = store.claim_detail(other.task_id)
    assert detail is not None and detail.reviews[-1].decided_by.startswith("op@")
    logged = f"pulse: review retry of page.charge [{other.task_id}] by op@"
    wait_for(lambda: logged in locked.log_path.read_text(), 10, "the action in Flower's log")


def test_url_prefix_moves_pages_api_and_navigation_under_it(
        flower: Callable[..., PulseFlower], store: SqlStore) -> None:
    seed(store, review=True)
    f = flower("--url_prefix=ops", variables=OPEN_API, prefix="ops")
    assert f.get("/api/pulse/review").status == 200
    page = f.get("/pulse/review")
    assert page.status == 200
    assert 'href="/ops/pulse"' in page.text and 'action="/ops/pulse/review/action"' in page.text
    assert http("GET", f.root + "/api/pulse/review").status == 404


def test_a_store_without_schema_is_a_503_saying_so_and_flower_still_serves(
        flower: Callable[..., PulseFlower], tmp_path: Path) -> None:
    empty = f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}"
    f = flower(variables={**OPEN_API, "PULSE_TEST_STORE": empty})
    answer = f.get("/api/pulse/claims")
    assert answer.status == 503 and "pulse migrate" in answer.json()["error"], answer.text
    assert f.get("/pulse/review").status == 503
    assert f.get("/workers").status == 200  # Flower's own pages do not need the store


# -- the acceptance scenario in a real browser --------------------------------------------------

def flower_task_page_shows(page: Any, url: str, state: str) -> None:
    """Flower's task page is rendered once per load: reload it until it shows ``state``
    (the events reach Flower a moment after the store has moved)."""
    def shown() -> bool:
        page.goto(url)
        return state in page.locator("body").inner_text()
    wait_for(shown, 30, f"Flower's task page to show {state}", interval=0.5)


def test_browser_kill_9_review_reason_then_retry_runs_once_on_the_other_worker(
        page_env: Env, flower: Callable[..., PulseFlower], store: SqlStore,
        workers: Callable[..., Worker], tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        if IN_CI:
            pytest.fail("chromium is not installed (CI=true: .ci/run installs it)")
        pytest.skip("chromium is not installed")
    from playwright.sync_api import expect, sync_playwright

    from tests.apps.pageapp import app

    app.conf.broker_url = page_env.broker_url
    gate, journal = tmp_path / "gate", tmp_path / "journal.txt"
    a = workers(page_env, "a@%h").wait_ready()
    a_name = a.wait_log(r"pulse: registered (\S+)").group(1)
    f = flower(variables=OPEN_API)
    assert page_env.tmp == tmp_path  # the workers' working directory: short paths
    task_id = app.send_task("pageapp.gated", args=[gate.name, journal.name],
                            queue=page_env.queue).id
    wait_for(lambda: journal.exists() and "start" in journal.read_text(), 30, "the task to start")
    b = workers(page_env, "b@%h").wait_ready()
    b_name = b.wait_log(r"pulse: registered (\S+)").group(1)
    a.kill()
    wait_for(lambda: state_of(store, task_id)[0] == NEEDS_REVIEW, 30,
             "b's Recover to move the task to review")
    gate.touch()  # the retried attempt finishes at once

    def beat_shown() -> dict[str, Any] | None:
        data = f.get("/api/pulse/leader").ok()
        leader, (entry,) = data["leader"], data["entries"]
        return data if leader and leader["alive"] and entry["last_slot"] else None
    beat = wait_for(beat_shown, 30, "the leader page to show the beat leader and its slot")
    assert beat["leader"]["holder"] in (a_name, b_name) and beat["leader"]["epoch"] >= 1
    (entry,) = beat["entries"]
    assert entry["name"] == "hourly"
    assert entry["next_slot"] == pytest.approx(entry["last_slot"] + 3600, abs=0.01)

    shots = [ARTIFACTS] + ([DOCS_IMG] if os.environ.get("PULSE_DOCS_SCREENSHOTS") else [])

    def shot(page: Any, name: str) -> None:
        for folder in shots:
            folder.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(folder / f"pulse-{name}.png"), full_page=True)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f.url + "/pulse/review")
            row = page.locator(f'#pulse-review tr[data-task-id="{task_id}"]')
            expect(row).to_be_visible()
            reason = row.locator(".pulse-reason").inner_text()
            assert a_name in reason and "lost" in reason, reason
            shot(page, "review")

            flower_task_page_shows(page, f.url + f"/task/{task_id}", "FAILURE")
            expect(page.locator("body")).to_contain_text("NeedsReview")
            expect(page.locator("body")).to_contain_text(f"{a_name} lost its lease")
            shot(page, "flower-task-in-review")

            page.goto(f.url + "/pulse/review")
            row = page.locator(f'#pulse-review tr[data-task-id="{task_id}"]')
            row.locator('input[name="note"]').fill("checked: never charged")
            row.locator('button[value="retry"]').click()
            expect(page.locator("#pulse-message")).to_contain_text(f"retried: {task_id}")

            page.goto(f.url + f"/pulse/claim/{task_id}")
            expect(page.locator("#pulse-claim")).to_be_visible()
            expect(page.locator("#pulse-live .badge").first).to_have_text(
                "succeeded", timeout=30_000)  # the page refreshes itself
            expect(page.locator("#pulse-audit")).to_contain_text("checked: never charged")
            shot(page, "claim")
            page.goto(f.url + "/pulse/claims")
            shot(page, "claims")
            page.goto(f.url + "/pulse/workers")
            expect(page.locator(f'#pulse-workers tr[data-worker="{b_name}"]')).to_contain_text(
                "alive")
            shot(page, "workers")
            page.goto(f.url + "/pulse/leader")
            shot(page, "leader")
            flower_task_page_shows(page, f.url + f"/task/{task_id}", "SUCCESS")
            assert "NeedsReview" not in page.locator("body").inner_text()  # the new attempt's
        finally:
            browser.close()

    lines = journal.read_text().splitlines()
    assert [ln.split()[:2] for ln in lines] == [["start", a_name], ["start", b_name],
                                               ["end", b_name]], lines
