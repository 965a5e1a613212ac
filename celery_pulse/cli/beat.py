"""``celery pulse beat``: the leader-elected beat as a process of its own.

Any number of replicas may run: each campaigns for the beat lease, and only its holder
publishes due entries. SIGTERM or SIGINT stops beat, then the elector, which releases the
lease (another replica takes over within one interval).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

import click

from celery_pulse.cli.context import opened_store, settings_of


@click.command("beat")
@click.option("--name", default=None, help="Holder id (default beat@HOST:PID).")
@click.pass_context
def beat_command(ctx: click.Context, name: str | None) -> None:
    """Run the leader-elected beat as its own process (any number of replicas)."""
    from celery_pulse.beat import Beat
    from celery_pulse.bootsteps.runtime import BEAT_KEY
    from celery_pulse.bootsteps.schedules import EntrySource, publisher
    from celery_pulse.leader import LeaderElector

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s] %(message)s")
    app = ctx.obj.app
    settings = settings_of(ctx)
    holder = name or f"beat@{socket.gethostname()}:{os.getpid()}"
    with opened_store(ctx, role="beat") as store:
        elector = LeaderElector(store, BEAT_KEY, holder, ttl=settings.leader_ttl,
                                interval=settings.leader_interval,
                                margin=settings.leader_margin)
        source = EntrySource(app, store)
        beat = Beat(store, elector, entries=source, publish=publisher(app, source.published),
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
