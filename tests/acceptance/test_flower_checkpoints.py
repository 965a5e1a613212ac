"""Checkpoints in the Pulse page inside Flower (issue 40): a real ``celery pulse flower``
process, its JSON API and a real headless Chromium. The claim, its checkpoint and its
move to review are written through the store's own API, as a worker writes them.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest

from celery_pulse.store.base import NEEDS_REVIEW, Completion
from celery_pulse.store.checkpoints import CheckpointWrite, encode_checkpoint
from celery_pulse.store.sql import SqlStore
from tests.acceptance import test_flower_pulse as pages
from tests.acceptance.test_flower_pulse import HOLDER, OPEN_API, PulseFlower, seed
from tests.helpers.services import IN_CI

# The Pulse page's fixtures: a real Flower on a PostgreSQL store of the test's own.
page_env, flower, store = pages.page_env, pages.flower, pages.store

VALUE = {"cursor": 350, "file": "export-2026-12.csv"}


def test_a_tasks_checkpoint_shows_in_the_claims_the_claim_and_the_review_queue(
        flower: Callable[..., PulseFlower], store: SqlStore) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        if IN_CI:
            pytest.fail("chromium is not installed (CI=true: .ci/run installs it)")
        pytest.skip("chromium is not installed")
    from playwright.sync_api import expect, sync_playwright

    g = seed(store, start=True)
    plain = seed(store, start=True)
    held, _ = store.checkpoint(HOLDER, [CheckpointWrite(g.task_id, g.epoch, g.token, 1,
                                                        encode_checkpoint(VALUE))])
    assert held == {g.task_id}
    size = len(encode_checkpoint(VALUE))
    f = flower(variables=OPEN_API)

    rows = {c["task_id"]: c for c in f.get("/api/pulse/claims").ok()["claims"]}
    assert rows[g.task_id]["checkpoint_size"] == size
    assert rows[g.task_id]["checkpoint_at"] is not None
    assert rows[plain.task_id]["checkpoint_at"] is None
    detail = f.get(f"/api/pulse/claim/{g.task_id}").ok()
    assert detail["checkpoint"]["value"] == VALUE and detail["checkpoint"]["epoch"] == g.epoch
    assert f.get(f"/api/pulse/claim/{plain.task_id}").ok()["checkpoint"] is None

    # The holder could not tell how it ended: the review queue shows how far it got.
    assert store.complete(HOLDER, [Completion(g.task_id, g.epoch, g.token, NEEDS_REVIEW,
                                              "the card network timed out")]) == {
        g.task_id: "applied"}
    (item,) = [i for i in f.get("/api/pulse/review").ok()["items"] if i["task_id"] == g.task_id]
    assert item["checkpoint_size"] == size

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f.url + "/pulse/claims")
            row = page.locator(f'#pulse-claims tr[data-task-id="{g.task_id}"]')
            expect(row.locator(".pulse-checkpoint")).to_contain_text(f"{size} B, ")
            expect(page.locator(f'#pulse-claims tr[data-task-id="{plain.task_id}"]')
                   .locator(".pulse-checkpoint")).to_have_text("-")

            page.goto(f.url + "/pulse/review")
            cell = page.locator(f'#pulse-review tr[data-task-id="{g.task_id}"] .pulse-checkpoint')
            expect(cell).to_contain_text(f"{size} B, ")
            cell.locator("a").click()  # to the claim, where its value is

            cp = page.locator("#pulse-checkpoint")
            expect(cp).to_contain_text(f"{size} B, written")
            expect(cp).to_contain_text(f"by epoch {g.epoch}")
            value = cp.locator("details code")
            expect(value).not_to_be_visible()  # the value on request
            cp.locator("summary").click()
            expect(value).to_contain_text('"cursor": 350')
        finally:
            browser.close()
