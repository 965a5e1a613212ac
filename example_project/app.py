"""The example app: configuration only; the tasks live in :mod:`example_project.tasks`.

Embedded default (no servers): a SQLite store and kombu's ``filesystem://`` broker,
both under ``./.celery-pulse/`` (or ``$PULSE_EXAMPLE_DIR``). For production set::

    PULSE_STORE_URL=postgresql+psycopg://root@127.0.0.1/test
    PULSE_BROKER_URL=amqp://guest:guest@127.0.0.1//

``PULSE_EXAMPLE_QUEUE`` names the queue (default ``celery``). ``PULSE_DEMO_FAST=1``
shortens every TTL so that the demo
(``python -m example_project.demo``) shows expiry, takeover and failover in seconds.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import worker_init

import celery_pulse
from celery_pulse.embedded import atomic_filesystem_puts

FAST = bool(os.environ.get("PULSE_DEMO_FAST"))




def embedded_broker(here: str, fast: bool = FAST) -> tuple[str, dict[str, Any]]:
    """kombu's ``filesystem://`` broker in ``here/broker`` (URL, transport options)."""
    folder = os.path.join(here, "broker")
    for sub in ("in", "processed", "control"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    return "filesystem://", {
        "data_folder_in": os.path.join(folder, "in"),
        "data_folder_out": os.path.join(folder, "in"),
        "processed_folder": os.path.join(folder, "processed"),
        "control_folder": os.path.join(folder, "control"),
        "store_processed": False,
        # The filesystem transport polls its folder (kombu's default: every second).
        "polling_interval": 0.1 if fast else 0.5,
    }


def embedded_store_url(here: str) -> str:
    """The SQLite store in ``here``."""
    return "sqlite:///" + os.path.join(here, "pulse.sqlite3")


HERE = os.path.abspath(os.environ.get("PULSE_EXAMPLE_DIR", ".celery-pulse"))
broker = os.environ.get("PULSE_BROKER_URL")
transport_options: dict[str, Any] = {}
if not broker:
    broker, transport_options = embedded_broker(HERE)
if broker.startswith("filesystem"):
    atomic_filesystem_puts()

app = Celery("example_project", broker=broker, include=["example_project.tasks"])
app.conf.update(
    broker_transport_options=transport_options,
    pulse_store_url=os.environ.get("PULSE_STORE_URL") or embedded_store_url(HERE),
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("PULSE_EXAMPLE_QUEUE", "celery"),
    # One periodic entry. Every -P pulse worker runs pulse's leader-elected beat, so
    # there is no separate `celery beat` process: only the leader ticks, and each
    # slot fires exactly once across crashes and failovers.
    beat_schedule={
        "sync-rates": {"task": "example_project.tasks.sync_rates",
                       "schedule": 2.0 if FAST else 60.0},
    },
)
if FAST:  # the demo wants expiry, takeover and failover within seconds
    app.conf.update(pulse_worker_ttl=3, pulse_lease_ttl=3, pulse_leader_ttl=3,
                    pulse_recover_interval=0.5, pulse_revoke_grace=2)
celery_pulse.install(app)


@worker_init.connect
def _create_example_tables(sender: Any = None, **_kwargs: Any) -> None:
    """The example's own tables live in the store's database; create them at startup.

    Runs once in each worker's main process, before the pool forks. Idempotent, so
    any number of workers may start at once. ``python -m example_project.schema``
    does the same by hand (next to ``celery -A example_project pulse migrate``).
    """
    if getattr(sender, "app", app) is not app:
        return
    from example_project.schema import ensure_schema

    ensure_schema(app.conf.pulse_store_url)
