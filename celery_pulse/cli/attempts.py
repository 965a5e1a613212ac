"""``celery pulse attempts TASK_ID``: every attempt of one task, as the store has them.

What an operator asks after a failover or a late outcome: which grants did this task get
(epoch by epoch, through which gateway instance, when), which one holds it now, and what
the stale ones reported (evidence, never applied). Read-only; secrets never shown (the
store keeps none to show).
"""

from __future__ import annotations

from typing import Any

import click

from celery_pulse.cli import format as fmt
from celery_pulse.cli.context import echo_json, echo_lines, opened_store
from celery_pulse.cli.review import detail_payload
from celery_pulse.store.gateway_state import current_attempt
from celery_pulse.timefmt import iso


@click.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def attempts(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """A task's attempts: its claim, the grants gateways assigned, the evidence kept."""
    with opened_store(ctx) as store:
        payload = detail_payload(store, task_id)
        if payload is None:
            raise click.ClickException(f"no claim for task {task_id}")
        claim = payload["claim"]
        payload["gateway_attempts"] = [
            {"attempt_id": record.attempt_id, "instance_id": record.instance_id,
             "epoch": record.epoch, "assigned_at": assigned_at,
             "current": current_attempt(record, claim["state"], claim["epoch"])}
            for record, assigned_at in store.gateway_state.attempts_of(task_id)]
    if as_json:
        echo_json(payload)
    else:
        echo_lines(_lines(payload))


def _lines(payload: dict[str, Any]) -> list[str]:
    lines = fmt.detail_lines(payload)
    grants = payload["gateway_attempts"]
    if not grants:
        return [*lines, "no gateway attempt (run by direct workers, or purged)"]
    return [*lines, "attempts assigned through a gateway:", *fmt.table(
        ["EPOCH", "ATTEMPT", "INSTANCE", "ASSIGNED", ""],
        [[str(g["epoch"]), g["attempt_id"], g["instance_id"], iso(g["assigned_at"]),
          "current" if g["current"] else ""] for g in grants], right=[0])]
