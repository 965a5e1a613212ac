"""``celery pulse workers|drain|undrain``: the registry, read and steered by hand.

A drain is a flag in the store, not a signal: the worker sees it at its next heartbeat,
and it outlives restarts of that worker name until ``undrain``.
"""

from __future__ import annotations

import time
from typing import Any

import click

from celery_pulse.cli import format as fmt
from celery_pulse.cli.context import echo_json, echo_lines, opened_store, who
from celery_pulse.store.sql import SqlStore


def workers_payload(store: SqlStore) -> list[dict[str, Any]]:
    """Registered workers as ``--json`` shows them (``pulse status`` embeds the same rows)."""
    # ``via``: a gateway registers its remote workers with the label; others are direct.
    return [{"id": w.worker_id, "alive": w.alive, "expires_in": round(w.expires_in, 3),
             "draining": w.draining, "labels": dict(w.labels),
             "via": "gateway" if w.labels.get("via") == "gateway" else "direct",
             "registered_at": w.registered_at, "last_heartbeat": w.last_heartbeat}
            for w in store.list_workers()]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def workers(ctx: click.Context, as_json: bool) -> None:
    """Registered workers; `alive` is judged by the store clock."""
    with opened_store(ctx) as store:
        rows = workers_payload(store)
    if as_json:
        echo_json(rows)
    else:
        echo_lines(fmt.workers_lines(rows))


@click.command()
@click.argument("worker")
@click.option("--wait", is_flag=True, help="Block until the worker has exited.")
@click.option("--timeout", default=3600.0, show_default=True, help="With --wait: give up after.")
@click.pass_context
def drain(ctx: click.Context, worker: str, wait: bool, timeout: float) -> None:
    """Persistent drain: WORKER stops taking tasks, finishes its own, exits 0.

    The flag outlives restarts of that name until `pulse undrain WORKER`.
    """
    with opened_store(ctx) as store:
        store.set_drain(worker, True, who())
        click.echo(f"{worker}: drain requested (seen at its next heartbeat)")
        if not wait:
            return
        deadline = time.monotonic() + timeout
        while True:
            row = next((w for w in store.list_workers() if w.worker_id == worker), None)
            if row is None or not row.alive:
                click.echo(f"{worker}: gone")
                return
            running = sum(1 for c in store.list_claims(["running", "reserved"])
                          if c.holder == worker)
            click.echo(f"{worker}: draining, {running} task(s) still held", err=True)
            if time.monotonic() > deadline:
                raise click.ClickException(f"{worker} still running after {timeout:g}s")
            time.sleep(1.0)


@click.command()
@click.argument("worker")
@click.pass_context
def undrain(ctx: click.Context, worker: str) -> None:
    """Clear a persistent drain so WORKER may run again."""
    with opened_store(ctx) as store:
        store.set_drain(worker, False, who())
    click.echo(f"{worker}: drain cleared")
