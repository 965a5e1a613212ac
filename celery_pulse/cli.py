"""``celery -A proj pulse ...``: migrate the schema and look at the cluster.

Loaded by Celery through the ``celery.commands`` entry point; that import is
also where ``-P pulse`` becomes a valid choice (see ``install.register_pool_alias``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from celery_pulse.errors import PulseError
from celery_pulse.install import register_pool_alias
from celery_pulse.settings import Settings
from celery_pulse.store.sql import SqlStore, open_store

register_pool_alias()

F = TypeVar("F", bound=Callable[..., Any])


def _settings(ctx: click.Context) -> Settings:
    app = ctx.obj.app if ctx.obj is not None else None
    if app is None:
        raise click.UsageError("pass the Celery app: celery -A proj pulse ...")
    return Settings.from_conf(app.conf)


@contextmanager
def _store(ctx: click.Context, *, check_schema: bool = True) -> Iterator[SqlStore]:
    try:
        settings = _settings(ctx)
        store = open_store(settings.store_url, settings.store_connect_timeout,
                           check_schema=check_schema)
    except PulseError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        yield store
    except PulseError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        store.close()


def _fmt_seconds(value: float) -> str:
    return f"{value:+.1f}s"


@click.group(name="pulse")
@click.pass_context
def pulse(ctx: click.Context) -> None:
    """celery-pulse: leases, registry, recover and leader-elected beat."""


@pulse.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the pulse schema (idempotent)."""
    with _store(ctx, check_schema=False) as store:
        before, after = store.migrate()
        if before == after:
            click.echo(f"pulse schema in {store.url} is up to date (revision {after})")
        else:
            click.echo(f"pulse schema in {store.url} migrated: {before or 'empty'} -> {after}")


def _workers_payload(store: SqlStore) -> list[dict[str, Any]]:
    return [{"id": w.worker_id, "alive": w.alive, "expires_in": round(w.expires_in, 3),
             "draining": w.draining, "labels": dict(w.labels),
             "registered_at": w.registered_at, "last_heartbeat": w.last_heartbeat}
            for w in store.list_workers()]


def _print_workers(rows: list[dict[str, Any]]) -> None:
    if not rows:
        click.echo("no workers registered")
        return
    width = max(len(r["id"]) for r in rows)
    click.echo(f"{'WORKER':<{width}}  {'ALIVE':<5}  {'EXPIRES IN':>10}  LABELS")
    for r in rows:
        alive = click.style("yes", fg="green") if r["alive"] else click.style("no ", fg="red")
        labels = ", ".join(f"{k}={v}" for k, v in sorted(r["labels"].items())
                           if k in ("pool", "concurrency", "pid", "queues"))
        click.echo(f"{r['id']:<{width}}  {alive:<5}  {_fmt_seconds(r['expires_in']):>10}  "
                   f"{labels}" + ("  [draining]" if r["draining"] else ""))


@pulse.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def workers(ctx: click.Context, as_json: bool) -> None:
    """Registered workers; `alive` is judged by the store clock."""
    with _store(ctx) as store:
        rows = _workers_payload(store)
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
    else:
        _print_workers(rows)


@pulse.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """The cluster at a glance (exit 1 when something needs a human)."""
    with _store(ctx) as store:
        rows = _workers_payload(store)
        payload = {"store": store.url, "store_now": store.now(), "workers": rows,
                   "workers_alive": sum(r["alive"] for r in rows),
                   "workers_dead": sum(not r["alive"] for r in rows)}
    if as_json:
        click.echo(json.dumps(payload, indent=2, sort_keys=True))
        return
    click.echo(f"store: {payload['store']}")
    click.echo(f"workers: {payload['workers_alive']} alive, {payload['workers_dead']} dead")
    _print_workers(rows)


def main() -> None:  # pragma: no cover - convenience for `python -m celery_pulse.cli`
    sys.exit(pulse())
