"""What every ``celery pulse`` command shares: the app's settings, an open store, who acts.

A command never opens the store itself: :func:`opened_store` turns every
:class:`~celery_pulse.errors.PulseError` (the store is down, the schema is missing, a
fenced write refused) into a one-line ``Error: ...`` and exit code 1, and closes the
store on every way out.
"""

from __future__ import annotations

import getpass
import json
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from celery_pulse.errors import PulseError
from celery_pulse.settings import Settings
from celery_pulse.store.sql import SqlStore, open_store
from celery_pulse.store.sql.engine import EngineOptions


def settings_of(ctx: click.Context) -> Settings:
    """The ``pulse_*`` settings of the app given with ``-A``."""
    app = ctx.obj.app if ctx.obj is not None else None
    if app is None:
        raise click.UsageError("pass the Celery app: celery -A proj pulse ...")
    return Settings.from_conf(app.conf)


@contextmanager
def opened_store(ctx: click.Context, *, check_schema: bool = True, role: str = "cli"
                 ) -> Iterator[SqlStore]:
    """The app's store, open for the ``with`` block; store errors end the command.

    ``role`` names its connections (``gateway``, ``beat``: the long-running commands)."""
    try:
        settings = settings_of(ctx)
        store = open_store(settings.store_url, settings.store_connect_timeout,
                           check_schema=check_schema, options=EngineOptions.of(settings, role))
    except PulseError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        yield store
    except PulseError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        store.close()


def who() -> str:
    """The operator, as the audit columns record them (``user@host``)."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def echo_lines(lines: Iterable[str]) -> None:
    """Print what :mod:`celery_pulse.cli.format` laid out, a line at a time."""
    for line in lines:
        click.echo(line)


def echo_json(payload: Any) -> None:
    """The ``--json`` form of every command: indented, keys sorted (stable for scripts)."""
    click.echo(json.dumps(payload, indent=2, sort_keys=True))
