"""An app with the mistakes a user makes, for tests/acceptance/test_mistakes.py.

Configured like :mod:`tests.apps.pulseapp` (``PULSE_TEST_BROKER``, ``PULSE_TEST_STORE``,
``PULSE_TEST_QUEUE``, ``PULSE_TEST_CONF``), plus the mistake to make:
``PULSE_TEST_NO_INSTALL=1`` never calls ``celery_pulse.install(app)``;
``PULSE_TEST_TASK_OPTION=NAME`` gives a task the option ``NAME=3``;
``PULSE_TEST_NAMESPACE_CONF`` (a JSON object) is loaded as Django projects do, with
``config_from_object(..., namespace="CELERY")``.
"""

from __future__ import annotations

import json
import os

from celery import Celery

import celery_pulse

app = Celery("mistakesapp", broker=os.environ.get("PULSE_TEST_BROKER", "memory://"))
app.conf.update(
    pulse_store_url=os.environ.get("PULSE_TEST_STORE"),
    task_default_queue=os.environ.get("PULSE_TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
)
app.conf.update(json.loads(os.environ.get("PULSE_TEST_CONF", "{}")))
if "PULSE_TEST_NAMESPACE_CONF" in os.environ:
    settings = {f"CELERY_{key.upper()}": value for key, value in app.conf.changes.items()}
    settings.update(json.loads(os.environ["PULSE_TEST_NAMESPACE_CONF"]))
    app.config_from_object(type("Settings", (), settings), namespace="CELERY")
if os.environ.get("PULSE_TEST_NO_INSTALL") != "1":
    celery_pulse.install(app)

_option = os.environ.get("PULSE_TEST_TASK_OPTION")


@app.task(name="mistakesapp.echo", **({_option: 3} if _option else {}))
def echo(value: str) -> str:
    return value
