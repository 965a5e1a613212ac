"""The project's Celery app, the standard Django way, plus ``celery_pulse.install``.

Run a worker with ``celery -A example_django.shop worker -P pulse``.
"""

import os

from celery import Celery

import celery_pulse

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_django.shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
celery_pulse.install(app)
