"""``celery pulse migrate``: the one command that may open a store without its schema."""

from __future__ import annotations

import click

from celery_pulse.cli.context import opened_store


@click.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the pulse schema (idempotent)."""
    with opened_store(ctx, check_schema=False) as store:
        before, after = store.migrate()
        if before == after:
            click.echo(f"pulse schema in {store.url} is already at head (revision {after})")
        else:
            click.echo(f"pulse schema in {store.url} migrated: {before or 'empty'} -> {after}")
