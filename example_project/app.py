"""The example app: configuration only; the tasks live in :mod:`example_project.tasks`."""

from __future__ import annotations

import os

from celery import Celery

import celery_pulse

HERE = os.path.abspath(os.environ.get("PULSE_EXAMPLE_DIR", ".celery-pulse"))


def _embedded_broker() -> tuple[str, dict[str, str]]:
    folder = os.path.join(HERE, "broker")
    for sub in ("in", "processed", "control"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    return "filesystem://", {
        "data_folder_in": os.path.join(folder, "in"),
        "data_folder_out": os.path.join(folder, "in"),
        "processed_folder": os.path.join(folder, "processed"),
        "control_folder": os.path.join(folder, "control"),
        "store_processed": False,  # type: ignore[dict-item]
    }


broker = os.environ.get("PULSE_BROKER_URL")
transport_options: dict[str, str] = {}
if not broker:
    broker, transport_options = _embedded_broker()

app = Celery("example_project", broker=broker, include=["example_project.tasks"])
app.conf.update(
    broker_transport_options=transport_options,
    pulse_store_url=os.environ.get("PULSE_STORE_URL")
    or "sqlite:///" + os.path.join(HERE, "pulse.sqlite3"),
    broker_connection_retry_on_startup=True,
)
if os.environ.get("PULSE_DEMO_FAST"):  # the demo wants to show expiry quickly
    app.conf.update(pulse_worker_ttl=5, pulse_lease_ttl=5)
celery_pulse.install(app)
