"""``celery -A proj pulse ...``: migrate the schema and look at the cluster.

Loaded by Celery through the ``celery.commands`` entry point (``celery_pulse.cli:pulse``);
that import is also where ``-P pulse`` becomes a valid choice (see
``install.register_pool_alias``). Since every ``celery`` invocation loads it, the
commands import the worker's, beat's and the gateway's modules when they run.

One module per command family, each defining its commands; this module only gathers
them into the ``pulse`` group:

* :mod:`.migrate`: ``migrate`` (the schema);
* :mod:`.workers`: ``workers``, ``drain``, ``undrain`` (the registry);
* :mod:`.claims`: ``claims``; :mod:`.status`: ``status`` (the health check);
* :mod:`.review`: ``review [retry|resolve]`` (tasks with an unknown outcome);
* :mod:`.schedule`: ``schedule ...`` (dynamic beat entries); :mod:`.beat`: ``beat``;
* :mod:`.credentials`: ``credentials ...``; :mod:`.gateway`: ``gateway``;
* :mod:`.flower`: ``flower`` (Flower with the Pulse page, :mod:`celery_pulse.flower`);
* shared by all: :mod:`.context` (settings, the store, who acts) and :mod:`.format`
  (what people read).
"""

from __future__ import annotations

import sys

import click

from celery_pulse.cli.attempts import attempts
from celery_pulse.cli.beat import beat_command
from celery_pulse.cli.claims import claims
from celery_pulse.cli.credentials import credentials
from celery_pulse.cli.flower import flower_command
from celery_pulse.cli.gateway import gateway_command
from celery_pulse.cli.migrate import migrate
from celery_pulse.cli.review import review
from celery_pulse.cli.schedule import schedule
from celery_pulse.cli.status import status
from celery_pulse.cli.workers import drain, undrain, workers
from celery_pulse.install import register_pool_alias

register_pool_alias()

__all__ = ["main", "pulse"]


@click.group(name="pulse")
@click.pass_context
def pulse(ctx: click.Context) -> None:
    """celery-pulse: leases, registry, recover and leader-elected beat."""


pulse.add_command(migrate)
pulse.add_command(workers)
pulse.add_command(claims)
pulse.add_command(attempts)
pulse.add_command(review)
pulse.add_command(status)
pulse.add_command(drain)
pulse.add_command(undrain)
pulse.add_command(beat_command)
pulse.add_command(schedule)
pulse.add_command(credentials)
pulse.add_command(gateway_command)
pulse.add_command(flower_command)


def main() -> None:  # pragma: no cover - a direct entry to the group, outside `celery`
    sys.exit(pulse())
