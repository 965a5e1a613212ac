"""``celery pulse claims``: the claim table, one row per task the store has seen.

Remaining leases are judged by the store clock, like everything the store fences.
"""

from __future__ import annotations

from typing import Any

import click

from celery_pulse.cli import format as fmt
from celery_pulse.cli.context import echo_json, echo_lines, opened_store
from celery_pulse.store.records import ClaimInfo


def claim_payload(c: ClaimInfo, now: float | None = None) -> dict[str, Any]:
    """A claim as ``--json`` shows it (``now``: the store clock, for the checkpoint's age)."""
    return {"task_id": c.task_id, "task": c.task_name, "state": c.state, "holder": c.holder,
            "epoch": c.epoch, "attempts": c.attempts, "max_attempts": c.max_attempts,
            "policy": c.policy,
            "lease_remaining": None if c.lease_remaining is None else round(c.lease_remaining, 3),
            "outcome": c.outcome, "error": c.error, "created_at": c.created_at,
            "started_at": c.started_at, "finished_at": c.finished_at,
            "checkpoint_at": c.checkpoint_at, "checkpoint_size": c.checkpoint_size,
            "checkpoint_age": None if c.checkpoint_at is None or now is None
            else round(now - c.checkpoint_at, 3)}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--state", "states", multiple=True, callback=fmt.parse_states,
              help="Only these states, comma-separated or repeated (default: reserved,running; "
                   f"valid: {','.join(fmt.CLAIM_STATES)}).")
@click.option("--limit", default=200, show_default=True)
@click.pass_context
def claims(ctx: click.Context, as_json: bool, states: list[str], limit: int) -> None:
    """Task claims: holder, epoch, remaining lease (store clock), attempts."""
    with opened_store(ctx) as store:
        now = store.now()
        rows = [claim_payload(c, now) for c in store.list_claims(states, limit=limit)]
    if as_json:
        echo_json(rows)
    else:
        echo_lines(fmt.claims_lines(rows))
