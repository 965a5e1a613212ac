"""``celery -A proj pulse ...``: migrate the schema and look at the cluster.

Loaded by Celery through the ``celery.commands`` entry point; that import is
also where ``-P pulse`` becomes a valid choice (see ``install.register_pool_alias``).
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from celery_pulse import cli_format as fmt
from celery_pulse.errors import PulseError
from celery_pulse.install import register_pool_alias
from celery_pulse.settings import Settings
from celery_pulse.store.base import NEEDS_REVIEW
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.timefmt import iso

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
    # ``via``: a gateway registers its remote workers with the label; others are direct.
    return [{"id": w.worker_id, "alive": w.alive, "expires_in": round(w.expires_in, 3),
             "draining": w.draining, "labels": dict(w.labels),
             "via": "gateway" if w.labels.get("via") == "gateway" else "direct",
             "registered_at": w.registered_at, "last_heartbeat": w.last_heartbeat}
            for w in store.list_workers()]


def _echo(lines: list[str]) -> None:
    for line in lines:
        click.echo(line)


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
        _echo(fmt.workers_lines(rows))


def _leader_payload(store: SqlStore) -> dict[str, Any] | None:
    from celery_pulse.bootsteps.runtime import BEAT_KEY

    info = store.get_leader(BEAT_KEY)
    if info is None:
        return None
    return {"holder": info.holder, "epoch": info.epoch, "alive": info.alive,
            "lease_remaining": round(info.lease_remaining, 3), "acquired_at": info.acquired_at}


def _claim_payload(c: Any) -> dict[str, Any]:
    return {"task_id": c.task_id, "task": c.task_name, "state": c.state, "holder": c.holder,
            "epoch": c.epoch, "attempts": c.attempts, "max_attempts": c.max_attempts,
            "policy": c.policy,
            "lease_remaining": None if c.lease_remaining is None else round(c.lease_remaining, 3),
            "outcome": c.outcome, "error": c.error, "created_at": c.created_at,
            "started_at": c.started_at, "finished_at": c.finished_at}


@pulse.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--state", "states", multiple=True, callback=fmt.parse_states,
              help="Only these states, comma-separated or repeated (default: reserved,running; "
                   f"valid: {','.join(fmt.CLAIM_STATES)}).")
@click.option("--limit", default=200, show_default=True)
@click.pass_context
def claims(ctx: click.Context, as_json: bool, states: list[str], limit: int) -> None:
    """Task claims: holder, epoch, remaining lease (store clock), attempts."""
    with _store(ctx) as store:
        rows = [_claim_payload(c) for c in store.list_claims(states, limit=limit)]
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
    else:
        _echo(fmt.claims_lines(rows))


def _review_payload(store: SqlStore) -> list[dict[str, Any]]:
    """Needs-review items, with when each entered review where the store recorded it.

    ``since`` (kept for scripts) is when the task was reserved. A completion that ends in
    review sets the claim's ``finished_at``: that is ``entered_review_at``. Recover's
    move to review records no time (None): ``started_at`` of the lost attempt bounds it.
    """
    claims = {c.task_id: c for c in store.list_claims([NEEDS_REVIEW], limit=10_000)}
    items = []
    for item in store.list_review():
        row = dataclasses.asdict(item)
        c = claims.get(item.task_id)
        row["started_at"] = None if c is None else c.started_at
        row["entered_review_at"] = None if c is None else c.finished_at
        row["entered_review"] = (None if row["entered_review_at"] is None
                                 else iso(row["entered_review_at"]))
        items.append(row)
    return items


@pulse.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def review(ctx: click.Context, as_json: bool) -> None:
    """Tasks whose outcome is unknown (started, then lost): list, retry or resolve."""
    if ctx.invoked_subcommand is not None:
        return
    with _store(ctx) as store:
        items = _review_payload(store)
    if as_json:
        click.echo(json.dumps(items, indent=2, sort_keys=True))
    else:
        _echo(fmt.review_lines(items, fmt.app_argument(ctx)))


def _who() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


@review.command("retry")
@click.argument("task_id")
@click.option("--note", default=None, help="Why (kept for audit).")
@click.pass_context
def review_retry(ctx: click.Context, task_id: str, note: str | None) -> None:
    """Re-publish a needs-review (or failed) task for one more attempt."""
    from celery_pulse.bootsteps.publish import republish

    app = ctx.obj.app
    with _store(ctx) as store:
        item = store.review_retry(task_id, f"review:{_who()}", 60.0, _who(), note)
        republish(app, item)
        store.mark_published([(item.task_id, item.epoch, item.token or "")])
    click.echo(f"{task_id} re-published (epoch {item.epoch})")


@review.command("resolve")
@click.argument("task_id")
@click.option("--outcome", type=click.Choice(["succeeded", "failed"]), required=True)
@click.option("--note", default=None, help="Why (kept for audit).")
@click.pass_context
def review_resolve(ctx: click.Context, task_id: str, outcome: str, note: str | None) -> None:
    """Close a needs-review task by hand."""
    with _store(ctx) as store:
        store.review_resolve(task_id, outcome, _who(), note)
    click.echo(f"{task_id} resolved as {outcome}")


def _status_payload(ctx: click.Context, store: SqlStore) -> dict[str, Any]:
    rows = _workers_payload(store)
    counts = store.claim_counts()
    leader = _leader_payload(store)
    has_schedule = bool(ctx.obj.app.conf.beat_schedule) or any(
        r.enabled for r in store.list_schedule())
    claims = {k: counts.get(k, 0) for k in
              ("reserved", "running", "open", "expired", "succeeded", "failed", "revoked",
               "needs_review")}
    problems = []
    if claims["needs_review"]:
        problems.append(f"{claims['needs_review']} task(s) need review: "
                        f"celery -A {fmt.app_argument(ctx)} pulse review")
    if has_schedule and (leader is None or not leader["alive"]):
        problems.append("a schedule exists but no beat leader is alive")
    return {"store": store.url, "store_now": store.now(), "workers": rows,
            "workers_alive": sum(r["alive"] for r in rows),
            "workers_dead": sum(not r["alive"] for r in rows),
            "leader": leader, "schedule": has_schedule, "claims": claims,
            "permits": [dataclasses.asdict(u) for u in store.permit_usage()],
            "needs_attention": problems}


@pulse.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True)
@click.pass_context
def status(ctx: click.Context, as_json: bool, watch: bool, interval: float) -> None:
    """The cluster at a glance. Exit 1 when something needs a human (health checks)."""
    import time

    with _store(ctx) as store:
        while True:
            payload = _status_payload(ctx, store)
            if as_json:
                click.echo(json.dumps(payload, indent=2, sort_keys=True))
            else:
                if watch:
                    click.clear()
                _echo(fmt.status_lines(payload))
            if not watch:
                break
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                break
    if payload["needs_attention"]:
        ctx.exit(1)


@pulse.command()
@click.argument("worker")
@click.option("--wait", is_flag=True, help="Block until the worker has exited.")
@click.option("--timeout", default=3600.0, show_default=True, help="With --wait: give up after.")
@click.pass_context
def drain(ctx: click.Context, worker: str, wait: bool, timeout: float) -> None:
    """Persistent drain: WORKER stops taking tasks, finishes its own, exits 0.

    The flag outlives restarts of that name until `pulse undrain WORKER`.
    """
    import time

    with _store(ctx) as store:
        store.set_drain(worker, True, _who())
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


@pulse.command()
@click.argument("worker")
@click.pass_context
def undrain(ctx: click.Context, worker: str) -> None:
    """Clear a persistent drain so WORKER may run again."""
    with _store(ctx) as store:
        store.set_drain(worker, False, _who())
    click.echo(f"{worker}: drain cleared")


@pulse.command("beat")
@click.option("--name", default=None, help="Holder id (default beat@HOST:PID).")
@click.pass_context
def beat_command(ctx: click.Context, name: str | None) -> None:
    """Run the leader-elected beat as its own process (any number of replicas)."""
    import logging
    import os
    import signal
    import threading

    from celery_pulse.beat import Beat
    from celery_pulse.bootsteps.runtime import BEAT_KEY
    from celery_pulse.bootsteps.schedules import EntrySource, publisher
    from celery_pulse.leader import LeaderElector

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s] %(message)s")
    app = ctx.obj.app
    settings = _settings(ctx)
    holder = name or f"beat@{socket.gethostname()}:{os.getpid()}"
    with _store(ctx) as store:
        elector = LeaderElector(store, BEAT_KEY, holder, ttl=settings.leader_ttl,
                                interval=settings.leader_interval,
                                margin=settings.leader_margin)
        beat = Beat(store, elector, entries=EntrySource(app, store), publish=publisher(app),
                    catchup=settings.beat_catchup, now=store.now)
        elector.on_gained = beat.on_gained
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        click.echo(f"pulse beat {holder}: campaigning for leadership (ttl "
                   f"{settings.leader_ttl:g}s)")
        beat.start()
        elector.start()
        done.wait()
        beat.stop()
        elector.stop()


@pulse.group()
def schedule() -> None:
    """Dynamic schedule entries stored in SQL, beside the static beat_schedule."""


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def schedule_list(ctx: click.Context, as_json: bool) -> None:
    """Static (beat_schedule) and dynamic entries, with last_run_at."""
    app = ctx.obj.app
    with _store(ctx) as store:
        last = store.last_run()
        rows = [{"name": n, "task": spec["task"], "source": "static",
                 "schedule": str(spec["schedule"]), "enabled": True, "last_run_at": last.get(n)}
                for n, spec in (app.conf.beat_schedule or {}).items()]
        rows += [{"name": r.name, "task": r.task, "source": "dynamic",
                  "schedule": f"{r.kind} {r.spec}", "enabled": r.enabled,
                  "last_run_at": last.get(r.name)} for r in store.list_schedule()]
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
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
    from celery_pulse.store.base import ScheduleRow

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
    with _store(ctx) as store:
        store.put_schedule(ScheduleRow(name, task, kind, json.dumps(spec), json.dumps(args),
                                       json.dumps(kwargs), json.dumps(options), True, 0.0))
    click.echo(f"schedule entry {name!r} saved")


def _schedule_toggle(ctx: click.Context, name: str, action: str) -> None:
    with _store(ctx) as store:
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


@pulse.group()
def credentials() -> None:
    """Lease gateway credentials: create (the token is shown once), list, revoke."""


def _credential_payload(c: Any) -> dict[str, Any]:
    """A credential as shown: everything but a secret (the store has none to show)."""
    return {"credential_id": c.credential_id, "name": c.name, "scopes": sorted(c.scopes),
            "queues": list(c.queues), "active": c.active, "created_at": c.created_at,
            "created_by": c.created_by, "revoked_at": c.revoked_at, "revoked_by": c.revoked_by}


def _open_private(path: str) -> int:
    """A new file only its owner can read; an existing file is never overwritten (it may
    be another credential's, or readable by others)."""
    import os

    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise click.ClickException(f"{path} exists: not overwriting it (remove it, or choose "
                                   f"another --output)") from None
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror}") from None


@credentials.command("create")
@click.argument("name")
@click.option("--queue", "queues", multiple=True, help="A queue it may consume (repeat).")
@click.option("--scope", "scopes", multiple=True,
              help="workers:connect or workers:consume (repeat; default both).")
@click.option("--output", default=None, type=click.Path(dir_okay=False),
              help="Write a JSON credentials file (mode 0600) instead of printing the token.")
@click.pass_context
def credentials_create(ctx: click.Context, name: str, queues: tuple[str, ...],
                       scopes: tuple[str, ...], output: str | None) -> None:
    """Create credential NAME: its token is shown (or written) once, never again."""
    import os

    from celery_pulse.gateway.credentials import CONNECT, CONSUME

    fd = _open_private(output) if output else None
    try:
        with _store(ctx) as store:
            record, token = store.credentials.create_credential(
                name, scopes or (CONNECT, CONSUME), queues, _who())
    except BaseException:
        if fd is not None and output:
            os.close(fd)
            os.unlink(output)
        raise
    if fd is None:
        click.echo(f"credential {record.name} ({record.credential_id}) created; its token, "
                   f"shown this once:", err=True)
        click.echo(token)
        return
    with os.fdopen(fd, "w") as fh:
        json.dump({"credential_id": record.credential_id, "name": record.name,
                   "token": token}, fh)
        fh.write("\n")
    click.echo(f"credential {record.name} ({record.credential_id}) created; token written to "
               f"{output}")


@credentials.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def credentials_list(ctx: click.Context, as_json: bool) -> None:
    """Every credential, revoked ones too (never a secret)."""
    with _store(ctx) as store:
        rows = [_credential_payload(c) for c in store.credentials.list_credentials()]
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    if not rows:
        click.echo("no credentials")
        return
    width = max(len(r["name"]) for r in rows)
    click.echo(f"{'NAME':<{width}}  {'ID':<32}  {'STATE':<7}  SCOPES / QUEUES")
    for r in rows:
        click.echo(f"{r['name']:<{width}}  {r['credential_id']}  "
                   f"{'active' if r['active'] else 'revoked':<7}  "
                   f"{','.join(r['scopes'])} / {','.join(r['queues']) or '-'}"
                   + ("" if r["active"] else f"  (revoked by {r['revoked_by']})"))


@credentials.command("revoke")
@click.argument("name_or_id")
@click.pass_context
def credentials_revoke(ctx: click.Context, name_or_id: str) -> None:
    """Revoke a credential for good: its token is refused from now on."""
    with _store(ctx) as store:
        record = store.credentials.revoke_credential(name_or_id, _who())
    click.echo(f"credential {record.name} ({record.credential_id}) revoked by "
               f"{record.revoked_by}")


@pulse.command("gateway")
@click.option("--bind", default="127.0.0.1:8443", show_default=True, help="HOST:PORT to listen on.")
@click.option("--certfile", default=None, type=click.Path(exists=True, dir_okay=False),
              help="TLS certificate chain (PEM). Without it the gateway speaks plain ws://.")
@click.option("--keyfile", default=None, type=click.Path(exists=True, dir_okay=False),
              help="TLS private key (PEM), if not in --certfile.")
@click.option("--max-connections", default=128, show_default=True, type=click.IntRange(1))
@click.pass_context
def gateway_command(ctx: click.Context, bind: str, certfile: str | None, keyfile: str | None,
                    max_connections: int) -> None:
    """Serve pulse.worker.v1 at wss://BIND/v1/worker/connect: workers that hold a gateway
    credential, and no database or broker credentials, lease tasks through it."""
    import asyncio
    import logging
    import os
    import signal

    from celery_pulse.bootsteps.publish import republish
    from celery_pulse.recover import Recoverer

    try:
        from celery_pulse.gateway.events import GatewayEvents
        from celery_pulse.gateway.server import Gateway, Limits, server_ssl_context
    except ImportError as exc:
        raise click.ClickException(f"the gateway needs the websockets library ({exc}): "
                                   f"pip install 'celery-pulse-leases[gateway]'") from None

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s] %(message)s")
    host, sep, port_text = bind.rpartition(":")
    if not sep or not port_text.isdigit():
        raise click.BadParameter("HOST:PORT, e.g. 0.0.0.0:8443", param_hint="--bind")
    if keyfile and not certfile:
        raise click.BadParameter("--keyfile needs --certfile", param_hint="--keyfile")
    settings = _settings(ctx)
    tls = server_ssl_context(certfile, keyfile) if certfile else None
    with _store(ctx) as store:
        gateway = Gateway(store.credentials, store.now, lease_ttl=settings.lease_ttl,
                          limits=Limits(max_connections=max_connections), store=store,
                          app=ctx.obj.app, on_lost=settings.on_lost,
                          max_attempts=settings.max_attempts,
                          events=GatewayEvents(ctx.obj.app, freq=Limits().session_ttl / 3))
        # Recover runs here too: a cluster of gateway workers alone still has its expired
        # claims taken over (retention stays with the direct workers' leader).
        recoverer = Recoverer(
            store, f"gateway@{socket.gethostname()}:{os.getpid()}",
            interval=settings.recover_interval, batch=settings.recover_batch,
            publish_ttl=max(5.0, settings.lease_ttl), retention=settings.retention,
            publish=lambda item: republish(ctx.obj.app, item), listener=_RecoverLog())

        async def run() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            beats = asyncio.ensure_future(gateway.heartbeats())
            async with await gateway.serve(host.strip("[]"), int(port_text), tls) as server:
                ports = sorted({s.getsockname()[1] for s in server.sockets})
                click.echo(f"pulse gateway: serving pulse.worker.v1 on "
                           f"{'wss' if tls else 'ws'}://{host}:{ports[0]}/v1/worker/connect",
                           err=True)
                if tls is None:
                    click.echo("pulse gateway: WARNING: no --certfile: plain ws://, for "
                               "development only", err=True)
                await stop.wait()
                click.echo("pulse gateway: stopping (closing connections)", err=True)
            beats.cancel()

        recoverer.start()
        try:
            asyncio.run(run())
        finally:
            recoverer.stop()


class _RecoverLog:
    """What the gateway's Recover took over, in its log."""

    def on_recovered(self, item: Any) -> None:
        click.echo(f"pulse gateway: recovered {item.task_name}[{item.task_id}] epoch "
                   f"{item.epoch}: {item.was} -> {item.state}", err=True)


def main() -> None:  # pragma: no cover - convenience for `python -m celery_pulse.cli`
    sys.exit(pulse())
