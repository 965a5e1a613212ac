"""``celery pulse gateway``: the lease gateway's process, for workers with no store access.

It serves ``pulse.worker.v1`` (:mod:`celery_pulse.gateway.server`) and runs Recover
beside it, so a cluster of gateway workers alone still has its expired claims taken over.
The websockets library is optional (the ``gateway`` extra): without it, this command
says so and exits 1; every other command works.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

import click

from celery_pulse.cli.context import opened_store, settings_of
from celery_pulse.store.records import Recovered


class _RecoverLog:
    """What the gateway's Recover took over, in its log."""

    def on_redispatching(self, item: Recovered) -> None:
        """Nothing before the publish: the log line follows it."""

    def on_recovered(self, item: Recovered) -> None:
        click.echo(f"pulse gateway: recovered {item.task_name}[{item.task_id}] epoch "
                   f"{item.epoch}: {item.was} -> {item.state}", err=True)


@click.command("gateway")
@click.option("--bind", default="127.0.0.1:8443", show_default=True, help="HOST:PORT to listen on.")
@click.option("--certfile", default=None, type=click.Path(exists=True, dir_okay=False),
              help="TLS certificate chain (PEM). Without it the gateway speaks plain ws://.")
@click.option("--keyfile", default=None, type=click.Path(exists=True, dir_okay=False),
              help="TLS private key (PEM), if not in --certfile.")
@click.option("--max-connections", default=128, show_default=True, type=click.IntRange(1),
              help="Connections held at once, counted from accept.")
@click.option("--max-unauthenticated", default=None, type=click.IntRange(1),
              help="Of those, held by handshakes not yet authenticated [a quarter].")
@click.option("--max-per-credential", default=None, type=click.IntRange(1),
              help="Of those, held by one credential [half].")
@click.option("--read-idle", default=60.0, show_default=True, type=click.FloatRange(0.1),
              help="Seconds without a frame before the peer must answer a ping.")
@click.option("--dispatch-rate", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Dispatch rounds per second per worker instance (each reserves what "
                   "it has room for); 0: as fast as slots free up.")
@click.option("--allowed-origin", "allowed_origins", multiple=True, metavar="ORIGIN",
              help="A web page origin (scheme://host[:port]) allowed to connect; by default "
                   "any request with an Origin header (a browser's) is refused 403.")
@click.option("-l", "--loglevel", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.pass_context
def gateway_command(ctx: click.Context, bind: str, certfile: str | None, keyfile: str | None,
                    max_connections: int, max_unauthenticated: int | None,
                    max_per_credential: int | None, read_idle: float, dispatch_rate: float,
                    allowed_origins: tuple[str, ...], loglevel: str) -> None:
    """Serve pulse.worker.v1 at wss://BIND/v1/worker/connect: workers that hold a gateway
    credential, and no database or broker credentials, lease tasks through it."""
    from celery_pulse.bootsteps.publish import republish
    from celery_pulse.recover import Recoverer

    try:
        from celery_pulse.gateway.events import GatewayEvents
        from celery_pulse.gateway.server import Gateway, Limits, server_ssl_context
    except ImportError as exc:
        raise click.ClickException(f"the gateway needs the websockets library ({exc}): "
                                   f"pip install 'celery-pulse-leases[gateway]'") from None

    logging.basicConfig(level=loglevel.upper(), format="[%(asctime)s: %(levelname)s] %(message)s")
    host, sep, port_text = bind.rpartition(":")
    if not sep or not port_text.isdigit():
        raise click.BadParameter("HOST:PORT, e.g. 0.0.0.0:8443", param_hint="--bind")
    if keyfile and not certfile:
        raise click.BadParameter("--keyfile needs --certfile", param_hint="--keyfile")
    settings = settings_of(ctx)
    tls = server_ssl_context(certfile, keyfile) if certfile else None
    with opened_store(ctx, role="gateway") as store:
        gateway = Gateway(store.credentials, store.now, lease_ttl=settings.lease_ttl,
                          limits=Limits(max_connections=max_connections,
                                        max_unauthenticated=max_unauthenticated,
                                        max_per_credential=max_per_credential,
                                        read_idle=read_idle, dispatch_rate=dispatch_rate),
                          store=store,
                          app=ctx.obj.app, on_lost=settings.on_lost,
                          max_attempts=settings.max_attempts,
                          events=GatewayEvents(ctx.obj.app, freq=Limits().session_ttl / 3),
                          state=store.gateway_state, allowed_origins=allowed_origins,
                          concurrency_limits=settings.concurrency_limits,
                          rate_limits=settings.rate_limits)
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
            watch = asyncio.ensure_future(gateway.watch_sessions())
            revokes = asyncio.ensure_future(gateway.listen_revokes())
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
            watch.cancel()
            revokes.cancel()

        recoverer.start()
        try:
            asyncio.run(run())
        finally:
            recoverer.stop()
