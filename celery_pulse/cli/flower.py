"""``celery -A proj pulse flower [Flower's options]``: Flower, with the Pulse page.

A drop-in for ``celery -A proj flower``: the same options (``--port``, ``--address``,
``--url_prefix``, ``--basic_auth``, ``--auth``, ``--certfile``/``--keyfile``, ``FLOWER_*``
variables, ``flowerconfig.py``), parsed by Flower's own functions, the same server; the
only difference is :func:`celery_pulse.flower.extend` applied to the application before
it serves. Flower is imported when the command runs (it is an optional dependency).
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import sys

import click
from celery.bin.base import CeleryCommand


@click.command("flower", cls=CeleryCommand, context_settings={"ignore_unknown_options": True})
@click.argument("tornado_argv", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def flower_command(ctx: click.Context, tornado_argv: tuple[str, ...]) -> None:
    """Flower with pulse's pages (claims, review, workers, leader, permits) in its nav."""
    try:
        from flower import command as flower_cli
        from flower.urls import settings
        from tornado.options import options

        from celery_pulse.flower import PulseFlower
    except ImportError as exc:
        raise click.ClickException(f"Flower is not installed ({exc}): pip install flower"
                                   ) from None
    flower_cli.apply_env_options()
    flower_cli.apply_options(sys.argv[0], tornado_argv)
    flower_cli.extract_settings()
    flower_cli.setup_logging()

    app = ctx.obj.app
    flower_app = PulseFlower(capp=app, options=options, **settings)
    atexit.register(flower_app.stop)
    signal.signal(signal.SIGTERM, flower_cli.sigterm_handler)
    port = flower_app.start_http_server()
    if not ctx.obj.quiet:
        flower_cli.print_banner(app, "ssl_options" in settings, port)
    with contextlib.suppress(KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: a clean stop
        flower_app.start()
