"""``celery pulse review [retry|resolve]``: the tasks whose outcome nobody knows.

A task lands here when it started and nobody can say how it ended (policy ``review``):
only a human can tell whether it ran, so the commands list it, run it once more, or
close it. Each action records who took it (``user@host``) and the note given, and goes
through :mod:`celery_pulse.operator` (as the Pulse page's buttons do): the store's
decision, the re-publish, the task events Flower shows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from celery_pulse.cli import format as fmt
from celery_pulse.cli.context import echo_json, echo_lines, opened_store, who
from celery_pulse.operator import resolve_review, retry_review
from celery_pulse.store.records import NEEDS_REVIEW
from celery_pulse.store.sql import SqlStore
from celery_pulse.store.views import detail_row
from celery_pulse.timefmt import iso


def review_payload(store: SqlStore) -> list[dict[str, Any]]:
    """Needs-review items, with why and since when each is there.

    ``since`` (kept for scripts) is when the task was reserved; ``entered_review_at`` when
    it entered review (a completion to review, or Recover's move, records it). Items moved
    by Recover before the store recorded that time have None: ``started_at`` of the lost
    attempt bounds it.
    """
    claims = {c.task_id: c for c in store.list_claims([NEEDS_REVIEW], limit=10_000)}
    items = []
    for item in store.list_review():
        row = dataclasses.asdict(item)
        c = claims.get(item.task_id)
        row["started_at"] = None if c is None else c.started_at
        row["entered_review_at"] = item.entered_at
        row["entered_review"] = None if item.entered_at is None else iso(item.entered_at)
        items.append(row)
    return items


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def review(ctx: click.Context, as_json: bool) -> None:
    """Tasks whose outcome is unknown (started, then lost): list, retry or resolve."""
    if ctx.invoked_subcommand is not None:
        return
    with opened_store(ctx) as store:
        items = review_payload(store)
    if as_json:
        echo_json(items)
    else:
        echo_lines(fmt.review_lines(items, fmt.app_argument(ctx)))


def detail_payload(store: SqlStore, task_id: str) -> dict[str, Any] | None:
    """One claim as a reviewer judges it (:func:`~celery_pulse.store.views.detail_row`)."""
    detail = store.claim_detail(task_id)
    return None if detail is None else detail_row(detail)


@review.command("show")
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def review_show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """What a task's attempts did: its claim, its stale attempts' late outcomes, decisions."""
    with opened_store(ctx) as store:
        payload = detail_payload(store, task_id)
    if payload is None:
        raise click.ClickException(f"no claim for task {task_id}")
    if as_json:
        echo_json(payload)
    else:
        echo_lines(fmt.detail_lines(payload))


@review.command("retry")
@click.argument("task_id")
@click.option("--note", default=None, help="Why (kept for audit).")
@click.option("--epoch", "expected_epoch", type=int, default=None,
              help="The epoch you looked at: refuse if the claim moved on since.")
@click.pass_context
def review_retry(ctx: click.Context, task_id: str, note: str | None,
                 expected_epoch: int | None) -> None:
    """Re-publish a needs-review (or failed) task for one more attempt."""
    with opened_store(ctx) as store:  # Moved, like any store error: 'Error: ...', exit 1
        done = retry_review(ctx.obj.app, store, task_id, who=who(), note=note,
                            expected_epoch=expected_epoch)
    click.echo(f"{task_id} re-published (epoch {done.epoch})")


@review.command("resolve")
@click.argument("task_id")
@click.option("--outcome", type=click.Choice(["succeeded", "failed"]), required=True)
@click.option("--note", default=None, help="Why (kept for audit).")
@click.option("--epoch", "expected_epoch", type=int, default=None,
              help="The epoch you looked at: refuse if the claim moved on since.")
@click.pass_context
def review_resolve(ctx: click.Context, task_id: str, outcome: str, note: str | None,
                   expected_epoch: int | None) -> None:
    """Close a needs-review task by hand."""
    with opened_store(ctx) as store:  # Moved, like any store error: 'Error: ...', exit 1
        resolve_review(ctx.obj.app, store, task_id, outcome, who=who(), note=note,
                       expected_epoch=expected_epoch)
    click.echo(f"{task_id} resolved as {outcome}")

