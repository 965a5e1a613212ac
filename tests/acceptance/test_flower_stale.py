"""Flower after a take-over from a paused worker, in a real headless Chromium: the task
page shows the current attempt's SUCCESS only, and the Pulse claim page shows what the
store kept of the stale attempt.

Two real ``celery worker -P pulse -E`` processes with 3-second leases run
:mod:`tests.apps.pageapp`; the worker running an acks_late task is paused with SIGSTOP
past its lease, the other's Recover re-dispatches the task and runs it, and the paused
worker, resumed with SIGCONT, finds its attempt stale (LeaseLost). Fixtures and the
``celery pulse flower`` process are test_flower_pulse's.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from celery_pulse.store.sql import SqlStore
from tests.acceptance.test_flower_pulse import (  # noqa: F401 - fixtures, by name
    ARTIFACTS,
    DOCS_IMG,
    OPEN_API,
    PulseFlower,
    flower,
    flower_task_page_shows,
    page_env,
    store,
)
from tests.helpers import services
from tests.helpers.services import IN_CI
from tests.helpers.workers import Env, Worker, stop_consuming, wait_alive, wait_for

#: How long each attempt of the task runs (the paused one never gets that far).
RUN = 3.0
#: Pause -> the other worker's SUCCESS: the lease runs out (3 s), a Recover scan (2 s),
#: the re-dispatched attempt runs (RUN), plus slack for a busy machine.
BOUND = 3 + 2 + RUN + 20


def chromium_or_skip() -> str:
    chromium = shutil.which("chromium")
    if chromium is None:
        if IN_CI:
            pytest.fail("chromium is not installed (CI=true: .ci/run installs it)")
        pytest.skip("chromium is not installed")
    return chromium


def shot(page: Any, name: str) -> None:
    """``test-artifacts/pulse-NAME.png``, and docs/img's with ``PULSE_DOCS_SCREENSHOTS=1``."""
    for folder in [ARTIFACTS] + ([DOCS_IMG] if os.environ.get("PULSE_DOCS_SCREENSHOTS") else []):
        folder.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(folder / f"pulse-{name}.png"), full_page=True)


def test_browser_paused_then_taken_over_task_shows_success_of_the_current_attempt_only(
        page_env: Env, flower: Callable[..., PulseFlower],  # noqa: F811
        store: SqlStore, workers: Callable[..., Worker],  # noqa: F811
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    chromium = chromium_or_skip()
    from playwright.sync_api import expect, sync_playwright

    from tests.apps.pageapp import app

    app.conf.broker_url = page_env.broker_url
    journal = tmp_path / "journal.txt"
    a = workers(page_env, "a@%h", extra=("-E",)).wait_ready()
    a_name = a.wait_log(r"pulse: registered (\S+)").group(1)
    # b is started now, on a queue of its own, and given the task's queue once a is
    # paused: a worker's start-up takes seconds on a loaded machine, which could outlast
    # the attempt a is to be paused in (a CI run saw it end first).
    idle = f"{page_env.queue}-b"
    request.addfinalizer(lambda: services.tidy_queue(page_env.broker_url, idle))
    b = workers(page_env, "b@%h", extra=("-E", "-Q", idle)).wait_ready()
    b_name = b.wait_log(r"pulse: registered (\S+)").group(1)
    f = flower(variables=OPEN_API)  # before the task: Flower sees all of its events
    task_id = app.send_task("pageapp.late", args=[RUN, journal.name],
                            queue=page_env.queue).id
    wait_for(lambda: journal.exists() and "start" in journal.read_text(), 30, "the task to start")
    # A paused worker's channel stays open: the broker would hand it the re-dispatched
    # delivery as readily as b. It stops consuming first, so the new attempt runs on b.
    stop_consuming(app, a_name, page_env.queue)

    def succeeded() -> tuple[str, int] | None:
        detail = store.claim_detail(task_id)
        assert detail is not None
        claim = detail.claim
        return (claim.holder or "", claim.epoch) if claim.state == "succeeded" else None

    a.signal(signal.SIGSTOP)
    try:
        assert "end" not in journal.read_text(), "a's attempt ended before a was paused"
        added = app.control.add_consumer(page_env.queue, destination=[b_name], reply=True,
                                         timeout=10)
        assert added and b_name in added[0], added
        holder, epoch = wait_alive(succeeded, BOUND, "b to take the task over and succeed",
                                   (b,), interval=0.2)
    finally:
        a.signal(signal.SIGCONT)
    assert holder == b_name and epoch > 1
    a.wait_log(rf"task {task_id} epoch 1 ended failed as a stale attempt")
    assert a.proc.poll() is None  # the paused worker goes on

    # A barrier for Flower: a later task of a's (on a queue of its own) shows SUCCESS,
    # so a's events up to its stale attempt's end have reached Flower.
    def flower_info(tid: str) -> dict[str, Any] | None:
        answer = f.get(f"/api/task/info/{tid}")  # 404 until Flower has seen the task
        return answer.json() if answer.status == 200 else None

    barrier = f"{page_env.queue}-a"
    try:
        added = app.control.add_consumer(barrier, destination=[a_name], reply=True, timeout=10)
        assert added and a_name in added[0], added
        after = app.send_task("opsapp.noop", queue=barrier).id
        wait_for(lambda: (flower_info(after) or {}).get("state") == "SUCCESS", 30,
                 "a's later task to show SUCCESS in Flower", interval=0.5)
    finally:
        services.tidy_queue(page_env.broker_url, barrier)

    info = flower_info(task_id)
    assert info is not None and info["state"] == "SUCCESS", info
    assert info["worker"] == b_name and info["result"] == "'charged'", info
    assert not info.get("exception") and not info.get("failed"), info
    assert not info.get("traceback"), info

    detail = store.claim_detail(task_id)
    assert detail is not None and detail.reviews == []
    assert (detail.claim.outcome, detail.claim.attempts, detail.claim.error) == (
        "succeeded", 2, None), detail.claim
    # A stale attempt that finds out (LeaseLost in its body) records nothing as its own
    # (exits.RequestEnds.lease_lost): the store keeps evidence only of a late completion
    # sent without knowing, so this claim has none.
    assert detail.evidence == [], detail.evidence

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            flower_task_page_shows(page, f.url + f"/task/{task_id}", "SUCCESS")
            fields = [t.strip() for t in page.locator("#task-page dt").all_inner_texts()]
            # Recover's re-dispatch ended the lost attempt as retried; then b's attempt.
            assert {"Worker", "Retried", "Succeeded"} <= set(fields), fields
            for absent in ("Failed", "Exception", "Traceback"):
                assert absent not in fields, (absent, fields)
            body = page.locator("body").inner_text()
            assert "LeaseLost" not in body and "FAILURE" not in body, body
            worker_row = page.locator("#task-page .detail-row", has=page.locator(
                "dt", has_text="Worker"))
            expect(worker_row.locator("dd")).to_have_text(b_name)
            shot(page, "flower-task-taken-over")

            page.goto(f.url + f"/pulse/claim/{task_id}")
            claim = page.locator("#pulse-claim")
            expect(page.locator("#pulse-live .badge").first).to_have_text("succeeded")
            expect(claim.locator("tr", has_text="Holder").locator("td")).to_have_text(b_name)
            expect(claim.locator("tr", has_text="Epoch").locator("td")).to_have_text(str(epoch))
            expect(claim.locator("tr", has_text="Attempts").locator("td")).to_contain_text(
                "2 / ")
            expect(claim.locator("tr", has_text="Error").locator("td")).to_have_text("-")
            expect(page.locator("#pulse-evidence")).to_have_count(0)
            evidence = page.locator("h3", has_text="Evidence")
            expect(evidence.locator("xpath=following-sibling::*[1]")).to_have_text("none")
            shot(page, "claim-taken-over")
        finally:
            browser.close()

    lines = journal.read_text().splitlines()
    assert lines == [f"start {a_name} 1", f"start {b_name} {epoch}",
                     f"end {b_name} {epoch}"], lines
