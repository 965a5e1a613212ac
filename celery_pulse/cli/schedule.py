"""``celery pulse schedule list|add|remove|pause|resume``: dynamic beat entries in SQL.

Static entries (``beat_schedule``) are listed beside them but never written: a static
entry wins over a dynamic one of the same name, so ``add`` refuses that name. An entry
is validated (its schedule built) before it is stored.
"""

from __future__ import annotations

import json

import click

from celery_pulse.cli.context import echo_json, opened_store
from celery_pulse.errors import PulseError


@click.group()
def schedule() -> None:
    """Dynamic schedule entries stored in SQL, beside the static beat_schedule."""


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def schedule_list(ctx: click.Context, as_json: bool) -> None:
    """Static (beat_schedule) and dynamic entries, with last_run_at."""
    app = ctx.obj.app
    with opened_store(ctx) as store:
        last = store.last_run()
        rows = [{"name": n, "task": spec["task"], "source": "static",
                 "schedule": str(spec["schedule"]), "enabled": True, "last_run_at": last.get(n)}
                for n, spec in (app.conf.beat_schedule or {}).items()]
        rows += [{"name": r.name, "task": r.task, "source": "dynamic",
                  "schedule": f"{r.kind} {r.spec}", "enabled": r.enabled,
                  "last_run_at": last.get(r.name)} for r in store.list_schedule()]
    if as_json:
        echo_json(rows)
        return
    for r in rows:
        click.echo(f"{r['name']:<24} {r['source']:<8} {'on ' if r['enabled'] else 'off'} "
                   f"{r['task']:<32} {r['schedule']}")


@schedule.command("add")
@click.argument("name")
@click.option("--task", required=True, help="Task name.")
@click.option("--every", type=float, default=None, help="Interval in seconds.")
@click.option("--crontab", "cron", default=None,
              help='JSON of crontab fields, e.g. \'{"minute": "*/5"}\'.')
@click.option("--args", "args_json", default="[]", help="JSON list.")
@click.option("--kwargs", "kwargs_json", default="{}", help="JSON object.")
@click.option("--options", "options_json", default="{}", help="JSON object (apply_async options).")
@click.pass_context
def schedule_add(ctx: click.Context, name: str, task: str, every: float | None,
                 cron: str | None, args_json: str, kwargs_json: str, options_json: str) -> None:
    """Add or replace a dynamic entry (validated before it is stored)."""
    from celery_pulse.bootsteps.schedules import schedule_from_row
    from celery_pulse.store.records import ScheduleRow

    if (every is None) == (cron is None):
        raise click.UsageError("give exactly one of --every SECONDS or --crontab JSON")
    static = ctx.obj.app.conf.beat_schedule or {} if ctx.obj is not None else {}
    if name in static:
        raise click.ClickException(
            f"{name!r} is a static entry of beat_schedule, which wins over a dynamic one of "
            f"the same name: give the dynamic entry another name")
    try:
        kind, spec = ("interval", {"every": every}) if every is not None else (
            "crontab", json.loads(cron or "{}"))
        args, kwargs, options = (json.loads(args_json), json.loads(kwargs_json),
                                 json.loads(options_json))
        if not isinstance(args, list) or not isinstance(kwargs, dict) or not isinstance(
                options, dict):
            raise ValueError("--args must be a JSON list; --kwargs/--options JSON objects")
        schedule_from_row(kind, spec)
    except (ValueError, TypeError, KeyError, PulseError) as exc:
        raise click.ClickException(f"invalid schedule entry {name!r}: {exc}") from None
    with opened_store(ctx) as store:
        store.put_schedule(ScheduleRow(name, task, kind, json.dumps(spec), json.dumps(args),
                                       json.dumps(kwargs), json.dumps(options), True, 0.0))
    click.echo(f"schedule entry {name!r} saved")


def _schedule_toggle(ctx: click.Context, name: str, action: str) -> None:
    """``remove``, ``pause`` or ``resume`` one dynamic entry; a missing one is an error."""
    with opened_store(ctx) as store:
        if action == "remove":
            ok = store.remove_schedule(name)
        else:
            ok = store.set_schedule_enabled(name, action == "resume")
    if not ok:
        raise click.ClickException(f"no dynamic schedule entry {name!r}")
    click.echo(f"schedule entry {name!r}: {action}d" if action != "pause" else
               f"schedule entry {name!r}: paused")


@schedule.command("remove")
@click.argument("name")
@click.pass_context
def schedule_remove(ctx: click.Context, name: str) -> None:
    """Delete a dynamic entry."""
    _schedule_toggle(ctx, name, "remove")


@schedule.command("pause")
@click.argument("name")
@click.pass_context
def schedule_pause(ctx: click.Context, name: str) -> None:
    """Stop firing a dynamic entry (kept)."""
    _schedule_toggle(ctx, name, "pause")


@schedule.command("resume")
@click.argument("name")
@click.pass_context
def schedule_resume(ctx: click.Context, name: str) -> None:
    """Fire a paused dynamic entry again."""
    _schedule_toggle(ctx, name, "resume")
