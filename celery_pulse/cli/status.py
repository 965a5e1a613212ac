"""``celery pulse status``: the cluster at a glance, and the health check's exit code.

It exits 1 when something needs a human (a task in review, a schedule with no live beat
leader), so a monitoring probe can run it as is.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import click

from celery_pulse.cli import format as fmt
from celery_pulse.cli.context import echo_json, echo_lines, opened_store, settings_of
from celery_pulse.cli.workers import workers_payload
from celery_pulse.store.sql import SqlStore

#: The claim states the summary counts, zero when the store has none in that state.
COUNTED_STATES = ("reserved", "running", "open", "expired", "succeeded", "failed", "revoked",
                  "needs_review")


def leader_payload(store: SqlStore) -> dict[str, Any] | None:
    """The beat leader's lease, or None when no process ever held it."""
    from celery_pulse.bootsteps.runtime import BEAT_KEY

    info = store.get_leader(BEAT_KEY)
    if info is None:
        return None
    return {"holder": info.holder, "epoch": info.epoch, "alive": info.alive,
            "lease_remaining": round(info.lease_remaining, 3), "acquired_at": info.acquired_at}


def retention_payload(ctx: click.Context, store: SqlStore) -> dict[str, float]:
    """How far retention's purge is behind: ``lag``, the seconds the oldest finished claim
    is past ``pulse_retention`` (more than one purge interval: it does not keep up)."""
    settings = settings_of(ctx)
    return {"retention": settings.retention, "purge_interval": settings.purge_interval,
            "lag": round(store.retention_lag(settings.retention), 3)}


def status_payload(ctx: click.Context, store: SqlStore) -> dict[str, Any]:
    """Everything ``pulse status`` shows, with the problems that make it exit 1."""
    rows = workers_payload(store)
    counts = store.claim_counts()
    leader = leader_payload(store)
    has_schedule = bool(ctx.obj.app.conf.beat_schedule) or any(
        r.enabled for r in store.list_schedule())
    claims = {k: counts.get(k, 0) for k in COUNTED_STATES}
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
            "retention": retention_payload(ctx, store),
            "needs_attention": problems}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True)
@click.pass_context
def status(ctx: click.Context, as_json: bool, watch: bool, interval: float) -> None:
    """The cluster at a glance. Exit 1 when something needs a human (health checks)."""
    with opened_store(ctx) as store:
        while True:
            payload = status_payload(ctx, store)
            if as_json:
                echo_json(payload)
            else:
                if watch:
                    click.clear()
                echo_lines(fmt.status_lines(payload))
            if not watch:
                break
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                break
    if payload["needs_attention"]:
        ctx.exit(1)
